"""Every pass by name: an explicit list, checked for duplicate names at import."""

from __future__ import annotations

from llmc.passes.attention_3d_layout import Attention3dLayout
from llmc.passes.base import Pass
from llmc.passes.canonicalize_group_query_attention import CanonicalizeGroupQueryAttention
from llmc.passes.eliminate_common_subexpressions import EliminateCommonSubexpressions
from llmc.passes.eliminate_dead_code import EliminateDeadCode
from llmc.passes.fold_constants import FoldConstants
from llmc.passes.fold_static_dims import FoldStaticDims
from llmc.passes.fuse_attention import FuseAttention
from llmc.passes.fuse_gelu import FuseGelu
from llmc.passes.fuse_layer_norm import FuseLayerNorm
from llmc.passes.fuse_rms_norm import FuseRmsNorm
from llmc.passes.fuse_rotary import FuseRotary
from llmc.passes.fuse_silu import FuseSilu
from llmc.passes.fuse_skip_norm import FuseSkipNorm
from llmc.passes.merge_sibling_matmuls import MergeSiblingMatMuls
from llmc.passes.name_cache_positions import NameCachePositions

_ALL: list[type[Pass]] = [
    FoldConstants,
    FoldStaticDims,
    EliminateCommonSubexpressions,
    EliminateDeadCode,
    FuseLayerNorm,
    FuseRmsNorm,
    FuseGelu,
    FuseRotary,
    CanonicalizeGroupQueryAttention,
    FuseAttention,
    Attention3dLayout,
    MergeSiblingMatMuls,
    NameCachePositions,
    FuseSilu,
    FuseSkipNorm,
]

PASSES: dict[str, type[Pass]] = {}
for _cls in _ALL:
    if _cls.name in PASSES:
        raise RuntimeError(f"two passes are named '{_cls.name}'")
    PASSES[_cls.name] = _cls
