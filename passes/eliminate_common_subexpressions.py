"""Common subexpression elimination: identical initializers and identical nodes are kept once.

Initializers match on dtype, shape and bytes (compared by hash). Nodes match on domain, op
type, inputs (after earlier merges, so one topological sweep reaches the fixed point), which
outputs are present, and attributes. Readers of a duplicate are pointed at the first copy.

Never merged away: graph outputs (their names are the interface), values read inside
subgraphs, initializers that are also graph inputs (callers may override them), external data
not loaded, string tensors, random ops, and nodes with subgraph attributes.

No preconditions; run it after constant folding, which turns Constant nodes into initializers
that can then be merged, and before dead code elimination.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import onnx
from onnx import numpy_helper

from llmc.passes.base import Pass, PassResult
from llmc.passes.graph import NONDETERMINISTIC_OPS, Graph


class EliminateCommonSubexpressions(Pass):
    name = "eliminate-common-subexpressions"

    def run(self, model: onnx.ModelProto) -> PassResult:
        graph = Graph(model)
        pinned = graph.outputs | graph.subgraph_reads()
        alias: dict[str, str] = {}
        duplicate_tensors = self._merge_initializers(graph, pinned, alias)
        duplicate_nodes = set()
        first: dict[tuple, onnx.NodeProto] = {}
        for node in model.graph.node:
            for i, name in enumerate(node.input):
                node.input[i] = alias.get(name, name)
            key = _node_key(node)
            if key is None:
                continue
            original = first.setdefault(key, node)
            if original is node or any(name in pinned for name in node.output):
                continue
            alias.update((name, kept) for name, kept in zip(node.output, original.output) if name)
            duplicate_nodes.add(id(node))
        if duplicate_nodes:
            # The first copy precedes every duplicate, so the order stays topological.
            kept_nodes = [n for n in model.graph.node if id(n) not in duplicate_nodes]
            del model.graph.node[:]
            model.graph.node.extend(kept_nodes)
        for index in sorted(duplicate_tensors, reverse=True):
            del model.graph.initializer[index]
        return PassResult(model, len(duplicate_nodes) + len(duplicate_tensors))

    def _merge_initializers(self, graph: Graph, pinned: set[str],
                            alias: dict[str, str]) -> list[int]:
        """Alias duplicate initializers to the first copy; returns the duplicates' indices."""
        first: dict[tuple, str] = {}
        duplicates = []
        # Graph outputs first, so that the copy that must stay is the one the others merge into.
        order = [(index, tensor) for index, tensor in sorted(enumerate(graph.graph.initializer),
                                                             key=lambda item: item[1].name not in graph.outputs)
                 if tensor.name not in graph.inputs]
        # Only tensors that agree on type, shape and first bytes can be equal: hash all the bytes
        # of those alone (hashing every weight took a second per run on a 25M-parameter model).
        heads = {index: _tensor_head(tensor) for index, tensor in order}
        counts = Counter(heads.values())
        for index, tensor in order:
            if heads[index] is None or counts[heads[index]] < 2:
                continue
            key = _tensor_key(tensor)
            if key is None:
                continue
            original = first.setdefault(key, tensor.name)
            if original != tensor.name and tensor.name not in pinned:
                alias[tensor.name] = original
                duplicates.append(index)
        return duplicates


def _tensor_head(tensor: onnx.TensorProto) -> tuple | None:
    """Type, shape and first bytes: equal for equal tensors, and cheaper than `_tensor_key`."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.data_type == onnx.TensorProto.STRING:
        return None
    data = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
    return tensor.data_type, tuple(tensor.dims), data[:_HEAD_BYTES]


_HEAD_BYTES = 256


def _tensor_key(tensor: onnx.TensorProto) -> tuple | None:
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None  # not loaded
    if tensor.data_type == onnx.TensorProto.STRING:
        return None  # no byte encoding to hash
    # raw_data and the typed fields encode the same values differently; compare decoded bytes.
    data = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
    # A 128-bit digest: a collision between two different weights is not a practical concern.
    return tensor.data_type, tuple(tensor.dims), hashlib.blake2b(data, digest_size=16).digest()


def _node_key(node: onnx.NodeProto) -> tuple | None:
    if node.op_type in NONDETERMINISTIC_OPS or not any(node.output):
        return None
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None
    attributes = tuple(sorted((a.name, a.SerializeToString(deterministic=True))
                              for a in node.attribute))
    domain = "" if node.domain == "ai.onnx" else node.domain
    return (domain, node.op_type, node.overload, tuple(node.input),
            tuple(bool(name) for name in node.output), attributes)
