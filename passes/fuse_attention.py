"""Attention canonicalization: the decomposed attention subgraph → one ONNX `Attention` (opset 23).

Matches, anchored on Softmax over the last axis::

    scores = MatMul(Q, Kᵀ)          Kᵀ = Transpose(repeat(K), perm=[0, 1, 3, 2]), or SDPA's
                                      Reshape(Transpose(Reshape(repeat(K)), perm=[0, 2, 1]))
    scores = scores · scale | scores / scale | MatMul(Q · a, Kᵀ · b)   (scalar constants)
    scores = Where(cond, scores, very_negative) | scores + mask         (optional)
    probs  = Softmax(scores), then any same-type Casts and SDPA's Where(IsNaN(p), 0, p)
    out    = MatMul(probs, repeat(V))

where K and V are ``Concat(past, new, axis=2)`` with the past a graph input (the cache), and
`repeat` is the grouped-query expansion ``Reshape(Expand(Unsqueeze(x, 2)))`` or absent. The result
is ``Attention(Q, K_new, V_new, mask, past_key, past_value)`` producing the present tensors under
their original names, with grouped-query attention left to the op. A boolean ``Where`` mask
becomes an additive float mask with the same very negative value, and a −inf additive mask gets
a finite twin, so fully padded rows stay finite (NaN there would poison later layers).

Target: ONNX Attention-23 for every backend — onnxruntime runs it on CPU (the fastest form
measured, see DESIGN.md) and it is the standard op TensorRT's ONNX parser maps to its own
attention layer. The model's default opset is raised to 23 when a match happens.

Preconditions: run after constant folding (scale, perm, axes and the mask fill value must be
constants) and with shape information refreshed (Q and K must be known 4-D).
"""

from __future__ import annotations

import numpy as np
import onnx

from llmc.passes.base import RewritePass
from llmc.passes.graph import Graph, Rewrite, attr

# A Where fill value at or below this acts as "masked out" after softmax.
_MASKED = -1e4


class FuseAttention(RewritePass):
    name = "fuse-attention"
    anchors = ("Softmax",)
    opset = 23
    target = "ONNX Attention-23 (onnxruntime CPU kernel; TensorRT parser)"

    def rewrite(self, graph: Graph, softmax: onnx.NodeProto) -> Rewrite | None:
        if not _is_last_axis(graph, softmax, softmax.input[0]):
            return None
        matched = [softmax]
        probs = _skip_probability_noops(graph, softmax.output[0], matched)
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
        query, key_t = qk.input
        if scale is None:
            # SDPA exports scale both sides by √scale: MatMul(q · a, kᵀ · b).
            query, a = _strip_scale(graph, query, matched)
            key_t, b = _strip_scale(graph, key_t, matched)
            scale = (a or 1.0) * (b or 1.0)
        key = _untransposed(graph, key_t, matched)
        if key is None:
            return None
        key = _strip_repeat(graph, key, matched)
        value = _strip_repeat(graph, pv.input[1], matched)
        if graph.rank(query) != 4 or graph.rank(key) != 4 or graph.rank(value) != 4:
            return None

        key_new, past_key, present_key = _split_cache(graph, key, matched)
        value_new, past_value, present_value = _split_cache(graph, value, matched)
        if (past_key is None) != (past_value is None):
            return None

        inputs = [query, key_new, value_new, mask or ""]
        outputs = [pv.output[0]]
        if past_key is not None:
            inputs += [past_key, past_value]
            outputs += [present_key, present_value]
        attention = graph.node("Attention", inputs, outputs, scale=float(scale))
        return Rewrite(matched, mask_nodes + [attention], mask_initializers)


def _skip_probability_noops(graph: Graph, probs: str, matched: list) -> str:
    """Step over what leaves softmax's output unchanged: same-type Casts (Hugging Face's
    softmax(dtype=float32).to(dtype)) and SDPA's Where(IsNaN(p), 0, p)."""
    while True:
        users = graph.consumers.get(probs, [])
        if len(users) == 1 and users[0].op_type == "Cast" and _same_float_cast(graph, users[0]):
            matched.append(users[0])
            probs = users[0].output[0]
            continue
        isnan = next((u for u in users if u.op_type == "IsNaN"), None)
        where = next((u for u in users if u.op_type == "Where"), None)
        if (len(users) == 2 and isnan and where and list(where.input) ==
                [isnan.output[0], where.input[1], probs] and graph.scalar(where.input[1]) == 0.0
                and graph.only_consumer(isnan.output[0]) is where):
            matched.extend([isnan, where])
            probs = where.output[0]
            continue
        return probs


def _untransposed(graph: Graph, key_t: str, matched: list) -> str | None:
    """K from Kᵀ: Transpose(K, perm=[0, 1, 3, 2]), or the dynamo SDPA spelling
    Reshape(Transpose(Reshape(K, [-1, T, d]), perm=[0, 2, 1]), [B, H, d, T])."""
    transpose = graph.producer_of(key_t, "Transpose")
    if transpose is not None and list(attr(transpose, "perm", [])) == [0, 1, 3, 2]:
        matched.append(transpose)
        return transpose.input[0]
    outer = graph.producer_of(key_t, "Reshape")
    transpose = outer and graph.producer_of(outer.input[0], "Transpose")
    inner = transpose and graph.producer_of(transpose.input[0], "Reshape")
    if inner is None or list(attr(transpose, "perm", [])) != [0, 2, 1]:
        return None
    key = inner.input[0]
    key_shape, flat_shape, out_shape = graph.shape(key), graph.shape(inner.output[0]), graph.shape(key_t)
    if key_shape is None or flat_shape is None or out_shape is None:
        return None
    head_dim = key_shape[-1]
    if (len(key_shape), len(flat_shape), len(out_shape)) != (4, 3, 4) or not isinstance(head_dim, int) \
            or flat_shape[-1] != head_dim or out_shape[2] != head_dim:
        return None
    matched.extend([outer, transpose, inner])
    return key


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
        return (scores, *_finite_mask(graph, mask))
    return name, [], [], None


def _finite_mask(graph: Graph, mask: str):
    """(new nodes, new initializers, mask): a Where(cond, 0, -inf) mask gets a finite twin, so a
    fully masked row gives a uniform softmax instead of NaN (which would spread to later layers)."""
    where = graph.producer_of(mask, "Where")
    fill = where and graph.scalar(where.input[2])
    if fill is None or fill != -np.inf or graph.scalar(where.input[1]) != 0.0:
        return [], [], mask
    dtype = onnx.helper.tensor_dtype_to_np_dtype(graph.elem_type(mask) or onnx.TensorProto.FLOAT)
    zero = graph.initializer("attn_mask_zero", np.zeros((), dtype))
    lowest = graph.initializer("attn_mask_fill", np.array(np.finfo(dtype).min, dtype))
    finite = graph.node("Where", [where.input[0], zero.name, lowest.name])
    return [finite], [zero, lowest], finite.output[0]


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

