"""Decomposed LayerNorm → one ONNX `LayerNormalization` (opset 17).

Matches d = x - mean(x); d / √(mean(d²) + ε), then optionally · weight and + bias (constants,
either operand order): d² as Pow(d, 2) or Mul(d, d); both ReduceMeans over the same trailing
axes (keepdims), axes as attribute or input; the division in any spelling of
`patterns.divided_by_sqrt`. Without a weight the scale is ones, which needs the normalized dims
to be known.

LayerNormalization-17 runs 2.2× faster than the nine decomposed ops on onnxruntime 1.32 CPU
(fp32 [8, 128, 256], 1 thread: 102 µs vs 226 µs with ORT's optimizer off; with it on ORT fuses
the decomposed form itself).

Preconditions: run after constant folding (ε, weight and bias must be initializers or
Constants); before fuse-rms-norm would not hurt (it leaves centred inputs alone) but before
fuse-skip-norm, which consumes LayerNormalization nodes. The default-domain opset is raised to
17 when it matched.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from llmc.passes.base import RewritePass
from llmc.passes.graph import Graph, Rewrite
from llmc.passes.patterns import (constant_operand, consumer, divided_by_sqrt, is_default,
                                  keeps_dims, norm_parameter, normalized_dims, reduce_axes,
                                  scalar_operand, trailing_axis)


class FuseLayerNorm(RewritePass):
    """LayerNorm subgraph → LayerNormalization."""

    name = "fuse-layer-norm"
    anchors = ("ReduceMean",)
    opset = 17
    target = "ONNX LayerNormalization-17"

    def rewrite(self, graph: Graph, mean: onnx.NodeProto) -> Rewrite | None:
        x = mean.input[0]
        axis = _trailing_axis(graph, mean, x)
        sub = consumer(graph, mean.output[0], "Sub")
        if axis is None or sub is None or list(sub.input) != [x, mean.output[0]]:
            return None
        d = sub.output[0]
        square = _square_of(graph, d)
        variance = None if square is None else consumer(graph, square.output[0], "ReduceMean")
        if variance is None or _trailing_axis(graph, variance, x) != axis:
            return None
        add = consumer(graph, variance.output[0], "Add")
        eps = None if add is None else scalar_operand(graph, add)
        if eps is None or eps[0] != variance.output[0] or not math.isfinite(eps[1]):
            return None
        scaled = divided_by_sqrt(graph, d, add.output[0])
        if scaled is None:
            return None
        nodes = [mean, sub, square, variance, add, *scaled[0]]
        out = scaled[1]

        elem_type = graph.elem_type(x)
        if not elem_type:
            return None
        dtype = helper.tensor_dtype_to_np_dtype(elem_type)
        dims = normalized_dims(graph, x, axis)
        params = {}
        for op_type in ("Mul", "Add"):
            node = consumer(graph, out, op_type)
            found = None if node is None else constant_operand(graph, node)
            if found is None or found[0] != out:
                continue
            value = norm_parameter(found[1], axis, dims, graph.rank(x))
            if value is None:
                break  # an affine step along other dims: fuse what comes before it
            given = next(name for name in node.input if name != out)
            reusable = value.shape == found[1].shape and found[1].dtype == dtype
            params[op_type] = (given if reusable else None, value.astype(dtype))
            nodes.append(node)
            out = node.output[0]

        if "Mul" not in params:
            if dims is None:
                return None
            params["Mul"] = (None, np.ones(dims, dtype))
        inputs, initializers = [x], []
        for op_type, prefix in (("Mul", "layer_norm_scale"), ("Add", "layer_norm_bias")):
            if op_type not in params:
                continue
            name, value = params[op_type]
            if name is None:
                tensor = graph.initializer(prefix, value)
                initializers.append(tensor)
                name = tensor.name
            inputs.append(name)
        node = graph.node("LayerNormalization", inputs, [out], axis=axis, epsilon=eps[1])
        return Rewrite(remove=nodes, add=[node], initializers=initializers)


def _trailing_axis(graph: Graph, mean: onnx.NodeProto, x: str) -> int | None:
    axes = reduce_axes(graph, mean) if keeps_dims(mean) else None
    return None if axes is None else trailing_axis(axes, graph.rank(x))


def _square_of(graph: Graph, d: str) -> onnx.NodeProto | None:
    """The one node squaring `d`: Pow(d, 2) or Mul(d, d)."""
    for node in graph.consumers.get(d, []):
        if is_default(node, "Mul") and list(node.input) == [d, d]:
            return node
        if is_default(node, "Pow") and node.input[0] == d and graph.scalar(node.input[1]) == 2.0:
            return node
    return None
