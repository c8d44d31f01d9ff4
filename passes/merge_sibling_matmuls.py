"""Horizontal fusion: sibling MatMuls reading one input with constant weights → one MatMul + Split.

    y_i = MatMul(x, W_i) [+ b_i]     for i = 1..n, every W_i a constant [K, N_i]
  → Split(MatMul(x, concat(W_1..W_n)) [+ concat(b_1..b_n)], [N_1..N_n], axis=−1)

This is the QKV merge in attention and the gate/up merge in SwiGLU MLPs, but nothing here knows
about either: any group of two or more such siblings is merged. Biases are merged when every
sibling's only consumer is an Add of a constant [N_i] vector; otherwise the Adds stay. One
larger GEMM keeps the CPU's cores busier than several small ones, and reads x once.

Preconditions: run after constant folding (weights must be initializers, not Transpose or
Cast outputs of them).
"""

from __future__ import annotations

import numpy as np
import onnx

from llmc.passes.base import RewritePass
from llmc.passes.graph import DEFAULT_DOMAINS, Graph, Rewrite


class MergeSiblingMatMuls(RewritePass):
    name = "merge-sibling-matmuls"
    anchors = ("MatMul",)

    def rewrite(self, graph: Graph, anchor: onnx.NodeProto) -> Rewrite | None:
        source = anchor.input[0]
        # A node reading `source` twice (MatMul(x, x)) is listed twice among its consumers.
        consumers = {id(n): n for n in graph.consumers[source]}.values()
        siblings = [n for n in consumers
                    if n.op_type == "MatMul" and n.domain in DEFAULT_DOMAINS and n.input[0] == source
                    and _weight(graph, n) is not None]
        if len(siblings) < 2 or siblings[0] is not anchor:
            return None
        weights = [_weight(graph, n) for n in siblings]
        if len({(w.shape[0], w.dtype) for w in weights}) != 1:
            return None
        biases = [_bias(graph, n, w.shape[1]) for n, w in zip(siblings, weights)]
        with_bias = all(b is not None for b in biases)

        merged_weight = graph.initializer("merged_weight", np.concatenate(weights, axis=1))
        sizes = graph.initializer("merged_split", np.array([w.shape[1] for w in weights], np.int64))
        initializers = [merged_weight, sizes]
        matmul = graph.node("MatMul", [source, merged_weight.name])
        nodes, removed, merged = [matmul], list(siblings), matmul.output[0]
        if with_bias:
            bias = graph.initializer("merged_bias", np.concatenate([b[1] for b in biases]))
            initializers.append(bias)
            add = graph.node("Add", [merged, bias.name])
            nodes.append(add)
            merged = add.output[0]
            removed += [b[0] for b in biases]
            outputs = [b[0].output[0] for b in biases]
        else:
            outputs = [n.output[0] for n in siblings]
        nodes.append(graph.node("Split", [merged, sizes.name], outputs, axis=-1))
        return Rewrite(removed, nodes, initializers)


def _weight(graph: Graph, node: onnx.NodeProto) -> np.ndarray | None:
    weight = graph.constant(node.input[1])
    return weight if weight is not None and weight.ndim == 2 else None


def _bias(graph: Graph, matmul: onnx.NodeProto, width: int):
    """(the Add node, its bias vector) if the MatMul's only consumer adds a constant [width]."""
    add = graph.only_consumer(matmul.output[0])
    if add is None or add.op_type != "Add" or add.domain not in DEFAULT_DOMAINS:
        return None
    other = add.input[1] if add.input[0] == matmul.output[0] else add.input[0]
    bias = graph.constant(other)
    if bias is None or bias.shape != (width,):
        return None
    return add, bias
