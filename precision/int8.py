"""Static int8 as explicit Q/DQ: what TensorRT 11 builds int8 engines from (it no longer
calibrates itself), and what onnxruntime runs on the CPU.

For every selected linear layer MatMul(x, W):

    W  → int8 initializer, per output channel symmetric (scale = max|W[:, n]| / 127)
         → DequantizeLinear(axis=1) → MatMul
    x  → QuantizeLinear → DequantizeLinear (per tensor, symmetric, scale = threshold / 127,
         the threshold from the calibrator) → MatMul; layers reading the same x share one pair

Zero points are int8 zeros: symmetric, as TensorRT requires.

SmoothQuant (optional, alpha in (0, 1)): where x is a normalization's output read only by linear
layers, outlier channels are moved from activations into weights before quantizing:
s_j = max|x_j|^alpha / max|W_j|^(1-alpha) over those layers; the norm's scale is divided by s and
each W's row j multiplied by it. The float function is unchanged; int8 suffers less from x's
outlier channels.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from llmc.compiler.onnx_io import tensor_array
from llmc.errors import LlmcError
from llmc.precision.calibration import TensorStats, observe, threshold
from llmc.precision.linears import Linear

_NORMS = ("RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization")


def quantize_int8(model: onnx.ModelProto, linears: list[Linear], windows: list[np.ndarray], calibrator: str,
                  smoothquant: float | None = None,
                  progress: Callable[[str], None] = lambda message: None) -> dict[str, float]:
    """Calibrate and write Q/DQ for `linears` in place; returns each activation's threshold."""
    if smoothquant is not None and not 0.0 < smoothquant < 1.0:
        raise LlmcError(f"--smoothquant: alpha must be between 0 and 1, got {smoothquant}")
    inputs = sorted({l.node.input[0] for l in linears})
    if smoothquant is not None:
        stats = observe(model, windows, inputs, histograms=False, progress=progress)
        smoothed = smooth(model, linears, stats, smoothquant)
        progress(f"smoothquant: {smoothed} normalization outputs smoothed (alpha {smoothquant})")
    stats = observe(model, windows, inputs, histograms=calibrator != "minmax", progress=progress)
    thresholds = {name: threshold(stats[name], calibrator) for name in inputs}
    write_qdq(model, linears, thresholds)
    return thresholds


def write_qdq(model: onnx.ModelProto, linears: list[Linear], thresholds: dict[str, float]) -> None:
    """Insert the Q/DQ pairs and int8 weights (see the module docstring)."""
    weights = {t.name: t for t in model.graph.initializer}
    added, nodes_before = [], {}
    for name, limit in thresholds.items():
        scale = np.float32(max(limit, 1e-8) / 127.0)
        prefix = f"{name}.int8"
        added += [numpy_helper.from_array(np.array(scale, np.float32), f"{prefix}.scale"),
                  numpy_helper.from_array(np.array(0, np.int8), f"{prefix}.zero_point")]
        nodes_before[name] = [
            helper.make_node("QuantizeLinear", [name, f"{prefix}.scale", f"{prefix}.zero_point"], [f"{prefix}.q"],
                             name=f"{prefix}/Quantize"),
            helper.make_node("DequantizeLinear", [f"{prefix}.q", f"{prefix}.scale", f"{prefix}.zero_point"],
                             [f"{prefix}.dq"], name=f"{prefix}/Dequantize")]
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for i in node.input:
            readers[i] = readers.get(i, 0) + 1
    drop, dequantize = set(), []
    for layer in linears:
        weight = tensor_array(weights[layer.weight]).astype(np.float32)
        scale = np.maximum(np.abs(weight).max(axis=0), 1e-8) / 127.0
        codes = np.clip(np.rint(weight / scale), -127, 127).astype(np.int8)
        prefix = f"{layer.name}.weight.int8"
        added += [numpy_helper.from_array(codes, f"{prefix}"),
                  numpy_helper.from_array(scale.astype(np.float32), f"{prefix}.scale"),
                  numpy_helper.from_array(np.zeros(len(scale), np.int8), f"{prefix}.zero_point")]
        dequantize.append(helper.make_node("DequantizeLinear", [prefix, f"{prefix}.scale", f"{prefix}.zero_point"],
                                           [f"{prefix}.dq"], name=f"{prefix}/Dequantize", axis=1))
        readers[layer.weight] -= 1
        if readers[layer.weight] == 0:
            drop.add(layer.weight)
        layer.node.input[0] = f"{layer.node.input[0]}.int8.dq"
        layer.node.input[1] = f"{prefix}.dq"
    # Place each activation's pair right after its producer, weights' DQ first: a valid order.
    order = list(dequantize)
    graph_inputs = {i.name for i in model.graph.input}
    for name in thresholds:
        if name in graph_inputs:
            order += nodes_before.pop(name)
    for node in model.graph.node:
        order.append(node)
        for out in node.output:
            order += nodes_before.pop(out, [])
    del model.graph.node[:]
    model.graph.node.extend(order)
    kept = [t for t in model.graph.initializer if t.name not in drop]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + added)


def smooth(model: onnx.ModelProto, linears: list[Linear], stats: dict[str, TensorStats], alpha: float) -> int:
    """Fold SmoothQuant scales into norms and weights where a norm's output feeds only linear
    layers; returns how many norm outputs were smoothed."""
    producer = {o: n for n in model.graph.node for o in n.output}
    weights = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list] = {}
    for node in model.graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    by_input: dict[str, list[Linear]] = {}
    for layer in linears:
        by_input.setdefault(layer.node.input[0], []).append(layer)
    count = 0
    for name, layers in by_input.items():
        norm = producer.get(name)
        if (norm is None or norm.op_type not in _NORMS or len(norm.input) < 2 or norm.input[1] not in weights
                or len(readers[name]) != len(layers) or stats[name].channel_absmax is None
                or sum(len(readers.get(w.weight, [])) for w in layers) != len(layers)):
            continue
        if len(readers[norm.input[1]]) > 1:  # a scale shared with other norms (deduplicated): own copy
            own = numpy_helper.from_array(tensor_array(weights[norm.input[1]]), f"{name}.smoothed_scale")
            model.graph.initializer.append(own)
            weights[own.name] = model.graph.initializer[-1]
            readers[norm.input[1]].remove(norm)
            norm.input[1] = own.name
            readers[own.name] = [norm]
        ws = [tensor_array(weights[l.weight]).astype(np.float32) for l in layers]
        w_max = np.max([np.abs(w).max(axis=1) for w in ws], axis=0)
        x_max = stats[name].channel_absmax
        s = np.power(np.maximum(x_max, 1e-5), alpha) / np.power(np.maximum(w_max, 1e-5), 1 - alpha)
        s = np.clip(s, 1e-3, 1e3).astype(np.float32)
        gamma = tensor_array(weights[norm.input[1]]).astype(np.float32)
        weights[norm.input[1]].CopyFrom(numpy_helper.from_array((gamma / s).astype(np.float32), norm.input[1]))
        if len(norm.input) > 2 and norm.input[2] in weights:  # LayerNorm's bias scales too
            beta = tensor_array(weights[norm.input[2]]).astype(np.float32)
            weights[norm.input[2]].CopyFrom(numpy_helper.from_array((beta / s).astype(np.float32), norm.input[2]))
        for layer, w in zip(layers, ws):
            weights[layer.weight].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(np.float32), layer.weight))
        count += 1
    return count
