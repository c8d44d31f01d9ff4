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


def restriction(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto],
                ranks: dict[str, int]) -> str | None:
    """Why the parser would refuse this node beyond its types (None: it would not)."""
    rule = _RULES.get(node.op_type)
    return rule(node, constants, ranks) if rule else None


def _attention(node, constants, ranks):
    if len([o for o in node.output if o]) > 1:
        return "TensorRT's Attention has one output (no present keys/values or scores)"
    if any(len(node.input) > i and node.input[i] for i in (4, 5)):
        return "TensorRT's Attention takes no past keys/values"
    if any(a.name == "softcap" and a.f for a in node.attribute):
        return "TensorRT's Attention has no softcap"
    return None


def _layer_norm(node, constants, ranks):
    if len([o for o in node.output if o]) > 1:
        return "TensorRT's LayerNormalization has only the output Y"
    return None


def _rotary(node, constants, ranks):
    if ranks.get(node.input[0]) == 3 and not any(a.name == "num_heads" for a in node.attribute):
        return "a 3-D RotaryEmbedding input needs the num_heads attribute in TensorRT"
    return None


def _gemm(node, constants, ranks):
    if any(ranks.get(name, 2) != 2 for name in node.input[:2]):
        return "TensorRT's Gemm takes 2-D A and B"
    return None


def _quantize(node, constants, ranks):
    zero_point = node.input[2] if len(node.input) > 2 else ""
    if zero_point:
        if zero_point not in constants:
            return f"its zero point {zero_point} must be a constant in TensorRT"
        tensor = constants[zero_point]
        if tensor.data_type == T.UINT8:
            return "a UINT8 zero point is read as INT8 by TensorRT (asymmetric uint8 is DLA only)"
        if np.any(tensor_array(tensor) != 0):
            return "TensorRT quantizes symmetrically: the zero point must be all zeros"
    scale = node.input[1]
    if scale not in constants:
        return (f"its scale {scale} is computed at run time; TensorRT's {node.op_type} takes a constant scale "
                f"(per-token dynamic int8 has no TensorRT form here: use --int8-calib)")
    if np.any(tensor_array(constants[scale]) <= 0):
        return "TensorRT needs positive scales"
    return None


def _cast(node, constants, ranks):
    target = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "to"), None)
    if target in QUANTIZED:
        return f"TensorRT casts to {T.DataType.Name(target)} only through QuantizeLinear"
    return None


_RULES: dict[str, Callable[..., str | None]] = {
    "Attention": _attention, "LayerNormalization": _layer_norm, "RotaryEmbedding": _rotary, "Gemm": _gemm,
    "QuantizeLinear": _quantize, "DequantizeLinear": _quantize, "Cast": _cast,
}
