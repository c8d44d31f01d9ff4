"""Feed Attention (and the rotary embeddings before it) the 3-D [batch, seq, heads·dim] layout.

After fuse-rotary and fuse-attention, every layer still splits heads out and back in::

    Q = Rotary(Transpose(Reshape(q, [B, S, H, D]), perm=[0, 2, 1, 3]))   (K likewise, V without
    out = Reshape(Transpose(Attention(Q, K, V, ...), perm=[0, 2, 1, 3]), [B, S, H·D])   rotary)

ONNX Attention-23 and RotaryEmbedding-23 take the 3-D projections directly (with
``q_num_heads``/``kv_num_heads`` and ``num_heads`` attributes), so the eight Reshape/Transpose
nodes per layer go: on a decode step, where each node costs more in dispatch than in arithmetic,
that is a measurable share of the step. The cache (past/present) keeps its 4-D layout.

Any other 4-D Attention (exporters that split heads differently: GPT-2's 2-D output projection,
GPT-NeoX's interleaved QKV and partial rotary, Qwen3's per-head norms, Phi-3's rotary Concat) gets
the 3-D form too, with explicit conversions around it: each 4-D input becomes
``Reshape(Transpose(x, [0, 2, 1, 3]), [0, 0, -1])`` and the output goes back to 4-D the same way,
unless its readers were a Transpose + Reshape to match. Every Attention leaves this pass 3-D,
which the paged lowering needs.

Preconditions: run after fuse-rotary and fuse-attention, with shapes refreshed (head size must be
static; the query head count comes from the shapes, else from the ``llmc.num_heads`` metadata).
"""

from __future__ import annotations

import onnx

from llmc.passes.base import RewritePass
import numpy as np

from llmc.passes.graph import Graph, Rewrite, attr

_HEADS_TO_FRONT = [0, 2, 1, 3]


class Attention3dLayout(RewritePass):
    name = "attention-3d-layout"
    anchors = ("Attention",)
    target = "ONNX Attention-23 / RotaryEmbedding-23 on 3-D [batch, seq, heads·dim] inputs"

    def rewrite(self, graph: Graph, attention: onnx.NodeProto) -> Rewrite | None:
        if graph.rank(attention.input[0]) != 4:
            return None  # already 3-D
        removed, added, initializers, flat = [attention], [], [], []
        heads = []
        for position, name in enumerate(attention.input[:3]):
            found = _flat_source(graph, name, removed, added)
            if found is None:
                found = _flattened(graph, name, _head_count(graph, attention, position), added, initializers)
            if found is None:
                return None
            flat.append(found[0])
            heads.append(found[1])
        if heads[1] != heads[2]:
            return None
        output = _flat_output(graph, attention, removed, added, initializers)
        if output is None:
            return None
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
        fused = graph.node("Attention", flat + list(attention.input[3:]), [output, *attention.output[1:]],
                           q_num_heads=heads[0], kv_num_heads=heads[1], **attributes)
        return Rewrite(removed, added + [fused], initializers)


def _flat_output(graph: Graph, attention: onnx.NodeProto, removed: list, added: list,
                 initializers: list) -> str | None:
    """The name the 3-D Attention output takes: the output Reshape's when the readers are
    Transpose(perm=[0, 2, 1, 3]) + Reshape to 3-D (both removed), else a fresh name turned back
    into the 4-D output by new nodes."""
    transpose = graph.only_consumer(attention.output[0])
    reshape = transpose and graph.only_consumer(transpose.output[0])
    if (transpose is not None and transpose.op_type == "Transpose" and reshape is not None
            and reshape.op_type == "Reshape" and list(attr(transpose, "perm", [])) == _HEADS_TO_FRONT
            and graph.rank(reshape.output[0]) == 3):
        removed += [transpose, reshape]
        return reshape.output[0]
    shape = graph.shape(attention.output[0])
    head_dim = shape[3] if shape is not None and len(shape) == 4 else None
    if not isinstance(head_dim, int):
        return None
    flat = graph.fresh("attention_3d")
    split = graph.initializer("split_heads", np.array([0, 0, -1, head_dim], np.int64))
    unflat = graph.node("Reshape", [flat, split.name])
    added += [unflat, graph.node("Transpose", unflat.output, [attention.output[0]], perm=_HEADS_TO_FRONT)]
    initializers.append(split)
    return flat


def _head_count(graph: Graph, attention: onnx.NodeProto, position: int) -> int | None:
    """Heads of the 4-D Attention input at `position` (0: Q, 1: K, 2: V): its static dim 1, else
    the cache's (K and V), else the model's ``llmc.num_heads`` metadata (Q)."""
    shape = graph.shape(attention.input[position])
    if shape is not None and len(shape) == 4 and isinstance(shape[1], int):
        return shape[1]
    if position > 0 and len(attention.input) > 3 + position:
        cache = graph.shape(attention.input[3 + position])  # past_key / past_value
        if cache is not None and len(cache) == 4 and isinstance(cache[1], int):
            return cache[1]
    if position == 0:
        for prop in graph.model.metadata_props:
            if prop.key == "llmc.num_heads" and prop.value.isdigit():
                return int(prop.value)
    return None


def _flattened(graph: Graph, name: str, heads: int | None, added: list, initializers: list):
    """(3-D tensor, heads) computed from the 4-D [batch, heads, seq, dim] `name` by new nodes."""
    shape = graph.shape(name)
    if heads is None or shape is None or len(shape) != 4 or not isinstance(shape[3], int):
        return None
    merge = graph.initializer("merge_heads", np.array([0, 0, heads * shape[3]], np.int64))
    transpose = graph.node("Transpose", [name], perm=_HEADS_TO_FRONT)
    reshape = graph.node("Reshape", [transpose.output[0], merge.name])
    added += [transpose, reshape]
    initializers.append(merge)
    return reshape.output[0], heads


def _flat_source(graph: Graph, name: str, removed: list, added: list):
    """(3-D tensor, heads) behind a 4-D Attention input, re-emitting a rotary on it if present."""
    rotary = graph.producer_of(name, "RotaryEmbedding")
    split = _split_heads(graph, rotary.input[0] if rotary is not None else name)
    if split is None:
        return None
    flat, heads, nodes = split
    if rotary is None:
        if graph.consumers.get(name) != [graph.only_consumer(name)]:
            return None
        removed.extend(nodes)
        return flat, heads
    if graph.only_consumer(name) is None or graph.only_consumer(rotary.input[0]) is not rotary:
        return None
    new_rotary = graph.node("RotaryEmbedding", [flat, *rotary.input[1:]], 1, num_heads=heads,
                            **{a.name: onnx.helper.get_attribute_value(a) for a in rotary.attribute})
    removed.extend([rotary, *nodes])
    added.append(new_rotary)
    return new_rotary.output[0], heads


def _split_heads(graph: Graph, name: str):
    """(x, heads, [transpose, reshape]) when name = Transpose(Reshape(x, [B, S, H, D]), [0, 2, 1, 3])."""
    transpose = graph.producer_of(name, "Transpose")
    reshape = transpose and graph.producer_of(transpose.input[0], "Reshape")
    if reshape is None or list(attr(transpose, "perm", [])) != _HEADS_TO_FRONT:
        return None
    shape, flat_shape = graph.shape(reshape.output[0]), graph.shape(reshape.input[0])
    if shape is None or flat_shape is None or len(shape) != 4 or len(flat_shape) != 3:
        return None
    head_dim, width = shape[3], flat_shape[2]
    if not isinstance(head_dim, int) or not isinstance(width, int) or width % head_dim:
        return None
    heads = width // head_dim  # the reshape's head count is often a -1 that inference leaves open
    if isinstance(shape[2], int) and shape[2] != heads:
        return None
    if graph.only_consumer(reshape.output[0]) is not transpose:
        return None
    return reshape.input[0], heads, [transpose, reshape]
