"""Every pass by name: an explicit list, checked for duplicate names at import."""

from __future__ import annotations

from llmc.passes.base import Pass
from llmc.passes.eliminate_common_subexpressions import EliminateCommonSubexpressions
from llmc.passes.eliminate_dead_code import EliminateDeadCode
from llmc.passes.fold_constants import FoldConstants
from llmc.passes.fold_static_dims import FoldStaticDims
from llmc.passes.fuse_attention import FuseAttention
from llmc.passes.fuse_rotary import FuseRotary
from llmc.passes.merge_sibling_matmuls import MergeSiblingMatMuls

_ALL: list[type[Pass]] = [
    FoldConstants,
    FoldStaticDims,
    EliminateCommonSubexpressions,
    EliminateDeadCode,
    FuseRotary,
    FuseAttention,
    MergeSiblingMatMuls,
]

PASSES: dict[str, type[Pass]] = {}
for _cls in _ALL:
    if _cls.name in PASSES:
        raise RuntimeError(f"two passes are named '{_cls.name}'")
    PASSES[_cls.name] = _cls
