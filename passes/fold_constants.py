"""Constant folding: every node whose inputs are all known is computed once and stored.

A value is known when it is an initializer (not also a graph input, which a caller may
override), a Constant's output, the output of a node folded earlier in the same topological
sweep, or, for `Shape` and `Size`, a value whose shape is fully static in `value_info`. Op
semantics come from `onnx.reference.ReferenceEvaluator` run on one node at a time.

Preconditions: `value_info` is fresh (the pipeline runs `infer_shapes(data_prop=True)` before
every pass); without it only `Shape`s of graph inputs and known values fold. External data, if
any, must be loaded.

Folded values become initializers under their own names; a folded graph output keeps its name
through an `Identity` of a new initializer. Not folded, and reported in the notes: random ops,
nodes with subgraphs or in other domains, results that would bloat the model (an `Expand` of a
scalar into a large tensor), and nodes the evaluator cannot run.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from llmc.formats.onnx_io import tensor_array
from llmc.passes.base import Pass, PassResult
from llmc.passes.graph import DEFAULT_DOMAINS, Graph, NONDETERMINISTIC_OPS, Rewrite

# A folded result is refused when it is larger than this and than all its constant inputs
# together: folding would trade a cheap runtime op for a big stored tensor.
MAX_GROWN_ELEMENTS = 1_000_000


Types = dict[str, onnx.TypeProto.Tensor]


class FoldConstants(Pass):
    name = "fold-constants"

    def run(self, model: onnx.ModelProto) -> PassResult:
        graph = Graph(model)
        opsets = {("" if o.domain in DEFAULT_DOMAINS else o.domain): o.version
                  for o in model.opset_import}
        types = _tensor_types(model)
        values: dict[str, np.ndarray] = {}
        folded: list[onnx.NodeProto] = []
        skipped: dict[str, Counter] = defaultdict(Counter)
        for node in model.graph.node:
            feeds = self._feeds(graph, types, node, values)
            if feeds is None:
                continue
            reason = _refusal(types, node, feeds)
            outputs = None
            if reason is None:
                outputs, reason = _evaluate(types, node, feeds, opsets)
            if reason is not None:
                skipped[reason][node.op_type] += 1
                continue
            values.update(outputs)
            folded.append(node)
        if folded:
            graph.apply([self._rewrite(graph, folded, values)])
        notes = [f"not folded, {reason}: {sum(ops.values())} ({_histogram(ops)})"
                 for reason, ops in skipped.items()]
        return PassResult(model, len(folded), notes)

    def _feeds(self, graph: Graph, types: Types, node: onnx.NodeProto,
               values: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The node's inputs if all are known (stand-ins for shape-only inputs); else None."""
        if _is_output_identity(graph, node, values):
            return None  # already the canonical form of a constant graph output
        shape_only = node.op_type in ("Shape", "Size") and node.domain in DEFAULT_DOMAINS
        feeds = {}
        for name in filter(None, node.input):
            if name in values:
                feeds[name] = values[name]
            elif _is_constant_initializer(graph, name):
                feeds[name] = None  # decoded below, once all inputs are known to be
            elif shape_only and _static_shape(types, name) is not None:
                feeds[name] = np.broadcast_to(np.zeros((), np.float32), _static_shape(types, name))
            else:
                return None
        return {name: tensor_array(graph.initializers[name]) if value is None else value
                for name, value in feeds.items()}

    def _rewrite(self, graph: Graph, folded: list[onnx.NodeProto],
                 values: dict[str, np.ndarray]) -> Rewrite:
        folded_ids = {id(n) for n in folded}
        read = graph.subgraph_reads() | graph.outputs
        read.update(name for n in graph.graph.node if id(n) not in folded_ids for name in n.input)
        initializers, identities = [], []
        for node in folded:
            for name in node.output:
                if not name or name not in read:
                    continue  # intermediates read only by other folded nodes are not stored
                if name in graph.outputs:
                    tensor = numpy_helper.from_array(values[name], graph.fresh(name))
                    identities.append(graph.node("Identity", [tensor.name], [name]))
                else:
                    tensor = numpy_helper.from_array(values[name], name)
                initializers.append(tensor)
        return Rewrite(remove=folded, add=identities, initializers=initializers)


def _refusal(types: Types, node: onnx.NodeProto, feeds: dict[str, np.ndarray]) -> str | None:
    """Why `node` must not be folded before evaluating it, or None."""
    if node.domain not in DEFAULT_DOMAINS:
        return "other domain"
    if node.op_type in NONDETERMINISTIC_OPS:
        return "nondeterministic"
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return "has subgraphs"
    sizes = []
    for name in node.output:
        shape = _static_shape(types, name) if name else []
        if shape is None:
            return None  # unknown until evaluated; checked again afterwards
        sizes.append(int(np.prod(shape, dtype=np.int64)))
    return _too_large(node, feeds, sizes)


def _evaluate(types: Types, node: onnx.NodeProto, feeds: dict[str, np.ndarray],
              opsets: dict[str, int]) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """The node's outputs by name, or None and why not."""
    if node.domain:
        node = onnx.NodeProto.FromString(node.SerializeToString())
        node.domain = ""
    try:
        results = ReferenceEvaluator(node, opsets=opsets).run(None, feeds)
    except Exception:  # the evaluator raises many types for ops or cases it lacks
        return None, "evaluator failed"
    outputs = {}
    for name, value in zip(node.output, results):
        if not name:
            continue
        if not isinstance(value, np.ndarray):
            return None, "result is not a tensor"
        if value.dtype.kind == "U":
            value = value.astype(object)
        expected = types[name].elem_type if name in types else 0
        if expected and numpy_helper.from_array(value.reshape(-1)[:0]).data_type != expected:
            return None, "evaluator returned another type"
        outputs[name] = value
    reason = _too_large(node, feeds, [v.size for v in outputs.values()])
    return (None, reason) if reason else (outputs, None)


def _too_large(node: onnx.NodeProto, feeds: dict[str, np.ndarray], sizes: list[int]) -> str | None:
    if node.op_type == "Constant":
        return None  # its tensor is in the model already
    stored = sum(v.size for v in feeds.values())  # Shape stand-ins only make this larger
    if any(size > MAX_GROWN_ELEMENTS and size > stored for size in sizes):
        return f"result over {MAX_GROWN_ELEMENTS} elements"
    return None


def _is_constant_initializer(graph: Graph, name: str) -> bool:
    tensor = graph.initializers.get(name)
    # An initializer that is also an input is a default the caller may override. External data
    # not loaded is in a file this pass has no path to.
    return (tensor is not None and name not in graph.inputs
            and tensor.data_location != onnx.TensorProto.EXTERNAL)


def _tensor_types(model: onnx.ModelProto) -> Types:
    """Declared tensor types by value name, indexed once for the pass."""
    graph = model.graph
    return {info.name: info.type.tensor_type
            for info in itertools.chain(graph.value_info, graph.input, graph.output)
            if info.type.HasField("tensor_type")}


def _static_shape(types: Types, name: str) -> list[int] | None:
    tensor = types.get(name)
    if tensor is None or not tensor.HasField("shape"):
        return None
    if not all(d.HasField("dim_value") for d in tensor.shape.dim):
        return None
    return [d.dim_value for d in tensor.shape.dim]


def _is_output_identity(graph: Graph, node: onnx.NodeProto, values: dict[str, np.ndarray]) -> bool:
    if node.op_type != "Identity" or node.output[0] not in graph.outputs:
        return False
    return node.input[0] in values or _is_constant_initializer(graph, node.input[0])


def _histogram(ops: Counter) -> str:
    return ", ".join(f"{op}×{count}" if count > 1 else op for op, count in sorted(ops.items()))
