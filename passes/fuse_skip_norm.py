"""Residual Add + norm → com.microsoft `SkipSimplifiedLayerNormalization` / `SkipLayerNormalization`.

Matches Add(a, b) feeding RMSNormalization (→ SkipSimplifiedLayerNormalization) or
LayerNormalization (→ SkipLayerNormalization) over the last axis, with a and b of the same
known rank-3 shape and a 1-D constant scale (and bias). When b is itself Add(m, bias) with a 1-D
constant bias (a projection's bias) and no other reader, the bias becomes the op's `bias` input.
If anything else reads the residual sum (the next layer's residual Add), it is rewired to the
fused op's output 3 (input_skip_bias_sum).

Measured on onnxruntime 1.32 CPU, fp32, 1 thread, median µs with ORT's optimizer off
(identical with it on, except as noted):
    [8, 128, 256]  Add + RMSNormalization-23     86    SkipSimplifiedLayerNormalization  165
                   Add + LayerNormalization-17  135    SkipLayerNormalization           1038
    [8, 1, 256]    Add + RMSNormalization-23    4.6    SkipSimplifiedLayerNormalization  4.9
                   Add + LayerNormalization-17  5.0    SkipLayerNormalization           11.7
Alone, the fused contrib ops are *slower* on the CPU (ORT's own SkipLayerNormFusion, on by
default, turns Add + LayerNormalization into the 1038 µs form), so no CPU pipeline runs the pass.
In a whole step on 2 threads the node it saves weighs more: the single-sequence graph
(compiler/paged_engine.py) fuses its RMS norms so, where SmolLM2-135M's int4 decode step took
0.96x the time and a 128-token prompt 0.97x. It is also onnxruntime's CUDA provider's fast path.

Preconditions: run after fuse-rms-norm and fuse-layer-norm (it consumes their output), with
shapes inferred (it compares the residual operands' shapes). `contrib_ops` registers the fused
ops' schemas with onnx, so checking and shape inference see through them.
"""

from __future__ import annotations

import onnx

from llmc.passes import contrib_ops
from llmc.passes.base import RewritePass
from llmc.passes.graph import Graph, Rewrite, attr
from llmc.passes.patterns import constant_operand

DOMAIN = contrib_ops.DOMAIN
contrib_ops.register()  # so onnx.checker and shape inference see through the fused op
_FUSED = {"RMSNormalization": "SkipSimplifiedLayerNormalization",
          "LayerNormalization": "SkipLayerNormalization"}
_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16}


class FuseSkipNorm(RewritePass):
    """Add + RMSNormalization/LayerNormalization → com.microsoft Skip(Simplified)LayerNormalization."""

    name = "fuse-skip-norm"
    anchors = ("RMSNormalization", "LayerNormalization")
    domain = DOMAIN
    target = "com.microsoft Skip(Simplified)LayerNormalization — onnxruntime only"

    def __init__(self, norms: tuple[str, ...] = anchors):
        """norms: the norm op types fused (the anchors): the single-sequence graph fuses
        RMSNormalization only, SkipLayerNormalization being slower still on the CPU."""
        self.anchors = norms

    def rewrite(self, graph: Graph, norm: onnx.NodeProto) -> Rewrite | None:
        if any(name for name in norm.output[1:]) or _axis(graph, norm) != -1:
            return None
        if attr(norm, "stash_type", 1) != 1:
            return None
        residual = graph.producer_of(norm.input[0], "Add")
        if residual is None:
            return None
        params = [graph.constant(name) for name in norm.input[1:] if name]
        hidden = graph.shape(norm.input[0])
        if (any(p is None or p.ndim != 1 for p in params) or not hidden
                or params[0].shape[0] != hidden[-1]):
            return None
        nodes = [norm, residual]
        a, b = residual.input
        bias = None
        for first, second in ((a, b), (b, a)):
            inner = graph.producer_of(second, "Add")
            found = None if inner is None else constant_operand(graph, inner)
            if (found is not None and found[1].ndim == 1 and found[1].shape[0] == hidden[-1]
                    and graph.only_consumer(second) is residual):
                a, b = first, found[0]
                bias = next(name for name in inner.input if name != found[0])
                nodes.append(inner)
                break
        if not _same_shape(graph, a, b, norm.input[0]):
            return None
        # The contrib ops take one type T for everything; RMSNormalization allows a scale type of its own.
        dtype = graph.elem_type(a)
        if any(graph.elem_type(name) != dtype for name in [*norm.input[1:], bias] if name):
            return None

        inputs = [a, b, *norm.input[1:]]
        if norm.op_type == "LayerNormalization" and bias is not None and len(norm.input) < 3:
            inputs.append("")
        if bias is not None:
            inputs.append(bias)
        total = residual.output[0]
        others = [n for n in graph.consumers.get(total, []) if n is not norm]
        outputs = [norm.output[0]]
        if others or total in graph.outputs:
            outputs += ["", "", total]
        fused = graph.node(_FUSED[norm.op_type], inputs, outputs, domain=DOMAIN,
                           epsilon=attr(norm, "epsilon", 1e-5))
        return Rewrite(remove=nodes, add=[fused])


def _axis(graph: Graph, norm: onnx.NodeProto) -> int | None:
    axis = attr(norm, "axis", -1)
    rank = graph.rank(norm.input[0])
    return axis - rank if axis >= 0 and rank is not None else axis if axis < 0 else None


def _same_shape(graph: Graph, a: str, b: str, total: str) -> bool:
    """a, b and their sum share one rank-3 shape, each dim a fixed size or the same symbol."""
    shapes = [graph.shape(name) for name in (a, b, total)]
    if any(s is None or len(s) != 3 for s in shapes) or any("?" in s or "" in s for s in shapes):
        return False
    types = {graph.elem_type(name) for name in (a, b, total)}
    return shapes[0] == shapes[1] == shapes[2] and len(types) == 1 and types <= _FLOATS

