"""Name the positions a graph computes from its past length ``position_ids``.

Some exports take no ``position_ids`` input (Optimum's Gemma-family exports: transformers 4.57
computes them from ``cache_position``)::

    position_ids = Unsqueeze(Range(past, past + seq, 1), axes=[0])          [1, seq]
    past = Shape(past_key_values.i.*)[2],  seq = Shape(input_ids or its (scaled) embedding)[1]

(Casts allowed around either length). The same value, renamed ``position_ids``, is what the
paged lowering looks for: it replaces a computed ``position_ids`` with its packed positions input,
so such a graph compiles paged. Nothing is computed differently: the graph keeps its own
arithmetic until the lowering.

Preconditions: run after constant folding (the Gather indices and the Range step must be
constants). Does nothing when the graph has a ``position_ids`` input or value already.
"""

from __future__ import annotations

import numpy as np
import onnx

from llmc.passes.base import Pass, PassResult
from llmc.passes.graph import Graph, attr

POSITIONS = "position_ids"


class NameCachePositions(Pass):
    name = "name-cache-positions"

    def run(self, model: onnx.ModelProto) -> PassResult:
        graph = Graph(model)
        if POSITIONS in graph.inputs or POSITIONS in graph.producer:
            return PassResult(model, 0, ["no match: the graph has position_ids"])
        for node in model.graph.node:
            if node.op_type != "Unsqueeze" or node.output[0] in graph.outputs:
                continue
            axes = graph.constant(node.input[1]) if len(node.input) > 1 else attr(node, "axes")
            positions = graph.producer_of(node.input[0], "Range")
            if axes is None or list(np.ravel(axes)) != [0] or positions is None:
                continue
            if not _is_cache_position(graph, positions):
                continue
            old = node.output[0]
            for user in graph.consumers.get(old, []):
                user.input[:] = [POSITIONS if name == old else name for name in user.input]
            node.output[0] = POSITIONS
            return PassResult(model, 1, ["positions computed from the past length named position_ids"])
        return PassResult(model, 0, ["no match: no Range(past, past + seq) positions"])


def _is_cache_position(graph: Graph, positions: onnx.NodeProto) -> bool:
    """Whether `positions` is Range(past length, past length + new tokens, 1)."""
    start, limit, step = positions.input
    if graph.scalar(step) != 1.0 or not _is_length(graph, start, past=True):
        return False
    add = graph.producer_of(_uncast(graph, limit), "Add")
    if add is None:
        return False
    a, b = add.input
    return ((_is_length(graph, a, past=True) and _is_length(graph, b, past=False))
            or (_is_length(graph, b, past=True) and _is_length(graph, a, past=False)))


def _is_length(graph: Graph, name: str, *, past: bool) -> bool:
    """Shape(past_key_values.*)[2] (past) or Shape(input_ids or Gather(table, input_ids))[1]."""
    gather = graph.producer_of(_uncast(graph, name), "Gather")
    shape = gather and graph.producer_of(gather.input[0], "Shape")
    if shape is None or shape.attribute or attr(gather, "axis", 0) != 0:
        return False
    index = graph.constant(gather.input[1])
    if index is None or index.size != 1:
        return False
    index, source = int(np.ravel(index)[0]), shape.input[0]
    if past:
        return index in (2, -2) and source in graph.inputs and source.startswith("past_key_values.")
    if index != 1:
        return False
    # Through a scalar scaling of the embeddings (Gemma 3's · √hidden), which keeps the shape.
    while (scaled := graph.producer_of(source, "Mul", "Div", "Cast")) is not None and (
            scaled.op_type == "Cast" or graph.scalar(scaled.input[1]) is not None):
        source = scaled.input[0]
    embedding = graph.producer_of(source, "Gather")
    return source == "input_ids" or (embedding is not None and embedding.input[1] == "input_ids"
                                     and attr(embedding, "axis", 0) == 0)


def _uncast(graph: Graph, name: str) -> str:
    while (cast := graph.producer_of(name, "Cast")) is not None:
        name = cast.input[0]
    return name
