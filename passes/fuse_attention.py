"""Attention canonicalization: the decomposed attention subgraph → one ONNX `Attention` (opset 23).

Matches, anchored on Softmax over the last axis::

    scores = MatMul(Q, Transpose(repeat(K), perm=[0, 1, 3, 2]))
    scores = scores · scale | scores / scale                      (optional, scalar constant)
    scores = Where(cond, scores, very_negative) | scores + mask   (optional)
    out    = MatMul(Cast?(Softmax(scores)), repeat(V))

where K and V are ``Concat(past, new, axis=2)`` with the past a graph input (the cache), and
`repeat` is the grouped-query expansion ``Reshape(Expand(Unsqueeze(x, 2)))`` or absent. The result
is ``Attention(Q, K_new, V_new, mask, past_key, past_value)`` producing the present tensors under
their original names, with grouped-query attention left to the op. A boolean ``Where`` mask
becomes an additive float mask with the same very negative value, so fully padded rows stay
finite (a boolean mask would give NaN there and poison later layers).

Target: ONNX Attention-23 for every backend — onnxruntime runs it on CPU (the fastest form
measured, see DESIGN.md) and it is the standard op TensorRT's ONNX parser maps to its own
attention layer. The model's default opset is raised to 23 when a match happens.

Preconditions: run after constant folding (scale, perm, axes and the mask fill value must be
constants) and with shape information refreshed (Q and K must be known 4-D).
"""

from __future__ import annotations

import numpy as np
import onnx

from llmc.passes.base import PassResult, RewritePass
from llmc.passes.graph import Graph, Rewrite, attr

# A Where fill value at or below this acts as "masked out" after softmax.
_MASKED = -1e4


class FuseAttention(RewritePass):
    name = "fuse-attention"
    anchors = ("Softmax",)
    opset = 23

    def run(self, model: onnx.ModelProto) -> PassResult:
        result = super().run(model)
        if result.matches:
            result.notes.append("target: ONNX Attention-23 (onnxruntime CPU kernel; TensorRT parser)")
        return result

    def rewrite(self, graph: Graph, softmax: onnx.NodeProto) -> Rewrite | None:
        if not _is_last_axis(graph, softmax, softmax.input[0]):
            return None
        matched = [softmax]
        probs = softmax.output[0]
        # Same-type Casts (softmax(..., dtype=float32).to(dtype) in Hugging Face models) are no-ops.
        while (cast := graph.only_consumer(probs)) is not None and cast.op_type == "Cast" \
                and _same_float_cast(graph, cast):
            matched.append(cast)
            probs = cast.output[0]
        pv = graph.only_consumer(probs)
        if pv is None or pv.op_type != "MatMul" or pv.input[0] != probs:
            return None
        matched.append(pv)

        scores, mask_nodes, mask_initializers, mask = _strip_mask(graph, softmax.input[0], matched)
        if scores is None:
            return None
        scores, scale = _strip_scale(graph, scores, matched)
        qk = graph.producer_of(scores, "MatMul")
        if qk is None:
            return None
        matched.append(qk)
        query = qk.input[0]
        transpose = graph.producer_of(qk.input[1], "Transpose")
        if transpose is None or list(attr(transpose, "perm", [])) != [0, 1, 3, 2]:
            return None
        matched.append(transpose)
        key = _strip_repeat(graph, transpose.input[0], matched)
        value = _strip_repeat(graph, pv.input[1], matched)
        if graph.rank(query) != 4 or graph.rank(key) != 4 or graph.rank(value) != 4:
            return None

        key_new, past_key, present_key = _split_cache(graph, key, matched)
        value_new, past_value, present_value = _split_cache(graph, value, matched)
        if (past_key is None) != (past_value is None):
            return None
        if scale is None:
            scale = 1.0

        inputs = [query, key_new, value_new, mask or ""]
        outputs = [pv.output[0]]
        if past_key is not None:
            inputs += [past_key, past_value]
            outputs += [present_key, present_value]
        attention = graph.node("Attention", inputs, outputs, scale=float(scale))
        return Rewrite(matched, mask_nodes + [attention], mask_initializers)


def _strip_mask(graph: Graph, name: str, matched: list):
    """Peel an additive or Where mask off the softmax input.

    Returns (scores, new nodes, new initializers, additive mask or None); scores is None when the
    input looks masked but not in a form that can be converted.
    """
    where = graph.producer_of(name, "Where")
    if where is not None:
        fill = graph.scalar(where.input[2])
        if fill is None or fill > _MASKED:
            return None, [], [], None
        matched.append(where)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(graph.elem_type(where.input[2]) or onnx.TensorProto.FLOAT)
        zero = graph.initializer("attn_mask_zero", np.zeros((), dtype))
        filler = graph.initializer("attn_mask_fill", np.full((), fill, dtype))
        additive = graph.node("Where", [where.input[0], zero.name, filler.name])
        return where.input[1], [additive], [zero, filler], additive.output[0]
    add = graph.producer_of(name, "Add")
    if add is not None:
        scores, mask = add.input
        if graph.producer_of(scores, "Mul", "Div", "MatMul") is None:
            scores, mask = mask, scores
        if graph.producer_of(scores, "Mul", "Div", "MatMul") is None or graph.rank(mask) not in (2, 3, 4):
            return None, [], [], None
        matched.append(add)
        return scores, [], [], mask
    return name, [], [], None


def _strip_scale(graph: Graph, name: str, matched: list) -> tuple[str, float | None]:
    node = graph.producer_of(name, "Mul", "Div")
    if node is None:
        return name, None
    for data, const in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
        value = graph.scalar(const)
        if value is None or (node.op_type == "Div" and const != node.input[1]) or value == 0:
            continue
        matched.append(node)
        return data, value if node.op_type == "Mul" else 1.0 / value
    return name, None


def _strip_repeat(graph: Graph, name: str, matched: list) -> str:
    """Undo the grouped-query expansion Reshape(Expand(Unsqueeze(x, axes=[2])))."""
    reshape = graph.producer_of(name, "Reshape")
    expand = reshape and graph.producer_of(reshape.input[0], "Expand")
    unsqueeze = expand and graph.producer_of(expand.input[0], "Unsqueeze")
    if unsqueeze is None:
        return name
    axes = graph.constant(unsqueeze.input[1]) if len(unsqueeze.input) > 1 else attr(unsqueeze, "axes", None)
    if axes is None or list(np.ravel(axes)) != [2]:
        return name
    matched.extend([reshape, expand, unsqueeze])
    return unsqueeze.input[0]


def _split_cache(graph: Graph, name: str, matched: list) -> tuple[str, str | None, str | None]:
    """(new tokens, past, present) for a cache Concat(past, new, axis=2); else (name, None, None)."""
    concat = graph.producer_of(name, "Concat")
    if concat is None or len(concat.input) != 2 or attr(concat, "axis", None) not in (2, -2):
        return name, None, None
    past, new = concat.input
    if past not in graph.inputs:
        return name, None, None
    matched.append(concat)
    return new, past, name


def _is_last_axis(graph: Graph, node: onnx.NodeProto, value: str) -> bool:
    axis = attr(node, "axis", -1)
    return axis == -1 or axis == (graph.rank(value) or 0) - 1


def _same_float_cast(graph: Graph, cast: onnx.NodeProto) -> bool:
    return graph.elem_type(cast.input[0]) == attr(cast, "to", None)

