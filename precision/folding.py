"""Folding a per-channel scale into the graph: where a linear layer's input x can be divided by s
at no run-time cost, its weights' rows multiplied by s instead keep the float function. Used by
SmoothQuant (precision/int8.py) and activation-aware int4 (precision/awq.py).

x can absorb 1/s when it is
- a normalization's output (RMSNormalization, LayerNormalization, ...): the norm's scale (and
  bias) divide by s;
- a product p · u (the MLP's down projection: act(gate) · up) where u comes straight from a linear
  layer, or from a Split of one (a merged gate/up MatMul): u's weight columns divide by s;
- attention's output (o): V's weight columns divide by s, query heads that share a KV head
  sharing s. The KV cache then holds V / s, which only this graph reads.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from llmc.formats.onnx_io import tensor_array

ATTENTION = ("Attention", "GroupQueryAttention", "MultiHeadAttention")
# Normalizations whose output 0 may absorb 1/s: op type → the inputs (scale, bias) to divide.
NORMS = {"RMSNormalization": (1,), "SimplifiedLayerNormalization": (1,), "LayerNormalization": (1, 2),
         "SkipSimplifiedLayerNormalization": (2,), "SkipLayerNormalization": (2, 3)}


class Graph:
    """Producers, consumers and initializers of a graph, with copy-on-write for shared weights."""

    def __init__(self, model: onnx.ModelProto):
        self.graph = model.graph
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.producer = {o: n for n in model.graph.node for o in n.output}
        self.outputs = {o.name for o in model.graph.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in model.graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)

    def array(self, name: str) -> np.ndarray:
        return tensor_array(self.initializers[name]).astype(np.float32)

    def set_array(self, node: onnx.NodeProto, index: int, value: np.ndarray) -> None:
        """Give `node` its own copy of input `index` holding `value` (others reading it keep theirs)."""
        old = self.initializers[node.input[index]]
        if len(self.consumers[old.name]) == 1 and list(node.input).count(old.name) == 1:
            old.CopyFrom(numpy_helper.from_array(value.astype(np.float32), old.name))
            return
        name = f"{old.name}.awq.{node.name or node.output[0]}"
        self.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
        self.initializers[name] = self.graph.initializer[-1]
        self.consumers[old.name].remove(node)
        self.consumers[name] = [node]
        node.input[index] = name

    def is_float_vector(self, name: str, length: int) -> bool:
        t = self.initializers.get(name)
        return t is not None and t.data_type == onnx.TensorProto.FLOAT and list(t.dims) == [length]

    def fold_target(self, x: str) -> tuple[Callable[[np.ndarray], None], Callable | None] | None:
        """Where x's 1/s can be multiplied in: a function doing it, and one that makes per-channel
        statistics the same where s must be (None: s is free); or None."""
        node, k = self.producer.get(x), self.channels(x)
        if node is None or k is None or x in self.outputs:
            return None
        if node.op_type in NORMS and node.output[0] == x:
            indices = [i for i in NORMS[node.op_type] if i < len(node.input) and node.input[i]]
            if not all(self.is_float_vector(node.input[i], k) for i in indices):
                return None

            def fold_norm(inverse: np.ndarray) -> None:
                for i in indices:
                    self.set_array(node, i, self.array(node.input[i]) * inverse)
            return fold_norm, None
        if node.op_type == "Mul" and node.domain in ("", "ai.onnx") and node.input[0] != node.input[1]:  # not u · u
            for u in node.input:
                if len(self.consumers.get(u, [])) == 1:  # u is read by this product alone
                    columns = self.columns_of(u, k)
                    if columns is not None:
                        return columns, None
        if node.op_type in ATTENTION and node.output[0] == x and len(node.input) > 2:
            return self.attention_target(node, k)
        return None

    def attention_target(self, node: onnx.NodeProto, k: int) -> tuple[Callable, Callable] | None:
        """Attention's output is softmax-weighted V, head by head: a channel of it divides by s
        when V's channel does. Query heads sharing one KV head (GQA) must then share s."""
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        heads = attributes.get("q_num_heads", attributes.get("num_heads"))
        kv_heads = attributes.get("kv_num_heads", heads)
        if (not heads or not kv_heads or k % heads or heads % kv_heads or not node.input[2]
                or len(self.consumers.get(node.input[2], [])) != 1):
            return None
        shape = (kv_heads, heads // kv_heads, k // heads)  # output channel = (kv head, query in group, dim)
        columns = self.columns_of(node.input[2], kv_heads * shape[2])
        if columns is None:
            return None

        def fold_values(inverse: np.ndarray) -> None:
            columns(inverse.reshape(shape)[:, 0].reshape(-1))

        def tie(absmean: np.ndarray) -> np.ndarray:
            pooled = absmean.reshape(shape).mean(axis=1, keepdims=True)
            return np.broadcast_to(pooled, shape).reshape(-1)
        return fold_values, tie

    def channels(self, x: str) -> int | None:
        readers = self.consumers.get(x, [])
        dims = {self.initializers[r.input[1]].dims[0] for r in readers if r.input[1] in self.initializers}
        return dims.pop() if len(dims) == 1 else None

    def columns_of(self, u: str, k: int) -> Callable[[np.ndarray], None] | None:
        """A fold into the k weight columns that produce u: u = x · W, or u = Split(x · W)[j] on
        the last axis."""
        node = self.producer.get(u)
        start, width = 0, None
        if node is not None and node.op_type == "Split":
            sizes = self.split_sizes(node)
            if sizes is None:
                return None
            j = list(node.output).index(u)
            start, width = sum(sizes[:j]), sizes[j]
            u, node = node.input[0], self.producer.get(node.input[0])
            if len(self.consumers.get(u, [])) != 1:
                return None
        weight = self.initializers.get(node.input[1]) if node is not None and len(node.input) == 2 else None
        if (weight is None or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx")
                or weight.data_type != onnx.TensorProto.FLOAT or len(weight.dims) != 2
                or (width if width is not None else weight.dims[1]) != k):
            return None

        def fold_columns(inverse: np.ndarray) -> None:
            weight = self.array(node.input[1])
            weight[:, start:start + len(inverse)] *= inverse
            self.set_array(node, 1, weight)
        return fold_columns

    def split_sizes(self, node: onnx.NodeProto) -> list[int] | None:
        """A last-axis Split's output widths, when they are constants."""
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attributes.get("axis", 0) != -1:
            return None  # without shapes, only -1 surely names the channel axis
        if len(node.input) > 1 and node.input[1] in self.initializers:
            return [int(v) for v in tensor_array(self.initializers[node.input[1]])]
        if "split" in attributes:
            return list(attributes["split"])
        return None
