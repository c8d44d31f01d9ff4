"""onnxruntime's GroupQueryAttention (com.microsoft) → the canonical ONNX `Attention` (opset 23).

onnxruntime-genai's model builder writes each layer's attention as one contrib node::

    GroupQueryAttention(qkv | q, [k, v], past_key, past_value, seqlens_k, total_sequence_length,
                        [cos_cache, sin_cache])  → out [B, S, H·d], present_key, present_value

with `seqlens_k` (each row's mask sum minus one) and `total_sequence_length` computed inside the
graph from `attention_mask`, and, with ``do_rotary``, the rotary embedding applied inside the op
at positions it derives from `seqlens_k`: row b's new tokens sit at ``sum(mask_b) − S + s``.
The result here is what fuse-attention and attention-3d-layout produce, which the paged lowering
takes: ``Split`` of a packed QKV, ``RotaryEmbedding`` (opset 23) on the 3-D Q and K at explicit
`position_ids`, and a 3-D ``Attention(q, k, v, mask, past_key, past_value)`` with
``q_num_heads``/``kv_num_heads``, writing the present tensors under their original names. The mask
is the causal one (each query sees keys up to its own slot) and the padding one (keys whose
attention_mask is 0), additive with the dtype's lowest finite value so padded rows stay finite.

Positions are the graph's `position_ids` input when it has one, else computed from
`attention_mask` as GQA derives them into a value named `position_ids`, which the paged lowering
(feeding each packed token's position itself) replaces. The cache inputs/outputs get a static
head size where the file left it symbolic.

A ``local_window_size`` w becomes part of the mask: w slots, the query's own and the w − 1 before
it, as onnxruntime's kernel reads it (and as Hugging Face's sliding window). Left alone: a GQA
whose past/present are not the graph's cache inputs/outputs, with ``smooth_softmax``, or with
any of the optional position_ids / attention_bias / head_sink inputs. ``sliding_window_cache`` (a ring-buffer cache of `window`
slots, Gemma-2 from genai) is another interface altogether: an error naming the node.

Preconditions: none on other passes; run before fuse-attention. `register()` adds schemas for
GroupQueryAttention and onnxruntime's SimplifiedLayerNormalization (default domain) so that
onnx.checker and shape inference accept the builder's graphs; it runs at import.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, defs, helper
from onnx.defs import OpSchema

from llmc.errors import LlmcError
from llmc.passes.base import RewritePass
from llmc.passes.graph import Graph, Rewrite, attr

_CONTRIB = "com.microsoft"
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
# GQA inputs after total_sequence_length and the caches, which this rewrite does not model.
_UNMODELLED_INPUTS = {9: "position_ids", 10: "attention_bias", 11: "head_sink"}


class CanonicalizeGroupQueryAttention(RewritePass):
    name = "canonicalize-gqa"
    anchors = ("GroupQueryAttention",)
    anchor_domain = _CONTRIB
    opset = 23
    target = "ONNX Attention-23 + RotaryEmbedding-23 (what the paged lowering takes)"

    def run(self, model: onnx.ModelProto):
        self._head_sizes: dict[str, int] = {}
        result = super().run(model)
        if result.matches:
            _pin_head_size(result.model, self._head_sizes)
        return result

    def _match(self, graph: Graph) -> list[Rewrite]:
        self._positions_made = False  # the first match computes position_ids for all (per attempt)
        return super()._match(graph)

    def rewrite(self, graph: Graph, gqa: onnx.NodeProto) -> Rewrite | None:
        inputs = list(gqa.input) + [""] * (12 - len(gqa.input))
        query, key, value, past_key, past_value = inputs[:5]
        if "attention_mask" not in graph.inputs or "position_ids" in graph.producer:
            return None
        if any(inputs[i] for i in _UNMODELLED_INPUTS) or attr(gqa, "smooth_softmax", 0):
            return None
        window = attr(gqa, "local_window_size", -1)
        if attr(gqa, "sliding_window_cache", 0):
            # The cache is then a ring of `window` slots, not the whole past: another interface.
            raise LlmcError(f"node '{gqa.name}': GroupQueryAttention with sliding_window_cache=1 keeps a "
                            "ring-buffer KV cache, which llmc cannot drive; export the model with `llmc export`")
        outputs = list(gqa.output) + [""] * (3 - len(gqa.output))
        if not (past_key in graph.inputs and past_value in graph.inputs
                and outputs[1] in graph.outputs and outputs[2] in graph.outputs):
            return None
        heads, kv_heads = attr(gqa, "num_heads"), attr(gqa, "kv_num_heads")
        dtype = graph.elem_type(past_key)
        # genai leaves the cache's head size symbolic: read it off the projection's width.
        width = (graph.shape(key or query) or [None])[-1]
        if heads is None or kv_heads is None or dtype is None or not isinstance(width, int):
            return None
        head_dim, rest = divmod(width, kv_heads if key else heads + 2 * kv_heads)
        if rest:
            return None
        np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
        nodes, constants = [], []

        if not key:  # packed QKV along the last axis
            if value:
                return None
            sizes = graph.initializer("gqa_split", np.array([heads, kv_heads, kv_heads], np.int64) * head_dim)
            split = graph.node("Split", [query, sizes.name], 3, axis=-1)
            nodes.append(split)
            constants.append(sizes)
            query, key, value = split.output
        elif not value:
            return None

        if attr(gqa, "do_rotary", 0):
            cos, sin = inputs[7], inputs[8]
            cos_shape = graph.shape(cos)
            if not cos or not sin or cos_shape is None or len(cos_shape) != 2 or not isinstance(cos_shape[1], int):
                return None
            rotary = {"interleaved": attr(gqa, "rotary_interleaved", 0)}
            if 2 * cos_shape[1] != head_dim:
                rotary["rotary_embedding_dim"] = 2 * cos_shape[1]
            if not self._positions_made and "position_ids" not in graph.inputs:
                nodes += _positions(graph, query, constants)
                self._positions_made = True
            q_rot = graph.node("RotaryEmbedding", [query, cos, sin, "position_ids"], num_heads=heads, **rotary)
            k_rot = graph.node("RotaryEmbedding", [key, cos, sin, "position_ids"], num_heads=kv_heads, **rotary)
            nodes += [q_rot, k_rot]
            query, key = q_rot.output[0], k_rot.output[0]

        mask_nodes, mask_constants, mask = _causal_padding_mask(graph, query, past_key, np_dtype, window)
        nodes += mask_nodes
        constants += mask_constants
        scale = attr(gqa, "scale", 0.0) or head_dim ** -0.5
        softcap = attr(gqa, "softcap", 0.0)
        nodes.append(graph.node("Attention", [query, key, value, mask, past_key, past_value], outputs,
                                q_num_heads=heads, kv_num_heads=kv_heads, scale=float(scale),
                                **({"softcap": float(softcap)} if softcap else {})))
        self._head_sizes.update({name: head_dim for name in (past_key, past_value, *outputs[1:3])})
        return Rewrite([gqa], nodes, constants)


def _positions(graph: Graph, query: str, constants: list) -> list[onnx.NodeProto]:
    """Nodes computing `position_ids` [B, S] as GQA does: max(sum(mask_b) − S + s, 0) (equal to
    Hugging Face's cumsum(mask) − 1 for the real tokens of unpadded and left-padded rows).

    Named `position_ids` so that the paged lowering, which feeds positions itself, replaces them."""
    def const(prefix, value):
        tensor = graph.initializer(prefix, np.array(value))
        constants.append(tensor)
        return tensor.name

    lengths = graph.node("ReduceSum", ["attention_mask", const("gqa_axis_seq", np.array([1], np.int64))], keepdims=1)
    new_shape = graph.node("Shape", [query], start=1, end=2)
    new = graph.node("Squeeze", [new_shape.output[0]])
    steps = graph.node("Range", [const("gqa_zero", np.int64(0)), new.output[0], const("gqa_one", np.int64(1))])
    first = graph.node("Sub", [lengths.output[0], new_shape.output[0]])  # [B, 1]
    slots = graph.node("Add", [first.output[0], steps.output[0]])
    positions = graph.node("Max", [slots.output[0], const("gqa_zero", np.array([0], np.int64))], ["position_ids"])
    return [lengths, new_shape, new, steps, first, slots, positions]


def _causal_padding_mask(graph: Graph, query: str, past_key: str, np_dtype, window: int):
    """An additive mask [B, 1, S, P + S]: 0 where query s (at slot P + s) may see key t (t ≤ P + s
    and attention_mask[b, t] = 1), the dtype's lowest finite value elsewhere."""
    def const(prefix, value):
        tensor = graph.initializer(prefix, np.array(value))
        constants.append(tensor)
        return tensor.name

    nodes, constants = [], []
    zero, one = const("gqa_zero", np.int64(0)), const("gqa_one", np.int64(1))
    query_shape = graph.node("Shape", [query], start=1, end=2)
    past_shape = graph.node("Shape", [past_key], start=2, end=3)
    new = graph.node("Squeeze", [query_shape.output[0]])
    past = graph.node("Squeeze", [past_shape.output[0]])
    total = graph.node("Add", [past.output[0], new.output[0]])
    keys = graph.node("Range", [zero, total.output[0], one])
    slots = graph.node("Range", [past.output[0], total.output[0], one])
    slot_column = graph.node("Unsqueeze", [slots.output[0], const("gqa_axis_last", np.array([1], np.int64))])
    causal = graph.node("LessOrEqual", [keys.output[0], slot_column.output[0]])  # [S, T]
    nodes += [query_shape, past_shape, new, past, total, keys, slots, slot_column, causal]
    if window > 0:  # GQA's local window: `window` slots, the query's own and those before it
        first = graph.node("Sub", [slot_column.output[0], const("gqa_window", np.int64(window - 1))])
        recent = graph.node("GreaterOrEqual", [keys.output[0], first.output[0]])
        causal = graph.node("And", [causal.output[0], recent.output[0]])
        nodes += [first, recent, causal]
    kept = graph.node("Cast", ["attention_mask"], to=TensorProto.BOOL)
    kept_rows = graph.node("Unsqueeze", [kept.output[0], const("gqa_axes_heads_queries", np.array([1, 2], np.int64))])
    allowed = graph.node("And", [kept_rows.output[0], causal.output[0]])  # [B, 1, S, T]
    mask = graph.node("Where", [allowed.output[0], const("gqa_open", np_dtype.type(0)),
                                const("gqa_masked", np.finfo(np_dtype).min)])
    nodes += [kept, kept_rows, allowed, mask]
    return nodes, constants, mask.output[0]


def _pin_head_size(model: onnx.ModelProto, sizes: dict[str, int]) -> None:
    """Give the cache inputs/outputs named in `sizes` that static head size where the file left it
    symbolic (genai does): the paged lowering sizes the pool by it, seeded feeds by the graph."""
    for value in (*model.graph.input, *model.graph.output):
        dims = value.type.tensor_type.shape.dim
        if value.name in sizes and len(dims) == 4 and not dims[3].HasField("dim_value"):
            dims[3].dim_value = sizes[value.name]


def register() -> None:
    """Register GroupQueryAttention's and SimplifiedLayerNormalization's schemas (idempotent)."""
    for schema in (_gqa_schema(), _simplified_layer_norm_schema()):
        try:
            defs.get_schema(schema.name, schema.since_version, schema.domain)
        except defs.SchemaError:
            defs.register_schema(schema)


def _gqa_schema() -> OpSchema:
    optional = OpSchema.FormalParameterOption.Optional
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
             "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink"]
    types = {"seqlens_k": "M", "total_sequence_length": "M", "position_ids": "P"}
    inputs = [OpSchema.FormalParameter(n, types.get(n, "T"),
                                       param_option=optional if n not in ("query", "seqlens_k", "total_sequence_length") else
                                       OpSchema.FormalParameterOption.Single) for n in names]
    schema = OpSchema(
        "GroupQueryAttention", _CONTRIB, 1, "onnxruntime's grouped-query attention with a KV cache.",
        inputs=inputs,
        outputs=[OpSchema.FormalParameter(n, "T", param_option=optional if n != "output" else
                                          OpSchema.FormalParameterOption.Single)
                 for n in ("output", "present_key", "present_value", "output_qk")],
        type_constraints=[("T", _FLOATS, ""), ("M", ["tensor(int32)"], ""), ("P", ["tensor(int64)"], "")],
        attributes=[OpSchema.Attribute(n, OpSchema.AttrType.INT, "", required=n in ("num_heads", "kv_num_heads"))
                    for n in ("num_heads", "kv_num_heads", "local_window_size", "do_rotary",
                              "rotary_interleaved", "smooth_softmax", "qk_output", "sliding_window_cache")]
        + [OpSchema.Attribute(n, OpSchema.AttrType.FLOAT, "", required=False) for n in ("scale", "softcap")])
    schema.set_type_and_shape_inference_function(_gqa_outputs)
    return schema


def _gqa_outputs(ctx) -> None:
    query = ctx.get_input_type(0)
    if query is None:  # produced by an op onnx knows no schema for
        return
    out = onnx.TypeProto()
    out.tensor_type.elem_type = query.tensor_type.elem_type
    past = ctx.get_input_type(3) if ctx.get_num_inputs() > 3 and ctx.has_input(3) else None
    heads = ctx.get_attribute("num_heads")
    dims = list(query.tensor_type.shape.dim) if query.tensor_type.HasField("shape") else []
    head_dim = None
    if past is not None and past.tensor_type.HasField("shape") and len(past.tensor_type.shape.dim) == 4:
        last = past.tensor_type.shape.dim[3]
        head_dim = last.dim_value if last.HasField("dim_value") else None
    if len(dims) == 3 and heads is not None and head_dim:
        for dim in dims[:2]:
            out.tensor_type.shape.dim.add().CopyFrom(dim)
        out.tensor_type.shape.dim.add().dim_value = heads.i * head_dim
    ctx.set_output_type(0, out)
    for index in (1, 2):
        if ctx.get_num_outputs() > index and ctx.has_output(index):
            present = onnx.TypeProto()
            present.tensor_type.elem_type = query.tensor_type.elem_type
            ctx.set_output_type(index, present)


def _simplified_layer_norm_schema() -> OpSchema:
    optional = OpSchema.FormalParameterOption.Optional
    schema = OpSchema(
        "SimplifiedLayerNormalization", "", 1, "onnxruntime's RMS normalization (default domain).",
        inputs=[OpSchema.FormalParameter("X", "T"), OpSchema.FormalParameter("scale", "V")],
        outputs=[OpSchema.FormalParameter("Y", "V"),
                 OpSchema.FormalParameter("inv_std_var", "U", param_option=optional)],
        type_constraints=[("T", _FLOATS + ["tensor(double)"], ""), ("U", ["tensor(float)", "tensor(double)"], ""),
                          ("V", _FLOATS + ["tensor(double)"], "")],
        attributes=[OpSchema.Attribute("axis", OpSchema.AttrType.INT, "", required=False),
                    OpSchema.Attribute("epsilon", OpSchema.AttrType.FLOAT, "", required=False),
                    OpSchema.Attribute("stash_type", OpSchema.AttrType.INT, "", required=False)])
    schema.set_type_and_shape_inference_function(_same_as_input)
    return schema


def _same_as_input(ctx) -> None:
    source = ctx.get_input_type(0)
    if source is None:
        return
    out = onnx.TypeProto()
    out.CopyFrom(source)
    ctx.set_output_type(0, out)


register()
