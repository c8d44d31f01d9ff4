"""Activation-aware weight scaling (AWQ, Lin et al. 2023) before weight-only quantization.

A few input channels of a linear layer carry much larger activations than the rest, and the
rounding error of their weights is multiplied by those activations. Scaling those rows of W up by
s (and the input down by s) gives them a finer share of their block's levels, while the float
product x · W stays the same. The 1/s has to go somewhere upstream, so a layer is scaled only where
that costs nothing at run time:

- its input is a normalization's output (RMSNormalization, LayerNormalization, ...) read only by
  linear layers being quantized: the norm's scale (and bias) divide by s;
- its input is a product p · u (the MLP's down projection: act(gate) · up) where u comes straight
  from a linear layer, or from a Split of one (a merged gate/up MatMul): u's weight columns
  divide by s. Scaling whole columns commutes with block-wise rounding along K, so u's own
  quantization is unchanged;
- its input is attention's output (o): V's weight columns divide by s, query heads that share
  a KV head sharing s. The KV cache then holds V / s, which only this graph reads.

Anything else is left unscaled.

Per group of layers sharing an input x, s = mean|x|^a per channel, with the exponent a chosen from
`EXPONENTS` (0 included: no scaling) by the output error on calibration rows,
``‖X · W − (X / s) · Q(s · W)‖²``, so the choice is never worse than plain rounding on those rows.
Run on the float graph, before quantization; the statistics come from that same graph.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from llmc.compiler.onnx_io import tensor_array
from llmc.precision.calibration import TensorStats

EXPONENTS = tuple(i / 10 for i in range(10))  # AWQ searches [0, 1); 1 over-scales
ATTENTION = ("Attention", "GroupQueryAttention", "MultiHeadAttention")
# Normalizations whose output 0 may absorb 1/s: op type → the inputs (scale, bias) to divide.
NORMS = {"RMSNormalization": (1,), "SimplifiedLayerNormalization": (1,), "LayerNormalization": (1, 2),
         "SkipSimplifiedLayerNormalization": (2,), "SkipLayerNormalization": (2, 3)}


def scale_inputs(model: onnx.ModelProto, nodes: list[onnx.NodeProto], activations: dict[str, TensorStats],
                 fake_quantize: Callable[[np.ndarray], np.ndarray]) -> dict[str, tuple[float, np.ndarray]]:
    """Scale the weights of `nodes` (MatMuls by [K, N] float initializers) and fold 1/s upstream.

    Args:
        model: modified in place (initializers only; no node is added).
        nodes: the MatMuls about to be quantized.
        activations: statistics of their inputs (keyed by ``node.input[0]``) with `channel_absmean`
            and a `sample` of rows; an input without them is left unscaled.
        fake_quantize: a [K, N] weight as the quantizer will round it (quantized, then dequantized).

    Returns:
        for each input that could be scaled, the exponent chosen (0.0: scaling did not help) and
        the divisor s now applied to it.
    """
    graph = Graph(model)
    chosen_ids = {id(n) for n in nodes}
    inputs = list(dict.fromkeys(n.input[0] for n in nodes))
    chosen = {}
    # Last layer first: down folds into the gate/up weight and o into q/k/v's, which must be
    # final before their own groups measure their error.
    for x in reversed(inputs):
        stats = activations.get(x)
        readers = graph.consumers.get(x, [])
        if stats is None or stats.sample is None or any(id(r) not in chosen_ids for r in readers):
            continue
        target = graph.fold_target(x)
        if target is None:
            continue
        fold, tie = target
        weights = [graph.array(r.input[1]) for r in readers]
        absmean = stats.channel_absmean if tie is None else tie(stats.channel_absmean)
        exponent, s = best_scale(stats.sample, absmean, np.concatenate(weights, axis=1), fake_quantize)
        chosen[x] = (exponent, s)
        if exponent == 0.0:
            continue
        for reader, weight in zip(readers, weights):
            graph.set_array(reader, 1, weight * s[:, None])
        fold(1.0 / s)
    return chosen


def best_scale(sample: np.ndarray, absmean: np.ndarray, weight: np.ndarray,
               fake_quantize: Callable[[np.ndarray], np.ndarray]) -> tuple[float, np.ndarray]:
    """The exponent a (and s = absmean^a) whose scaled rounding changes sample · weight the least."""
    reference = sample @ weight
    best = (np.inf, 0.0, np.ones(len(absmean), np.float32))
    for a in EXPONENTS:
        s = np.power(np.maximum(absmean, 1e-6), a)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)  # centred on 1 (block rounding ignores a common factor)
        error = float(np.square(reference - (sample / s) @ fake_quantize(weight * s[:, None])).sum())
        if error < best[0]:
            best = (error, a, s)
    return best[1], best[2]


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
