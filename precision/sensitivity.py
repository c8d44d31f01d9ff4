"""`llmc sensitivity`: which linear layers suffer most from quantization, and which to spare.

Each linear layer is quantized alone (the rest stays fp32) and the graph's next-token
distributions on the evaluation windows are compared with fp32's: the mean KL divergence ranks
the layers. With an accuracy budget, every layer is quantized, and the most sensitive ones go
back to fp32 one at a time until the perplexity increase is within the budget; the result is a
mixed-precision file for `llmc compile --precision-config`.

int8 uses one calibration of every layer's input (the ranges do not depend on which other layers
are quantized: activations are calibrated on the fp32 graph).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort

from llmc.compiler.onnx_io import serialize
from llmc.errors import LlmcError
from llmc.precision.calibration import observe, prefill_feeds, threshold
from llmc.precision.check import kl_divergence, log_softmax
from llmc.precision.int8 import write_qdq
from llmc.precision.linears import linear_layers
from llmc.precision.weight_only import DEFAULT_BLOCK_SIZE, quantize_weights

TARGETS = ("int8", "int8-weights", "int4")


@dataclass(frozen=True)
class Sensitivity:
    ranking: list[tuple[str, float]]        # (layer, mean KL when only it is quantized), worst first
    kept_fp32: list[str]                    # layers spared to meet the budget (empty without one)
    ppl_fp32: float
    ppl_quantized: float                    # with every layer but `kept_fp32` quantized
    ppl_increase_pct: float
    config: dict                            # the mixed-precision file


class _Evaluator:
    def __init__(self, windows: list[np.ndarray]):
        self.windows = windows

    def log_probs(self, model: onnx.ModelProto) -> list[np.ndarray]:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(serialize(model)["model.onnx"], options, providers=["CPUExecutionProvider"])
        out = []
        for w in self.windows:
            out.append(log_softmax(session.run(["logits"], prefill_feeds(session, w))[0][0, :-1]))
        return out

    def perplexity(self, log_probs: list[np.ndarray]) -> float:
        nll = [-lp[np.arange(len(w) - 1), w[1:]] for lp, w in zip(log_probs, self.windows)]
        return float(np.exp(np.concatenate(nll).mean()))


def analyze(model: onnx.ModelProto, target: str, calibration: list[np.ndarray], evaluation: list[np.ndarray], *,
            calibrator: str = "minmax", budget_pct: float | None = None,
            progress: Callable[[str], None] = lambda message: None) -> Sensitivity:
    """Rank the linear layers of an optimized (level-2) graph; see the module docstring."""
    if target not in TARGETS:
        raise LlmcError(f"--precision: '{target}' is not one of {', '.join(TARGETS)}")
    linears = linear_layers(model)
    if not linears:
        raise LlmcError("sensitivity: the graph has no linear layer (MatMul by a weight)")
    thresholds = {}
    if target == "int8":
        inputs = sorted({l.node.input[0] for l in linears})
        stats = observe(model, calibration, inputs, histograms=calibrator != "minmax", progress=progress)
        thresholds = {name: threshold(stats[name], calibrator) for name in inputs}
    evaluator = _Evaluator(evaluation)
    reference = evaluator.log_probs(model)
    ppl_fp32 = evaluator.perplexity(reference)

    def quantized(names: set[str]) -> onnx.ModelProto:
        trial = copy.deepcopy(model)
        chosen = [l for l in linear_layers(trial) if l.name in names]
        if target == "int8":
            write_qdq(trial, chosen, {l.node.input[0]: thresholds[l.node.input[0]] for l in chosen})
        else:
            ids = {id(l.node) for l in chosen}
            quantize_weights(trial, 4 if target == "int4" else 8, DEFAULT_BLOCK_SIZE, select=lambda n: id(n) in ids)
        return trial

    scores = []
    for index, layer in enumerate(linears):
        progress(f"sensitivity: {layer.name} ({index + 1}/{len(linears)})")
        trial = evaluator.log_probs(quantized({layer.name}))
        kl = np.mean([kl_divergence(r, t).mean() for r, t in zip(reference, trial)])
        scores.append((layer.name, float(kl)))
    ranking = sorted(scores, key=lambda item: -item[1])

    kept: list[str] = []
    everything = {l.name for l in linears}
    ppl = evaluator.perplexity(evaluator.log_probs(quantized(everything)))
    if budget_pct is not None:
        for name, _ in ranking:
            if 100.0 * (ppl / ppl_fp32 - 1.0) <= budget_pct:
                break
            kept.append(name)
            progress(f"budget: {name} back to fp32")
            ppl = evaluator.perplexity(evaluator.log_probs(quantized(everything - set(kept))))
    config = {"default": target, "rules": dict.fromkeys(kept, "fp32")}
    return Sensitivity(ranking, kept, ppl_fp32, ppl, 100.0 * (ppl / ppl_fp32 - 1.0), config)

