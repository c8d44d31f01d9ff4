"""Dead code elimination: drop Identity nodes (and Casts to the type their input already has,
which torch's TorchScript exporter writes for every `.float()` of a float32 value), nodes nobody
reads and unused initializers.

An Identity's readers are pointed at its input. When its output is a graph output, whose name
must not change, its input's producer is renamed to produce the output directly; the Identity
stays when that is impossible (its input is a graph input, an initializer or another graph
output). Values read inside subgraphs are never renamed. Graph inputs are kept even when
unused: they are the model's interface.

No preconditions; run it last, after the passes that leave dead nodes behind.
"""

from __future__ import annotations

import onnx

from llmc.passes.base import Pass, PassResult
from llmc.passes.graph import DEFAULT_DOMAINS, Graph, Rewrite, attr


class EliminateDeadCode(Pass):
    name = "eliminate-dead-code"

    def run(self, model: onnx.ModelProto) -> PassResult:
        nodes_before, initializers_before = len(model.graph.node), len(model.graph.initializer)
        graph = Graph(model)
        pinned = graph.subgraph_reads()
        alias: dict[str, str] = {}
        identities = []
        types = {t.name: t.data_type for t in model.graph.initializer}
        types.update((v.name, v.type.tensor_type.elem_type)
                     for v in (*model.graph.value_info, *model.graph.input, *model.graph.output))
        for node in model.graph.node:
            _redirect_inputs(node, alias)
            if node.domain not in DEFAULT_DOMAINS or not (
                    node.op_type == "Identity"
                    or node.op_type == "Cast" and types.get(node.input[0], 0) == attr(node, "to")):
                continue
            source, target = node.input[0], node.output[0]
            if target in pinned:
                continue
            if target not in graph.outputs:
                alias[target] = source
            elif not self._produce_directly(graph, source, target, pinned):
                continue
            else:
                alias[source] = target
            identities.append(node)
        # Readers of a renamed value may come before the Identity that caused the rename.
        for node in model.graph.node:
            _redirect_inputs(node, alias)
        graph.apply([Rewrite(remove=identities, add=[])])
        removed = (nodes_before - len(model.graph.node)) + (
            initializers_before - len(model.graph.initializer))
        return PassResult(model, removed)

    def _produce_directly(self, graph: Graph, source: str, target: str, pinned: set[str]) -> bool:
        """Rename `source` to the graph output `target` at its producer, if that is safe."""
        producer = graph.producer.get(source)
        if producer is None or source in graph.outputs or source in pinned:
            return False
        outputs = list(producer.output)
        producer.output[outputs.index(source)] = target
        return True


def _redirect_inputs(node: onnx.NodeProto, alias: dict[str, str]) -> None:
    for i, name in enumerate(node.input):
        while name in alias:
            name = alias[name]
        node.input[i] = name
