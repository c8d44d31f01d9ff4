"""Attention canonicalization: the decomposed attention subgraph → one ONNX `Attention` (opset 23).

Matches, anchored on Softmax over the last axis::

    scores = MatMul(Q, Kᵀ)          Kᵀ = Transpose(repeat(K), perm=[0, 1, 3, 2]), or SDPA's
                                      Reshape(Transpose(Reshape(repeat(K)), perm=[0, 2, 1]))
    scores = scores · scale | scores / scale | MatMul(Q · a, Kᵀ · b)   (scalar constants)
    scores = Tanh(scores / c) · c                                       (optional: Gemma-2's
                                                                          soft-capping → softcap)
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
        scores, softcap = _strip_softcap(graph, scores, matched)
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
        key_rep, value_rep = key, pv.input[1]
        key = _strip_repeat(graph, key_rep, matched)
        value = _strip_repeat(graph, value_rep, matched)
        if graph.rank(query) != 4 or graph.rank(key) != 4 or graph.rank(value) != 4:
            return None

        key_new, past_key, present_key = _split_cache(graph, key, matched)
        value_new, past_value, present_value = _split_cache(graph, value, matched)
        if (past_key is None) != (past_value is None):
            return None
        # sdpa exports slice the mask to Shape(repeated K)[-2]; that Shape dies with the match,
        # so its readers get the same dims computed from the cache's parts instead.
        shape_nodes, shape_constants = [], []
        if past_key is not None:
            for repeated, past, new in ((key_rep, past_key, key_new), (value_rep, past_value, value_new)):
                nodes, constants = _reroute_shapes(graph, repeated, past, new, matched)
                shape_nodes += nodes
                shape_constants += constants

        inputs = [query, key_new, value_new, mask or ""]
        outputs = [pv.output[0]]
        if past_key is not None:
            inputs += [past_key, past_value]
            outputs += [present_key, present_value]
        # Attention-23 applies softcap before the mask, as the decomposed graph does.
        attention = graph.node("Attention", inputs, outputs, scale=float(scale),
                               **({"softcap": softcap} if softcap else {}))
        return Rewrite(matched, shape_nodes + mask_nodes + [attention], shape_constants + mask_initializers)


def _reroute_shapes(graph: Graph, repeated: str, past: str, new: str, matched: list):
    """Nodes computing each Shape(repeated) as Shape(past) · [0, 0, 1, 0] + Shape(new) — the cache
    Concat(past, new)'s shape, which the repeated K/V share but for the head axis — for every
    Shape whose readers take only the other axes; the old Shapes join `matched`. Returns (new
    nodes, new initializers).

    The present tensor itself cannot serve: the fused Attention computes it from the mask.
    """
    nodes, constants = [], []
    for shape in graph.consumers.get(repeated, []):
        if (shape.op_type != "Shape" or shape in matched or shape.attribute or graph.rank(repeated) != 4
                or not _reads_only_dims(graph, shape, {0, 2, 3})):
            continue
        past_shape = graph.node("Shape", [past])
        new_shape = graph.node("Shape", [new])
        length_only = graph.initializer("cache_length_axis", np.array([0, 0, 1, 0], np.int64))
        past_length = graph.node("Mul", [past_shape.output[0], length_only.name])
        nodes += [past_shape, new_shape, past_length,
                  graph.node("Add", [past_length.output[0], new_shape.output[0]], list(shape.output))]
        matched.append(shape)
        constants.append(length_only)
    return nodes, constants


def _reads_only_dims(graph: Graph, shape: onnx.NodeProto, dims: set[int], rank: int = 4) -> bool:
    """Whether every reader of Shape(x) (x of rank `rank`) takes only dims in `dims`, through
    Gather or Slice by constant indices."""
    start, end = attr(shape, "start", 0), attr(shape, "end", rank)
    start, end = start + rank if start < 0 else start, min(end + rank if end < 0 else end, rank)
    offered = list(range(start, end))
    if shape.output[0] in graph.outputs:
        return False
    for reader in graph.consumers.get(shape.output[0], []):
        if reader.op_type == "Gather" and attr(reader, "axis", 0) == 0:
            index = graph.constant(reader.input[1])
            positions = None if index is None else np.ravel(index).tolist()
        elif reader.op_type == "Slice" and reader.input[0] == shape.output[0]:
            bounds = [graph.constant(n) if n else None for n in list(reader.input[1:]) + [""] * 4][:4]
            if bounds[0] is None or bounds[1] is None or (bounds[2] is not None and list(np.ravel(bounds[2])) != [0]):
                return False
            step = 1 if bounds[3] is None else int(np.ravel(bounds[3])[0])
            positions = list(range(len(offered)))[int(np.ravel(bounds[0])[0]):int(np.ravel(bounds[1])[0]):step]
        else:
            return False
        if positions is None or any(not -len(offered) <= i < len(offered) for i in positions):
            return False
        if any(offered[i] not in dims for i in positions):
            return False
    return True


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


def _strip_softcap(graph: Graph, name: str, matched: list) -> tuple[str, float | None]:
    """(x, c) when `name` is Tanh(x / c) · c (or Tanh(x · 1/c) · c) with one constant c > 0."""
    outer = graph.producer_of(name, "Mul")
    if outer is None:
        return name, None
    for capped, const in ((outer.input[0], outer.input[1]), (outer.input[1], outer.input[0])):
        cap, tanh = graph.scalar(const), graph.producer_of(capped, "Tanh")
        if cap is None or cap <= 0 or tanh is None or graph.only_consumer(capped) is not outer:
            continue
        inner = []
        data, inverse = _strip_scale(graph, tanh.input[0], inner)
        if inverse is None or abs(inverse * cap - 1) > 1e-6 or graph.only_consumer(tanh.input[0]) is not tanh:
            continue
        matched += [outer, tanh, *inner]
        return data, float(cap)
    return name, None


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

