"""Decomposed RMSNorm → one ONNX `RMSNormalization` (opset 23).

Matches x · 1/√(mean(x²) + ε) in the spellings exporters write: x² as Pow(x, 2) or Mul(x, x);
ReduceMean over trailing axes (keepdims) with axes as attribute (opset < 18) or input;
1/√ as Reciprocal(Sqrt), Div(1, Sqrt), Pow(·, -0.5), or Div(x, Sqrt(·)); then optionally a
Cast back to the input type (Hugging Face computes in float32) and a constant weight Mul in
either operand order. When a Cast to float32 feeds the norm and the Cast back restores the
original type, the fused op reads the uncast input and both Casts go (the first stays if
something else reads it): RMSNormalization computes in float32 internally (stash_type=1).
An input centred by its own mean (x - mean(x)) is left for fuse-layer-norm.

Target op, measured on onnxruntime 1.32 CPU, fp32 [8, 128, 256], 1 thread, median µs with ORT
graph optimizations off / on (these machines are noisy; min of 15 rounds agreed):
    decomposed (7 ops)                          142 / 141
    SimplifiedLayerNormalization (ORT contrib)   52 /  52
    RMSNormalization-23                          52 /  52
Both fused ops run a native kernel at the same speed. ORT registers SimplifiedLayerNormalization
in the *default* ONNX domain (since version 1), which onnx.checker rejects ("No Op registered for
SimplifiedLayerNormalization with domain_version of 20") and TensorRT's parser lacks, so the pass
emits the standard RMSNormalization-23 (the base raises the default-domain opset to 23 with
onnx's version converter when it matched).

Preconditions: run after constant folding (ε and the weight must be initializers or Constants);
before fuse-skip-norm, which consumes RMSNormalization nodes.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from llmc.passes.base import RewritePass
from llmc.passes.graph import Graph, Rewrite
from llmc.passes.patterns import (constant_operand, consumer, divided_by_sqrt, keeps_dims,
                                  norm_parameter, normalized_dims, reduce_axes, scalar_operand,
                                  square_of, trailing_axis)


class FuseRmsNorm(RewritePass):
    """RMSNorm subgraph → RMSNormalization (see the module docstring for the spellings)."""

    name = "fuse-rms-norm"
    anchors = ("ReduceMean",)
    opset = 23
    target = "ONNX RMSNormalization-23 (as fast as onnxruntime's SimplifiedLayerNormalization on CPU, and standard)"

    def rewrite(self, graph: Graph, mean: onnx.NodeProto) -> Rewrite | None:
        squared = square_of(graph, mean.input[0])
        if squared is None or not keeps_dims(mean):
            return None
        x, square = squared
        axes = reduce_axes(graph, mean)
        axis = None if axes is None else trailing_axis(axes, graph.rank(x))
        if axis is None or _is_centred(graph, x):
            return None
        add = consumer(graph, mean.output[0], "Add")
        eps = None if add is None else scalar_operand(graph, add)
        if eps is None or eps[0] != mean.output[0] or not math.isfinite(eps[1]):
            return None
        scaled = divided_by_sqrt(graph, x, add.output[0])
        if scaled is None:
            return None
        nodes = [square, mean, add, *scaled[0]]
        out = scaled[1]

        cast_out = consumer(graph, out, "Cast")
        if cast_out is not None:
            nodes.append(cast_out)
            out = cast_out.output[0]

        source = x
        cast_in = graph.producer_of(x, "Cast")
        if (cast_in is not None and cast_out is not None
                and _cast_to(cast_in) == onnx.TensorProto.FLOAT
                and _cast_to(cast_out) == graph.elem_type(cast_in.input[0])):
            # HF's float32 island: RMSNormalization computes in float32 itself (stash_type=1),
            # so it reads the uncast input; the Cast stays only if something else reads it.
            if {id(n) for n in graph.consumers[x]} <= {id(n) for n in nodes}:
                nodes.insert(0, cast_in)
            source = cast_in.input[0]
            cast_out = None
        compute_type = graph.elem_type(source) or (_cast_to(cast_in) if cast_in else None)
        if not compute_type:
            return None
        dtype = helper.tensor_dtype_to_np_dtype(compute_type)
        dims = normalized_dims(graph, source, axis)

        weight, scale_value = None, None
        mul = consumer(graph, out, "Mul")
        found = None if mul is None else constant_operand(graph, mul)
        if found is not None and found[0] == out:
            scale_value = norm_parameter(found[1], axis, dims, graph.rank(source))
        if scale_value is not None:
            weight = next(name for name in mul.input if name != out)
            scale_value = scale_value.astype(dtype)
            nodes.append(mul)
            out = mul.output[0]
        elif dims is not None:
            scale_value = np.ones(dims, dtype)
        else:
            return None

        initializers = []
        if weight is not None and _same(graph, weight, scale_value):
            scale = weight
        else:
            tensor = graph.initializer("rms_norm_scale", scale_value)
            initializers.append(tensor)
            scale = tensor.name

        norm_out = out if cast_out is None else graph.fresh("rms_norm")
        add_nodes = [graph.node("RMSNormalization", [source, scale], [norm_out],
                                axis=axis, epsilon=eps[1])]
        if cast_out is not None:
            add_nodes.append(graph.node("Cast", [norm_out], [out], to=_cast_to(cast_out)))
        return Rewrite(remove=nodes, add=add_nodes, initializers=initializers)


def _cast_to(node: onnx.NodeProto) -> int | None:
    return next((attr.i for attr in node.attribute if attr.name == "to"), None)


def _same(graph: Graph, name: str, value: np.ndarray) -> bool:
    """True if constant `name` already holds exactly `value` (same shape and dtype)."""
    current = graph.constant(name)
    return current is not None and current.dtype == value.dtype and current.shape == value.shape


def _is_centred(graph: Graph, x: str) -> bool:
    """x = Sub(y, ReduceMean(y)): a LayerNorm's core, which fuse-layer-norm owns."""
    sub = graph.producer_of(x, "Sub")
    mean = None if sub is None else graph.producer_of(sub.input[1], "ReduceMean")
    return mean is not None and mean.input[0] == sub.input[0]
