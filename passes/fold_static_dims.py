"""Fold the parts of a tensor's shape that are static even when the whole shape is not.

    Gather(Shape(x), i)          → constant, when dim i of x is known
    Slice(Shape(x), start, end)  → constant, when those dims of x are known

The TorchScript exporter computes head sizes and slice bounds this way in every layer (e.g.
``Shape(q) → Gather(3) → Div(2)`` for the rotary half-width) although only batch and sequence
are dynamic; constant folding can finish the arithmetic once these are constants, and then
pattern fusions see the constant bounds they need.

Preconditions: value_info refreshed (the pipeline does it before every pass). Run constant
folding after it.
"""

from __future__ import annotations

import numpy as np
import onnx

from llmc.passes.base import RewritePass
from llmc.passes.graph import Graph, Rewrite, attr


class FoldStaticDims(RewritePass):
    name = "fold-static-dims"
    anchors = ("Gather", "Slice")

    def rewrite(self, graph: Graph, node: onnx.NodeProto) -> Rewrite | None:
        shape_node = graph.producer_of(node.input[0], "Shape")
        if shape_node is None:
            return None
        dims = graph.shape(shape_node.input[0])
        if dims is None:
            return None
        start, end = (attr(shape_node, "start", 0), attr(shape_node, "end", len(dims)))
        dims = dims[start:end]
        if node.op_type == "Gather":
            index = graph.constant(node.input[1])
            if index is None or attr(node, "axis", 0) != 0:
                return None
            selected = np.take(np.array(dims, dtype=object), index)
        else:
            bounds = [graph.constant(name) if name else None for name in node.input[1:]]
            if any(b is None for b in bounds[:2]) or any(b is not None and b.tolist() != [0]
                                                        for b in bounds[2:3]):
                return None
            steps = bounds[3] if len(bounds) > 3 else None
            if steps is not None and steps.tolist() != [1]:
                return None
            selected = np.array(dims, dtype=object)[int(bounds[0][0]):int(bounds[1][0])]
        if not all(isinstance(d, int) for d in np.array(selected, dtype=object).ravel().tolist()):
            return None
        value = onnx.numpy_helper.from_array(np.array(selected, dtype=np.int64), node.output[0])
        return Rewrite([node], [], [value])

