"""Feed Attention (and the rotary embeddings before it) the 3-D [batch, seq, heads·dim] layout.

After fuse-rotary and fuse-attention, every layer still splits heads out and back in::

    Q = Rotary(Transpose(Reshape(q, [B, S, H, D]), perm=[0, 2, 1, 3]))   (K likewise, V without
    out = Reshape(Transpose(Attention(Q, K, V, ...), perm=[0, 2, 1, 3]), [B, S, H·D])   rotary)

ONNX Attention-23 and RotaryEmbedding-23 take the 3-D projections directly (with
``q_num_heads``/``kv_num_heads`` and ``num_heads`` attributes), so the eight Reshape/Transpose
nodes per layer go: on a decode step, where each node costs more in dispatch than in arithmetic,
that is a measurable share of the step. The cache (past/present) keeps its 4-D layout.

Preconditions: run after fuse-rotary and fuse-attention, with shapes refreshed (head counts and
head size must be static).
"""

from __future__ import annotations

import onnx

from llmc.passes.base import RewritePass
from llmc.passes.graph import Graph, Rewrite, attr

_HEADS_TO_FRONT = [0, 2, 1, 3]


class Attention3dLayout(RewritePass):
    name = "attention-3d-layout"
    anchors = ("Attention",)
    target = "ONNX Attention-23 / RotaryEmbedding-23 on 3-D [batch, seq, heads·dim] inputs"

    def rewrite(self, graph: Graph, attention: onnx.NodeProto) -> Rewrite | None:
        if graph.rank(attention.input[0]) != 4:
            return None  # already 3-D
        removed, added, flat = [attention], [], []
        heads = []
        for name in attention.input[:3]:
            found = _flat_source(graph, name, removed, added)
            if found is None:
                return None
            flat.append(found[0])
            heads.append(found[1])
        if heads[1] != heads[2]:
            return None
        transpose = graph.only_consumer(attention.output[0])
        reshape = transpose and graph.only_consumer(transpose.output[0])
        if (transpose is None or transpose.op_type != "Transpose" or reshape is None
                or reshape.op_type != "Reshape" or list(attr(transpose, "perm", [])) != _HEADS_TO_FRONT
                or graph.rank(reshape.output[0]) != 3):
            return None
        removed += [transpose, reshape]
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
        fused = graph.node("Attention", flat + list(attention.input[3:]),
                           [reshape.output[0], *attention.output[1:]],
                           q_num_heads=heads[0], kv_num_heads=heads[1], **attributes)
        return Rewrite(removed, added + [fused])


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
