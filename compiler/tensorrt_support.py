"""What TensorRT 11's ONNX parser imports: ops of the default domain, their element types, and the
restrictions that bite LLM graphs.

`llmc compile --backend tensorrt --dry-run` checks every node of the final graph against this
(compiler/tensorrt_network.py). No TensorRT 11.4 operator matrix is published; the table is the
11.1 matrix (the newest), which the 11.2-11.4 release notes change only by DFT and 5-D GridSample,
narrowed where the importer code is stricter than the docs. An op missing here is reported as
unsupported: the safe side of a dry run.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper

from llmc.formats.onnx_io import tensor_array
from llmc.plugins.tensorrt_plugin import INPUT_NAMES, input_types_problem
from llmc.precision.dequantize_linear import INT4_BLOCK_SIZES

PARSER_SOURCES = (
    "onnx/onnx-tensorrt docs/operators.md @ 7c51a63a (TensorRT 11.1: opsets 9-24; the parser of NVIDIA/TensorRT's "
    "11.1 OSS release)",
    "onnx/onnx-tensorrt onnxOpImporters.cpp, ModelImporter.cpp @ 5ab48c5c (TensorRT 11.0): Attention, plugin "
    "fallback and attribute-to-field mapping; a late 10.x onnxOpImporters.cpp for Q/DQ, Range, Gemm, MatMul, "
    "RMSNormalization, RotaryEmbedding",
    "NVIDIA/TensorRT CHANGELOG.md and release notes 11.2-11.4 (parser: DFT, 5-D GridSample only); TensorRT 11.0 "
    "release notes (networks are always strongly typed)",
)
MAX_OPSET = 24

# Element types TensorRT 11 has (trt.DataType). DOUBLE is cast down by the parser: a graph llmc
# built never needs it, so it is refused rather than silently narrowed.
ELEMENT_TYPES = frozenset({T.FLOAT, T.FLOAT16, T.BFLOAT16, T.INT8, T.INT32, T.INT64, T.BOOL, T.UINT8,
                           T.FLOAT8E4M3FN, T.INT4, T.FLOAT4E2M1})
# Types that exist only on the quantized side of Q/DQ (and as initializers feeding DequantizeLinear).
QUANTIZED = frozenset({T.INT8, T.FLOAT8E4M3FN, T.INT4, T.FLOAT4E2M1})

F = frozenset({T.FLOAT, T.FLOAT16, T.BFLOAT16})
FI = F | {T.INT32, T.INT64}
FIB = FI | {T.BOOL}

# op type → the element types its inputs and outputs may have.
PARSER_OPS: dict[str, frozenset[int]] = {
    **dict.fromkeys(("Abs", "Add", "Sub", "Mul", "Div", "Max", "Min", "Neg", "Sign", "Sum", "Mean", "Pow", "Mod",
                     "Relu", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
                     "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare", "ArgMax", "ArgMin", "TopK",
                     "Pad", "DepthToSpace", "SpaceToDepth", "ScatterND", "ScatterElements", "Scatter"), FI),
    **dict.fromkeys(("Ceil", "Floor", "Round", "Reciprocal", "Sqrt", "Exp", "Log", "Erf", "Sin", "Sinh", "Cos",
                     "Cosh", "Tan", "Tanh", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Sigmoid",
                     "Softplus", "Softsign", "Elu", "Celu", "Selu", "LeakyRelu", "ThresholdedRelu", "HardSigmoid",
                     "PRelu", "Gelu", "Swish", "Softmax", "LogSoftmax", "Einsum", "Gemm", "MatMul", "CumSum",
                     "LayerNormalization", "RMSNormalization", "GroupNormalization", "InstanceNormalization",
                     "Dropout", "Clip", "IsInf"), F),
    "RotaryEmbedding": F | {T.INT64},  # position_ids are INT64
    "Attention": F | {T.BOOL},  # a boolean attn_mask
    **dict.fromkeys(("Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "IsNaN"), FIB),
    **dict.fromkeys(("And", "Or", "Xor", "Not"), frozenset({T.BOOL})),
    **dict.fromkeys(("Concat", "Expand", "Flatten", "Identity", "Reshape", "Shape", "Size", "Slice", "Split",
                     "Squeeze", "Unsqueeze", "Tile", "Transpose", "Gather", "GatherElements", "GatherND", "Where",
                     "Trilu", "OneHot", "If", "Loop", "EyeLike", "NonZero"), FIB),
    "Range": frozenset({T.FLOAT, T.INT32, T.INT64}),
    "Cast": FIB | {T.UINT8},
    "CastLike": FIB | {T.UINT8},
    "Constant": FIB | QUANTIZED,
    "ConstantOfShape": FIB,
    "QuantizeLinear": F | QUANTIZED,
    "DequantizeLinear": F | QUANTIZED,
}
# Ops that read a quantized (INT8, FP8, INT4, FP4) tensor: TensorRT 11 has no other integer arithmetic.
READS_QUANTIZED = frozenset({"DequantizeLinear", "Constant", "Identity", "Reshape", "Transpose"})


def restriction(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto], ranks: dict[str, int],
                types: dict[str, int]) -> str | None:
    """Why the parser would refuse this node beyond its types (None: it would not)."""
    rule = _RULES.get(node.op_type)
    return rule(node, constants, ranks, types) if rule else None


def reads_quantized(node: onnx.NodeProto, name: str) -> bool:
    """Whether `node` may read the quantized (INT8, FP8, INT4, FP4) tensor `name`: TensorRT 11 has
    no integer arithmetic, so only DequantizeLinear, data movement, and QuantizeLinear's zero point."""
    return node.op_type in READS_QUANTIZED or (node.op_type == "QuantizeLinear" and name in node.input[2:3])


def _attention(node, constants, ranks, types):
    if len([o for o in node.output if o]) > 1:
        return "TensorRT's Attention has one output (no present keys/values or scores)"
    if any(len(node.input) > i and node.input[i] for i in (4, 5)):
        return "TensorRT's Attention takes no past keys/values"
    if any(a.name == "softcap" and a.f for a in node.attribute):
        return "TensorRT's Attention has no softcap"
    return None


def _layer_norm(node, constants, ranks, types):
    if len([o for o in node.output if o]) > 1:
        return "TensorRT's LayerNormalization has only the output Y"
    return None


def _rotary(node, constants, ranks, types):
    if ranks.get(node.input[0]) == 3 and not any(a.name == "num_heads" for a in node.attribute):
        return "a 3-D RotaryEmbedding input needs the num_heads attribute in TensorRT"
    return None


def _gemm(node, constants, ranks, types):
    if any(ranks.get(name, 2) != 2 for name in node.input[:2]):
        return "TensorRT's Gemm takes 2-D A and B"
    return None


# IQuantizeLayer / IDequantizeLayer (NvInfer.h, NVIDIA/TensorRT @ 82d1dca8, the 11.1 OSS release; the
# 11.4 wheel's docstrings say the same of scales and zero points): the scale is a build-time
# constant, strictly positive, a scalar (per tensor), 1-D (per channel: weights only, "Activations
# cannot be quantized per-channel") or of the input's rank (blocks, along the last or second to last
# axis, "supported for input types kFP4, kFP8 and kINT4"); the zero point is optional, a constant of
# the quantized type, all zeros ("only symmetric quantization is supported").
# INT4 (precision/dequantize_linear.py INT4_BLOCK_SIZES): weight-only ("INT4 (signed 4-bit integer,
# weight-only quantization)", docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/
# work-with-quantized-types.html) and "INT4 quantization requires per-block scales. The supported
# block sizes are {64, 128}." (the same guide, quantized-types-schemes.html).
BLOCK_TYPES = frozenset({T.INT4})  # block forms llmc checks; FP8/FP4 blocks are refused (never emitted)


def _quantize_linear(node, constants, ranks, types):
    quantize = node.op_type == "QuantizeLinear"
    data, scale = node.input[0], node.input[1]
    zero_point = node.input[2] if len(node.input) > 2 else ""
    quantized = types.get(node.output[0] if quantize else data)
    if quantize and types.get(data) not in F | {None}:
        return f"{data} is {T.DataType.Name(types[data])}; TensorRT quantizes FLOAT, FLOAT16 or BFLOAT16 only"
    if scale not in constants:
        return (f"its scale {scale} is computed at run time (a per-token or dynamic activation scale); TensorRT's "
                f"{node.op_type} takes a build-time constant scale, so this int8 form runs on the CPU backend only")
    scales = tensor_array(constants[scale])
    if np.any(scales <= 0):
        return "TensorRT needs strictly positive scales"
    if zero_point:
        if zero_point not in constants:
            return f"its zero point {zero_point} must be a constant in TensorRT"
        zero = constants[zero_point]
        if quantized is not None and zero.data_type != quantized:
            return (f"its zero point is {T.DataType.Name(zero.data_type)}; TensorRT takes a zero point of the quantized "
                    f"type ({T.DataType.Name(quantized)})")
        if np.any(tensor_array(zero) != 0):
            return "TensorRT quantizes symmetrically: the zero point must be all zeros"
    if scales.ndim == 0:
        return None  # per tensor
    weight = data in constants
    if scales.ndim == 1:
        return None if weight else (f"{data} is an activation quantized per channel; TensorRT quantizes "
                                    f"activations per tensor only")
    block = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "block_size"), 0)
    kind = T.DataType.Name(quantized) if quantized is not None else "?"
    if quantized not in BLOCK_TYPES:
        return (f"{kind} in blocks of {block}; TensorRT's block-wise {node.op_type} is for INT4 weights (INT8: per "
                f"tensor or per channel only)")
    if not weight:
        return f"{data} is an activation in INT4 blocks; TensorRT's INT4 is for weights only"
    rank = ranks.get(data, scales.ndim)
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 1) % max(rank, 1)
    if axis < rank - 2:
        return f"blocks along axis {axis}; TensorRT blocks along the last or second to last axis only"
    if block not in INT4_BLOCK_SIZES:
        return (f"INT4 in blocks of {block}; TensorRT takes INT4 blocks of "
                f"{' or '.join(map(str, INT4_BLOCK_SIZES))} (--weights-block-size)")
    return None


def _cast(node, constants, ranks, types):
    target = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "to"), None)
    if target in QUANTIZED:
        return f"TensorRT casts to {T.DataType.Name(target)} only through QuantizeLinear"
    return None


_RULES: dict[str, Callable[..., str | None]] = {
    "Attention": _attention, "LayerNormalization": _layer_norm, "RotaryEmbedding": _rotary, "Gemm": _gemm,
    "QuantizeLinear": _quantize_linear, "DequantizeLinear": _quantize_linear, "Cast": _cast,
}


# Element types by the names plugins/tensorrt_plugin.py gives them.
_PLUGIN_TYPE_NAMES = {T.FLOAT: "float32", T.FLOAT16: "float16", T.BFLOAT16: "bfloat16", T.INT32: "int32",
                      T.INT64: "int64"}


def plugin_types_problem(node: onnx.NodeProto, types: dict[str, int]) -> str | None:
    """Why ``llmc::paged_attention``'s register function would refuse this node's input types
    while TensorRT builds: the plugin's own rule (plugins/tensorrt_plugin.py
    `input_types_problem`), applied to the ONNX types (None: it would not)."""
    named = {role: _PLUGIN_TYPE_NAMES.get(types.get(name), _name(types.get(name)).lower())
             for role, name in zip(INPUT_NAMES, node.input)}
    problem = input_types_problem(named)
    return f"the plugin refuses its input types: {problem}" if problem else None


def _name(element: int | None) -> str:
    return "untyped" if element is None else T.DataType.Name(element)
