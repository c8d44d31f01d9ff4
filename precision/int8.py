"""int8 as explicit Q/DQ: what TensorRT 11 builds int8 engines from (it no longer calibrates
itself), and what onnxruntime runs on the CPU.

For every selected linear layer MatMul(x, W):

    W  → int8 initializer, per output channel symmetric (scale = max|W[:, n]| / 127)
         → DequantizeLinear(axis=1) → MatMul
    x  → QuantizeLinear → DequantizeLinear → MatMul, symmetric (zero points are int8 zeros, as
         TensorRT requires); layers reading the same x share one pair. Its scale is either
         static:    per tensor, threshold / 127, the threshold from the calibrator; or
         per token: computed at run time, max|x| of each row / 127 (blocked Q/DQ over the last
                    axis, opset 21), which needs no calibration.

Which activations get per-token scales: all of them in the dynamic mode; with calibration, the
inputs of the MLP's down projections (`PER_TOKEN_ROLES`). Those carry token-specific outliers
(on SmolLM2-135M a few tokens reach 500 where the median channel is 7): one static scale sized
for them leaves the other tokens a handful of levels. Measured there on real text: static
everywhere +10% perplexity (after smoothing), per-token down projections +0.5%
(bench/precision_bench.py).

TensorRT 11.4 has no run-time int8 activation scales (its dynamic quantization makes FP8 and FP4
only), so for it those layers take another form (`OUTLIER_FORMS`, chosen by the caller):
"int8-weights" keeps their activations in float and their weights int8 per channel (TensorRT's
weight-only form: DequantizeLinear on the weight alone), "static" gives them static scales too.

SmoothQuant moves activation outlier channels into the weights before quantizing. Where x, read
only by these layers, can absorb a per-channel divisor s (a norm's output, the MLP's gate · up
product, attention's output: precision/folding.py), x is divided by s and W's rows multiplied by
it: the float function is unchanged. s_j = max|x_j|^a / max|W_j|^(1-a). The
strength a is chosen per activation from `ALPHAS`, by the error the quantized layers make on
sampled calibration rows; a = 0 (no smoothing) is always a candidate, so smoothing never makes a
layer's error worse than without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from llmc.formats.onnx_io import tensor_array
from llmc.errors import LlmcError
from llmc.precision.calibration import TensorStats, observe, threshold
from llmc.precision.folding import Graph
from llmc.precision.linears import Linear

ALPHAS = (0.0, 0.25, 0.5, 0.75, 0.9)
SAMPLE_ROWS = 512  # calibration rows kept per activation to choose the smoothing strength on
PER_TOKEN_ROLES = ("mlp.down",)
OUTLIER_FORMS = ("per-token", "static", "int8-weights")  # how PER_TOKEN_ROLES are quantized
PER_TOKEN_OPSET = 21  # blocked QuantizeLinear
CPU_BLOCK = 32  # MatMulNBits' block along K for per-token layers on onnxruntime


@dataclass
class ActivationGroup:
    """The linear layers reading one activation, and how it is quantized."""
    input: str
    layers: list[Linear]
    per_token: bool
    quantized: bool = True           # False: the activation stays float, only the weights are int8
    alpha: float = 0.0
    smoothing: np.ndarray | None = None
    threshold: float | None = None   # static scale's |x| limit; None for per-token
    error: float = 0.0               # relative output error on the sampled rows, summed over layers

    def summary(self) -> dict:
        scale = "per-token" if self.per_token else "static" if self.quantized else "float (int8 weights)"
        return {"layers": [l.name for l in self.layers], "scale": scale,
                "smoothquant_alpha": self.alpha, "threshold": self.threshold}


def quantize_int8(model: onnx.ModelProto, linears: list[Linear], windows: list[np.ndarray], calibrator: str,
                  *, smoothquant: float | None = None, dynamic: bool = False, outliers: str = "per-token",
                  progress: Callable[[str], None] = lambda message: None) -> list[ActivationGroup]:
    """Choose scales and write Q/DQ for `linears` in place; returns one entry per activation.

    Args:
        windows: calibration token windows; may be empty in the dynamic mode (no smoothing then).
        calibrator: the static thresholds' calibrator (precision/calibration.py).
        smoothquant: None searches `ALPHAS`; 0 turns smoothing off; a value in (0, 1) is the
            only strength tried besides 0.
        dynamic: per-token scales for every activation.
        outliers: the form of the layers in `PER_TOKEN_ROLES` when not dynamic (`OUTLIER_FORMS`).
    """
    groups = choose_scales(model, linears, windows, calibrator, smoothquant=smoothquant, dynamic=dynamic,
                           outliers=outliers, progress=progress)
    write_qdq(model, [l for g in groups for l in g.layers], {g.input: g.threshold for g in groups if g.quantized})
    return groups


def choose_scales(model: onnx.ModelProto, linears: list[Linear], windows: list[np.ndarray], calibrator: str,
                  *, smoothquant: float | None = None, dynamic: bool = False, outliers: str = "per-token",
                  progress: Callable[[str], None] = lambda message: None) -> list[ActivationGroup]:
    """Everything `quantize_int8` does but writing Q/DQ: smoothing is folded into `model` (the
    float function is unchanged) and each group gets its threshold (None: per token, or not
    quantized)."""
    if smoothquant is not None and not 0.0 <= smoothquant < 1.0:
        raise LlmcError(f"--smoothquant: alpha must be in [0, 1), got {smoothquant}")
    groups = activation_groups(linears, dynamic, outliers)
    if any(g.per_token for g in groups) and _opset(model) < PER_TOKEN_OPSET:
        raise LlmcError(f"per-token int8 needs opset {PER_TOKEN_OPSET}; this graph imports opset "
                        f"{_opset(model)} (compile at the default level, which fuses attention into opset 23)")
    if not windows:
        if any(g.quantized and not g.per_token for g in groups):
            raise LlmcError("static int8 needs calibration data: give --int8-calib DIR")
        return groups
    names = [g.input for g in groups]
    stats = observe(model, windows, names, histograms=False, sample_rows=SAMPLE_ROWS, progress=progress)
    alphas = ALPHAS if smoothquant is None else (0.0, smoothquant) if smoothquant else (0.0,)
    smoothed = choose_smoothing(model, groups, stats, alphas)
    progress(f"smoothquant: {smoothed} of {len(groups)} activations smoothed")
    if calibrator != "minmax" and any(g.quantized and not g.per_token for g in groups):  # histograms of the smoothed values
        stats = observe(model, windows, names, histograms=True, progress=progress)
    for g in groups:
        if g.quantized and not g.per_token:
            g.threshold = threshold(stats[g.input], calibrator)
    return groups


def activation_groups(linears: list[Linear], dynamic: bool, outliers: str = "per-token") -> list[ActivationGroup]:
    """Group `linears` by input, each with its activation scheme."""
    if outliers not in OUTLIER_FORMS:
        raise ValueError(f"outliers: {outliers!r} is not one of {OUTLIER_FORMS}")
    by_input: dict[str, list[Linear]] = {}
    for layer in linears:
        by_input.setdefault(layer.node.input[0], []).append(layer)
    groups = []
    for name, layers in by_input.items():
        outlier = any(l.name.endswith(PER_TOKEN_ROLES) for l in layers)
        groups.append(ActivationGroup(name, layers, per_token=dynamic or (outlier and outliers == "per-token"),
                                      quantized=dynamic or not outlier or outliers != "int8-weights"))
    return groups


def choose_smoothing(model: onnx.ModelProto, groups: list[ActivationGroup], stats: dict[str, TensorStats],
                     alphas: tuple[float, ...]) -> int:
    """Pick each group's smoothing strength by its sampled output error and fold it in place;
    returns how many activations were smoothed. The last layers go first, so that a fold into
    an earlier layer's weight columns (down into gate/up, o into q/k/v) lands before that layer's
    own group reads its weights."""
    graph = Graph(model)
    count = 0
    for g in reversed(groups):
        readers = graph.consumers.get(g.input, [])
        target = graph.fold_target(g.input) if len(readers) == len(g.layers) else None
        ws = [graph.array(l.node.input[1]) for l in g.layers]
        s = stats[g.input]
        x_max, rows = np.asarray(s.channel_absmax, np.float32), s.sample
        w_max = np.max([np.abs(w).max(axis=1) for w in ws], axis=0)
        if target is not None and target[1] is not None:  # channels that must share s share their statistics
            x_max, w_max = target[1](x_max), target[1](w_max)
        best = None
        exact = [rows @ w for w in ws]  # the float outputs: the same for every strength
        for alpha in (alphas if target is not None else (0.0,)):
            scale = smoothing_scale(x_max, w_max, alpha)
            limit = None if g.per_token or not g.quantized else float((s.channel_absmax / scale).max())
            error = output_error(rows, ws, scale, limit, quantize_activations=g.quantized, exact=exact)
            if best is None or error < best[0]:
                best = (error, alpha, scale)
        g.error, g.alpha = best[0], best[1]
        if g.alpha:
            g.smoothing = best[2]
            for layer in g.layers:
                graph.set_array(layer.node, 1, graph.array(layer.node.input[1]) * g.smoothing[:, None])
            target[0](1.0 / g.smoothing)
            stats[g.input].channel_absmax = s.channel_absmax / g.smoothing
            stats[g.input].absmax = float(stats[g.input].channel_absmax.max())
            count += 1
    _drop_unread(model)  # shared weights copied on write
    return count


def smoothing_scale(x_max: np.ndarray, w_max: np.ndarray, alpha: float) -> np.ndarray:
    if alpha == 0.0:
        return np.ones_like(x_max)
    s = np.power(np.maximum(x_max, 1e-5), alpha) / np.power(np.maximum(w_max, 1e-5), 1 - alpha)
    return np.clip(s, 1e-3, 1e3).astype(np.float32)


def output_error(rows: np.ndarray, weights: list[np.ndarray], smoothing: np.ndarray, limit: float | None,
                 quantize_activations: bool = True, exact: list[np.ndarray] | None = None) -> float:
    """Relative squared error of the quantized layers' outputs on `rows`, summed over the layers,
    with x divided by `smoothing` and W's rows multiplied by it; `limit` is the static |x|
    threshold, None for per-token scales; without `quantize_activations` only W is quantized.
    `exact`: each layer's float output `rows @ w`, when the caller has it."""
    x = rows / smoothing
    steps = (np.float32(limit) if limit is not None else np.abs(x).max(axis=1, keepdims=True)) / 127.0
    steps = np.maximum(steps, 1e-12)
    xq = np.clip(np.rint(x / steps), -127, 127) * steps if quantize_activations else x
    error = 0.0
    for index, w in enumerate(weights):
        wq = quantize_weight(w * smoothing[:, None])[0]
        want = rows @ w if exact is None else exact[index]
        error += float(np.sum((xq @ wq - want) ** 2) / max(np.sum(want ** 2), 1e-30))
    return error


def quantize_weight(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output channel symmetric int8: (dequantized weight, codes, scales)."""
    scale = (np.maximum(np.abs(weight).max(axis=0), 1e-8) / 127.0).astype(np.float32)
    codes = np.clip(np.rint(weight / scale), -127, 127).astype(np.int8)
    return codes.astype(np.float32) * scale, codes, scale


def write_qdq(model: onnx.ModelProto, linears: list[Linear], thresholds: dict[str, float | None]) -> None:
    """Insert the Q/DQ pairs (per tensor for a threshold, per token for None) and int8 weights; a
    layer whose input `thresholds` does not name keeps a float activation."""
    weights = {t.name: t for t in model.graph.initializer}
    added, nodes_before = [], {}
    rows = {l.node.input[0]: tensor_array(weights[l.node.input[1]]).shape[0] for l in linears}
    for name, limit in thresholds.items():
        prefix = f"{name}.int8"
        if limit is None:
            nodes_before[name] = _per_token_qdq(name, prefix, rows[name], added)
            continue
        scale = np.float32(max(limit, 1e-8) / 127.0)
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
        weight = layer.node.input[1]  # not layer.weight: smoothing may have given the layer its own copy
        _, codes, scale = quantize_weight(tensor_array(weights[weight]).astype(np.float32))
        prefix = f"{layer.name}.weight.int8"
        added += [numpy_helper.from_array(codes, f"{prefix}"),
                  numpy_helper.from_array(scale, f"{prefix}.scale"),
                  numpy_helper.from_array(np.zeros(len(scale), np.int8), f"{prefix}.zero_point")]
        dequantize.append(helper.make_node("DequantizeLinear", [prefix, f"{prefix}.scale", f"{prefix}.zero_point"],
                                           [f"{prefix}.dq"], name=f"{prefix}/Dequantize", axis=1))
        readers[weight] -= 1
        if readers[weight] == 0:
            drop.add(weight)
        if layer.node.input[0] in thresholds:
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


def _per_token_qdq(name: str, prefix: str, width: int, added: list) -> list[onnx.NodeProto]:
    """Nodes computing each row's scale (max|x| / 127, at least a tiny floor so an all-zero row
    stays zero) and the blocked Q/DQ pair over the last axis that uses it."""
    added += [numpy_helper.from_array(np.array([-1], np.int64), f"{prefix}.axes"),
              numpy_helper.from_array(np.array(1.0 / 127.0, np.float32), f"{prefix}.inv127"),
              numpy_helper.from_array(np.array(1e-12, np.float32), f"{prefix}.floor")]
    blocked = dict(axis=-1, block_size=width)
    return [
        helper.make_node("Abs", [name], [f"{prefix}.abs"], name=f"{prefix}/Abs"),
        helper.make_node("ReduceMax", [f"{prefix}.abs", f"{prefix}.axes"], [f"{prefix}.max"], name=f"{prefix}/RowMax",
                         keepdims=1),
        helper.make_node("Mul", [f"{prefix}.max", f"{prefix}.inv127"], [f"{prefix}.step"], name=f"{prefix}/Step"),
        helper.make_node("Max", [f"{prefix}.step", f"{prefix}.floor"], [f"{prefix}.scale"], name=f"{prefix}/Floor"),
        helper.make_node("QuantizeLinear", [name, f"{prefix}.scale"], [f"{prefix}.q"], name=f"{prefix}/Quantize",
                         output_dtype=onnx.TensorProto.INT8, **blocked),
        helper.make_node("DequantizeLinear", [f"{prefix}.q", f"{prefix}.scale"], [f"{prefix}.dq"],
                         name=f"{prefix}/Dequantize", **blocked)]


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def lower_per_token_for_onnxruntime(model: onnx.ModelProto) -> int:
    """Rewrite each per-token int8 linear (the Q/DQ form above) as onnxruntime's MatMulNBits with
    8-bit weights; returns how many. onnxruntime does not fuse a runtime-scaled Q/DQ pair into an
    int8 product: it would dequantize the whole weight every step (SmolLM2 decoded at 0.3× fp32).
    MatMulNBits at accuracy level 4 quantizes its input to int8 on the fly per block of
    `CPU_BLOCK` along K, finer than per token, and its per-block scales hold each column's int8
    scale exactly, so the weights are the Q/DQ form's, code for code."""
    from llmc.passes import contrib_ops  # the backend's op set, only for this lowering

    weights = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    lowered = 0
    for node in model.graph.node:
        if node.op_type != "MatMul" or not node.input[0].endswith(".int8.dq"):
            continue
        x = node.input[0][:-len(".int8.dq")]
        quantize = producer.get(f"{x}.int8.q")
        weight_dq = producer.get(node.input[1])
        if (quantize is None or quantize.input[1] in weights or weight_dq is None
                or weight_dq.op_type != "DequantizeLinear" or weight_dq.input[0] not in weights):
            continue  # a static pair: onnxruntime fuses it into an int8 product itself
        codes = tensor_array(weights[weight_dq.input[0]]).astype(np.int16)  # [K, N]
        scale = tensor_array(weights[weight_dq.input[1]]).astype(np.float32)  # [N]
        k, n = codes.shape
        blocks = -(-k // CPU_BLOCK)
        padded = np.zeros((blocks * CPU_BLOCK, n), np.int16)
        padded[:k] = codes
        stored = (padded.T.reshape(n, blocks, CPU_BLOCK) + 128).astype(np.uint8)  # the op's zero point is 128
        prefix = f"{node.name or node.output[0]}.int8_per_token"
        model.graph.initializer.extend([numpy_helper.from_array(stored, f"{prefix}.B"),
                                        numpy_helper.from_array(np.repeat(scale, blocks), f"{prefix}.scales")])
        node.op_type, node.domain = "MatMulNBits", contrib_ops.DOMAIN
        # The quantizer's input, not x itself: under --fp16, x may be computed in fp16 and cast
        # to fp32 for the quantizer, and MatMulNBits' scales are fp32.
        node.input[:] = [quantize.input[0], f"{prefix}.B", f"{prefix}.scales"]
        node.attribute.extend([helper.make_attribute("K", k), helper.make_attribute("N", n),
                               helper.make_attribute("bits", 8), helper.make_attribute("block_size", CPU_BLOCK),
                               helper.make_attribute("accuracy_level", 4)])
        lowered += 1
    if lowered:
        contrib_ops.register()
        if not any(o.domain == contrib_ops.DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(contrib_ops.DOMAIN, 1))
        _drop_unread(model)
    return lowered


def _drop_unread(model: onnx.ModelProto) -> None:
    """Remove nodes whose outputs nobody reads and initializers nobody reads, until none is left."""
    outputs = {o.name for o in model.graph.output}
    while True:
        read = {i for n in model.graph.node for i in n.input} | outputs
        dead = [n for n in model.graph.node if not any(o in read for o in n.output)]
        for n in dead:
            model.graph.node.remove(n)
        if not dead:
            break
    read = {i for n in model.graph.node for i in n.input}
    for t in [t for t in model.graph.initializer if t.name not in read]:
        model.graph.initializer.remove(t)
