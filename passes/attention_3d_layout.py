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
unless its readers were a Transpose + Reshape to match. Every Attention whose head counts and
head size are known leaves this pass 3-D, which the paged lowering needs.

The 4-D values that go may also be read by Shape nodes: fuse-rotary expands a cos/sin table to
Shape(x)[0] of the rotary input, fuse-attention computes the mask's key length from Shape(new K).
Such a Shape is computed from the 3-D tensor instead (its dims rearranged, heads and head size
constant), so the split layout can still go.

Preconditions: run after fuse-rotary and fuse-attention, with shapes refreshed (head size must be
static; the query head count comes from the shapes, else from `num_heads`, else from the
``llmc.num_heads`` metadata).
"""

from __future__ import annotations

import numpy as np
import onnx

from llmc.passes.base import RewritePass
from llmc.passes.graph import Graph, Rewrite, attr

_HEADS_TO_FRONT = [0, 2, 1, 3]


class Attention3dLayout(RewritePass):
    name = "attention-3d-layout"
    anchors = ("Attention",)
    target = "ONNX Attention-23 / RotaryEmbedding-23 on 3-D [batch, seq, heads·dim] inputs"

    def __init__(self, num_heads: int | None = None):
        """Args:
            num_heads: the model's query heads, for a query whose shape does not give them
                (None: the ``llmc.num_heads`` metadata).
        """
        self.num_heads = num_heads

    def rewrite(self, graph: Graph, attention: onnx.NodeProto) -> Rewrite | None:
        if graph.rank(attention.input[0]) != 4:
            return None  # already 3-D
        removed, added, initializers, flat = [attention], [], [], []
        heads = []
        for position, name in enumerate(attention.input[:3]):
            found = _flat_source(graph, attention, name, removed, added, initializers)
            if found is None:
                heads_here = _head_count(graph, attention, position, self.num_heads)
                found = _flattened(graph, name, heads_here, added, initializers)
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


def _head_count(graph: Graph, attention: onnx.NodeProto, position: int, num_heads: int | None) -> int | None:
    """Heads of the 4-D Attention input at `position` (0: Q, 1: K, 2: V): its static dim 1, else
    the cache's (K and V), else `num_heads` or the model's ``llmc.num_heads`` metadata (Q)."""
    shape = graph.shape(attention.input[position])
    if shape is not None and len(shape) == 4 and isinstance(shape[1], int):
        return shape[1]
    if position > 0 and len(attention.input) > 3 + position:
        cache = graph.shape(attention.input[3 + position])  # past_key / past_value
        if cache is not None and len(cache) == 4 and isinstance(cache[1], int):
            return cache[1]
    if position == 0 and num_heads is not None:
        return num_heads
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


def _flat_source(graph: Graph, attention: onnx.NodeProto, name: str, removed: list, added: list,
                 initializers: list):
    """(3-D tensor, heads) behind a 4-D Attention input, re-emitting a rotary on it if present."""
    rotary = graph.producer_of(name, "RotaryEmbedding")
    split = _split_heads(graph, rotary.input[0] if rotary is not None else name)
    if split is None:
        return None
    flat, heads, nodes = split
    head_dim = graph.shape(nodes[1].output[0])[3]  # static: _split_heads checked it
    if rotary is None:
        shapes = _shape_readers(graph, name, attention)
        if shapes is None:
            return None
        removed.extend(nodes)
        _reshape_readers(graph, shapes, flat, heads, head_dim, removed, added, initializers)
        return flat, heads
    outer, inner = _shape_readers(graph, name, attention), _shape_readers(graph, rotary.input[0], rotary)
    if outer is None or inner is None:
        return None
    new_rotary = graph.node("RotaryEmbedding", [flat, *rotary.input[1:]], 1, num_heads=heads,
                            **{a.name: onnx.helper.get_attribute_value(a) for a in rotary.attribute})
    removed.extend([rotary, *nodes])
    added.append(new_rotary)
    _reshape_readers(graph, outer, new_rotary.output[0], heads, head_dim, removed, added, initializers)
    _reshape_readers(graph, inner, flat, heads, head_dim, removed, added, initializers)
    return new_rotary.output[0], heads


def _shape_readers(graph: Graph, name: str, reader: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """The Shape nodes reading `name` besides `reader`, or None when anything else reads it."""
    users = graph.consumers.get(name, [])
    others = [n for n in users if n is not reader]
    if name in graph.outputs or len(others) != len(users) - 1 or any(n.op_type != "Shape" for n in others):
        return None
    return others


def _reshape_readers(graph: Graph, shapes: list[onnx.NodeProto], flat: str, heads: int, head_dim: int,
                     removed: list, added: list, initializers: list) -> None:
    """Compute each Shape(x) of a 4-D x = [B, heads, S, head_dim] from its 3-D form `flat`
    = [B, S, heads·head_dim]: Concat(Shape(flat), [heads, head_dim]) = [B, S, ·, heads, head_dim],
    its dims picked back into x's order (and the Shape's start/end)."""
    for shape in shapes:
        picks = [0, 3, 1, 4][attr(shape, "start", 0):attr(shape, "end", 4)]
        constant = graph.initializer("heads_and_dim", np.array([heads, head_dim], np.int64))
        order = graph.initializer("dims_4d", np.array(picks, np.int64))
        flat_shape = graph.node("Shape", [flat])
        dims = graph.node("Concat", [flat_shape.output[0], constant.name], axis=0)
        added += [flat_shape, dims, graph.node("Gather", [dims.output[0], order.name], list(shape.output), axis=0)]
        initializers += [constant, order]
        removed.append(shape)


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
