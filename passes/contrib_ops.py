"""ONNX schemas for the onnxruntime contrib ops (com.microsoft) that our passes emit.

The onnx package knows no com.microsoft op, so shape inference stops at one: after
fuse-skip-norm on tiny-llama, inferred value_info fell from 228 entries to 95, leaving every
later pass blind to shapes downstream of the first fused norm. `register()` adds schemas that
mirror onnxruntime 1.32's (inputs, outputs, type constraints, attributes; see
`onnxruntime.capi.onnxruntime_pybind11_state.get_all_operator_schema`) with type and shape
inference, so onnx.checker validates these nodes and inference flows through them. Modules of
passes that emit these ops call it at import; it is idempotent.
"""

from __future__ import annotations

import onnx
from onnx import defs
from onnx.defs import OpSchema

DOMAIN = "com.microsoft"
_NORM_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


def register() -> None:
    """Register the contrib schemas with onnx (once per process)."""
    for schema in (_quick_gelu(), _skip_norm("SkipLayerNormalization", beta=True),
                   _skip_norm("SkipSimplifiedLayerNormalization", beta=False), _matmul_nbits(),
                   _group_query_attention()):
        try:
            defs.get_schema(schema.name, schema.since_version, schema.domain)
        except defs.SchemaError:
            defs.register_schema(schema)


def _quick_gelu() -> OpSchema:
    schema = OpSchema(
        "QuickGelu", DOMAIN, 1, "Y = X · Sigmoid(alpha · X).",
        inputs=[OpSchema.FormalParameter("X", "T")],
        outputs=[OpSchema.FormalParameter("Y", "T")],
        type_constraints=[("T", ["tensor(float16)", "tensor(float)", "tensor(double)", "tensor(bfloat16)"], "")],
        attributes=[OpSchema.Attribute("alpha", OpSchema.AttrType.FLOAT, "", required=False)])
    schema.set_type_and_shape_inference_function(_same_as_input)
    return schema


def _skip_norm(name: str, beta: bool) -> OpSchema:
    optional = OpSchema.FormalParameterOption.Optional
    inputs = [OpSchema.FormalParameter("input", "T"), OpSchema.FormalParameter("skip", "T"),
              OpSchema.FormalParameter("gamma", "T")]
    if beta:
        inputs.append(OpSchema.FormalParameter("beta", "T", param_option=optional))
    inputs.append(OpSchema.FormalParameter("bias", "T", param_option=optional))
    schema = OpSchema(
        name, DOMAIN, 1, "Normalizes input + skip (+ bias); output 3 is that sum.",
        inputs=inputs,
        outputs=[OpSchema.FormalParameter("output", "T"),
                 OpSchema.FormalParameter("mean", "U", param_option=optional),
                 OpSchema.FormalParameter("inv_std_var", "U", param_option=optional),
                 OpSchema.FormalParameter("input_skip_bias_sum", "T", param_option=optional)],
        type_constraints=[("T", _NORM_TYPES, ""), ("U", ["tensor(float)"], "")],
        attributes=[OpSchema.Attribute("epsilon", OpSchema.AttrType.FLOAT, "", required=False)])
    schema.set_type_and_shape_inference_function(_skip_norm_outputs)
    return schema


def _matmul_nbits() -> OpSchema:
    optional = OpSchema.FormalParameterOption.Optional
    schema = OpSchema(
        "MatMulNBits", DOMAIN, 1, "Y = A · dequantize(B)ᵀ with B block-quantized along K.",
        inputs=[OpSchema.FormalParameter("A", "T1"), OpSchema.FormalParameter("B", "T2"),
                OpSchema.FormalParameter("scales", "T1"),
                OpSchema.FormalParameter("zero_points", "T3", param_option=optional),
                OpSchema.FormalParameter("g_idx", "T4", param_option=optional),
                OpSchema.FormalParameter("bias", "T1", param_option=optional)],
        outputs=[OpSchema.FormalParameter("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)"], ""), ("T2", ["tensor(uint8)"], ""),
                          ("T3", ["tensor(uint8)", "tensor(float)", "tensor(float16)"], ""),
                          ("T4", ["tensor(int32)"], "")],
        attributes=[OpSchema.Attribute(name, OpSchema.AttrType.INT, "", required=True) for name in ("K", "N", "block_size")]
        + [OpSchema.Attribute(name, OpSchema.AttrType.INT, "", required=False) for name in ("bits", "accuracy_level")])
    schema.set_type_and_shape_inference_function(_matmul_nbits_output)
    return schema


def _group_query_attention() -> OpSchema:
    """The inputs and attributes the single-sequence graph uses (passes/lower_single_sequence.py);
    onnxruntime's op takes more, all optional and after these."""
    optional = OpSchema.FormalParameterOption.Optional
    schema = OpSchema(
        "GroupQueryAttention", DOMAIN, 1, "Causal attention over a key/value buffer it appends to.",
        inputs=[OpSchema.FormalParameter("query", "T"), OpSchema.FormalParameter("key", "T", param_option=optional),
                OpSchema.FormalParameter("value", "T", param_option=optional),
                OpSchema.FormalParameter("past_key", "T", param_option=optional),
                OpSchema.FormalParameter("past_value", "T", param_option=optional),
                OpSchema.FormalParameter("seqlens_k", "M"), OpSchema.FormalParameter("total_sequence_length", "M"),
                OpSchema.FormalParameter("cos_cache", "T", param_option=optional),
                OpSchema.FormalParameter("sin_cache", "T", param_option=optional)],
        outputs=[OpSchema.FormalParameter("output", "T"),
                 OpSchema.FormalParameter("present_key", "T", param_option=optional),
                 OpSchema.FormalParameter("present_value", "T", param_option=optional)],
        type_constraints=[("T", _NORM_TYPES, ""), ("M", ["tensor(int32)"], "")],
        attributes=[OpSchema.Attribute(name, OpSchema.AttrType.INT, "", required=True) for name in ("num_heads", "kv_num_heads")]
        + [OpSchema.Attribute(name, OpSchema.AttrType.INT, "", required=False) for name in ("local_window_size", "do_rotary")]
        + [OpSchema.Attribute(name, OpSchema.AttrType.FLOAT, "", required=False) for name in ("scale", "softcap")])
    schema.set_type_and_shape_inference_function(_group_query_attention_outputs)
    return schema


def _group_query_attention_outputs(ctx) -> None:
    """The output is shaped like the query (its heads' part of a packed query, key and value);
    the presents like the pasts (the buffer is shared)."""
    out = _copy(ctx.get_input_type(0))
    packed = ctx.get_num_inputs() < 2 or not ctx.has_input(1)
    dims = out.tensor_type.shape.dim if out.tensor_type.HasField("shape") else []
    if packed and dims:
        heads, kv_heads = ctx.get_attribute("num_heads").i, ctx.get_attribute("kv_num_heads").i
        width = dims[-1].dim_value
        dims[-1].Clear()
        if width:
            dims[-1].dim_value = width // (heads + 2 * kv_heads) * heads
    ctx.set_output_type(0, out)
    for output, past in ((1, 3), (2, 4)):
        if ctx.get_num_outputs() > output and ctx.has_output(output):
            ctx.set_output_type(output, _copy(ctx.get_input_type(past)))


def _matmul_nbits_output(ctx) -> None:
    out = _copy(ctx.get_input_type(0))
    n = ctx.get_attribute("N")
    if n is not None and out.tensor_type.HasField("shape") and out.tensor_type.shape.dim:
        last = out.tensor_type.shape.dim[-1]
        last.Clear()
        last.dim_value = n.i
    elif out.tensor_type.HasField("shape"):
        out.tensor_type.ClearField("shape")
    ctx.set_output_type(0, out)


def _same_as_input(ctx) -> None:
    ctx.set_output_type(0, _copy(ctx.get_input_type(0)))


def _skip_norm_outputs(ctx) -> None:
    source = ctx.get_input_type(0)
    ctx.set_output_type(0, _copy(source))
    if ctx.get_num_outputs() > 3 and ctx.has_output(3):
        ctx.set_output_type(3, _copy(source))
    for index in (1, 2):
        if ctx.get_num_outputs() > index and ctx.has_output(index):
            stats = _copy(source)
            stats.tensor_type.elem_type = onnx.TensorProto.FLOAT
            if stats.tensor_type.HasField("shape") and stats.tensor_type.shape.dim:
                last = stats.tensor_type.shape.dim[-1]
                last.Clear()
                last.dim_value = 1
            ctx.set_output_type(index, stats)


def _copy(source: onnx.TypeProto | None) -> onnx.TypeProto:
    out = onnx.TypeProto()
    if source is not None:
        out.CopyFrom(source)
    return out
