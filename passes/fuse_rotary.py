"""Rotary embedding (rotate-half form) → one ONNX `RotaryEmbedding` (opset 23).

Matches, anchored on the final Add::

    out = x · cos + Concat(−Slice(x, h:), Slice(x, :h), axis=−1) · sin        (h = head_dim / 2)

with x the 4-D [batch, heads, seq, head_dim] query or key, and cos/sin of shape
[batch, 1, seq, head_dim] that provably repeat their first half in their second — which is
what lets the op take the half-width tables. Proven when the table is either computed as
``elementwise(Concat(f, f, axis=−1))`` (Cos/Sin/Cast/scalar Mul after the position·inv_freq
product, as llmc's and Hugging Face's rotary modules compute it) or gathered (Gather or GatherND) from a
constant cache whose halves are equal. The op gets ``Slice(table, :h)`` as its 3-D cos/sin cache
[batch, seq, h], so no position_ids input is needed.

Target: ONNX RotaryEmbedding-23 (onnxruntime CPU kernel; TensorRT's parser maps it to its
RoPE layer). The default opset is raised to 23 when a match happens. Run after constant
folding (slice bounds must be constants) with shapes refreshed; run eliminate-common-
subexpressions afterwards to share the per-layer table slices.
"""

from __future__ import annotations

import numpy as np
import onnx

from llmc.passes.base import RewritePass
from llmc.passes.graph import Graph, Rewrite, attr

_HALF_PRESERVING = ("Cos", "Sin", "Cast", "Identity")


class FuseRotary(RewritePass):
    name = "fuse-rotary"
    anchors = ("Add",)
    opset = 23
    target = "ONNX RotaryEmbedding-23, rotate-half, 3-D cos/sin cache"

    def rewrite(self, graph: Graph, add: onnx.NodeProto) -> Rewrite | None:
        for cos_mul_name, sin_mul_name in (add.input, add.input[::-1]):
            cos_mul = graph.producer_of(cos_mul_name, "Mul")
            sin_mul = graph.producer_of(sin_mul_name, "Mul")
            if cos_mul is None or sin_mul is None:
                continue
            match = _match(graph, cos_mul, sin_mul)
            if match is not None:
                x, cos, sin, rotate_nodes = match
                head_dim = graph.shape(x)[3]
                new_nodes, initializers, caches = [], [], []
                for table in (cos, sin):
                    half = _half_table(graph, table, head_dim // 2, x)
                    if half is None:
                        return None
                    new_nodes += half[0]
                    initializers += half[1]
                    caches.append(half[2])
                rope = graph.node("RotaryEmbedding", [x, *caches], [add.output[0]])
                return Rewrite([add, cos_mul, sin_mul, *rotate_nodes], new_nodes + [rope], initializers)
        return None


def _match(graph: Graph, cos_mul: onnx.NodeProto, sin_mul: onnx.NodeProto):
    """(x, cos table, sin table, rotate-half nodes) if the two Muls form rotary; else None."""
    for rotated, sin in (sin_mul.input, sin_mul.input[::-1]):
        concat = graph.producer_of(rotated, "Concat")
        if concat is None or len(concat.input) != 2 or attr(concat, "axis") not in (-1, 3):
            continue
        neg = graph.producer_of(concat.input[0], "Neg")
        second = neg and graph.producer_of(neg.input[0], "Slice")
        first = graph.producer_of(concat.input[1], "Slice")
        if second is None or first is None or second.input[0] != first.input[0]:
            continue
        x = first.input[0]
        shape = graph.shape(x)
        if shape is None or len(shape) != 4 or not isinstance(shape[3], int) or shape[3] % 2:
            return None
        half = shape[3] // 2
        if not (_is_slice(graph, first, 0, half) and _is_slice(graph, second, half, None, shape[3])):
            return None
        if x not in cos_mul.input:
            return None
        cos = cos_mul.input[1] if cos_mul.input[0] == x else cos_mul.input[0]
        return x, cos, sin, [concat, neg, second, first]
    return None


def _half_table(graph: Graph, table: str, half: int, x: str):
    """Nodes computing the [batch, seq, half] cache from a [batch, 1, seq, 2·half] table.

    A table whose batch is not known to be x's (one computed for batch 1 and broadcast, as
    Optimum's Gemma exports do) is expanded to x's batch: the op takes no broadcast.
    """
    unsqueeze = graph.producer_of(table, "Unsqueeze")
    if unsqueeze is None:
        return None
    axes = graph.constant(unsqueeze.input[1]) if len(unsqueeze.input) > 1 else attr(unsqueeze, "axes")
    if axes is None or list(np.ravel(axes)) != [1]:
        return None
    full = unsqueeze.input[0]
    if graph.rank(full) != 3 or not _halves_equal(graph, full, half):
        return None
    starts = graph.initializer("rope_start", np.array([0], np.int64))
    ends = graph.initializer("rope_end", np.array([half], np.int64))
    axes_init = graph.initializer("rope_axis", np.array([-1], np.int64))
    node = graph.node("Slice", [full, starts.name, ends.name, axes_init.name])
    nodes, initializers = [node], [starts, ends, axes_init]
    table_batch, x_batch = (graph.shape(full) or [None])[0], (graph.shape(x) or [None])[0]
    if table_batch != x_batch or table_batch in (None, "?"):
        batch = graph.node("Shape", [x], start=0, end=1)
        ones = graph.initializer("rope_ones", np.array([1, 1], np.int64))
        target = graph.node("Concat", [batch.output[0], ones.name], axis=0)
        expand = graph.node("Expand", [node.output[0], target.output[0]])
        nodes += [batch, target, expand]
        initializers.append(ones)
    return nodes, initializers, nodes[-1].output[0]


def _halves_equal(graph: Graph, name: str, half: int) -> bool:
    """Whether the last axis of `name` provably repeats its first half."""
    while True:
        node = graph.producer.get(name)
        if node is None:
            return False
        if node.op_type in _HALF_PRESERVING:
            name = node.input[0]
        elif node.op_type in ("Mul", "Div") and graph.scalar(node.input[1]) is not None:
            name = node.input[0]
        elif node.op_type == "Mul" and graph.scalar(node.input[0]) is not None:
            name = node.input[1]
        elif node.op_type == "Concat":
            return (len(node.input) == 2 and node.input[0] == node.input[1]
                    and attr(node, "axis") in (-1, (graph.rank(name) or 0) - 1))
        elif node.op_type in ("Gather", "GatherND"):
            # Gathering rows (Gather on axis 0, or GatherND with one index per row, as the
            # dynamo exporter writes cache[position_ids]) leaves the last axis as it was.
            cache = graph.constant(node.input[0])
            index_shape = graph.shape(node.input[1]) or []
            rows = (attr(node, "axis", 0) == 0 if node.op_type == "Gather"
                    else attr(node, "batch_dims", 0) == 0 and index_shape[-1:] == [1])
            return (cache is not None and rows and cache.ndim >= 2 and cache.shape[-1] == 2 * half
                    and np.array_equal(cache[..., :half], cache[..., half:]))
        else:
            return False


def _is_slice(graph: Graph, node: onnx.NodeProto, start: int, end: int | None, dim: int = 0) -> bool:
    """Whether `node` slices [start:end] (end None = to the end) along the last axis, step 1."""
    values = [graph.constant(name) if name else None for name in list(node.input[1:]) + [""] * 4][:4]
    starts, ends, axes, steps = values
    if starts is None or ends is None or axes is None:
        return False
    if starts.size != 1 or list(np.ravel(axes)) not in ([-1], [3]):
        return False
    if steps is not None and list(np.ravel(steps)) != [1]:
        return False
    actual_end = int(np.ravel(ends)[0])
    end_ok = actual_end >= dim if end is None else actual_end == end
    return int(np.ravel(starts)[0]) == start and end_ok

