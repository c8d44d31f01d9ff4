"""`llmc sensitivity`: which linear layers suffer most from quantization, and which to spare.

Ranking: every layer is quantized and each layer's added error is measured in one run against
the fp32 graph (its output's relative error minus its input's: precision/gate.py). With
`exhaustive`, each linear layer is instead quantized alone (the rest stays fp32) and the graph's
next-token distributions on the evaluation windows are compared with fp32's: the mean KL
divergence ranks the layers; one evaluation per layer, so minutes per hundred layers on a small
model. With an accuracy budget, every layer is quantized, and the most sensitive ones go
back to fp32 one at a time until the perplexity increase is within the budget; the result is a
mixed-precision file for `llmc compile --precision-config`.

int8 and int8-dynamic quantize as `llmc compile` does (precision/int8.py): smoothing and scales
are chosen once, on the fp32 graph, so they do not depend on which other layers are quantized;
lm_head gets int8 weights only, by compile's rule (precision/plan.py). int4 is plain rounding
here: compile's activation-aware scaling (precision/awq.py) searches for minutes per trial.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx

from llmc.formats.onnx_io import serialize
from llmc.formats.sessions import open_session, session_options
from llmc.errors import LlmcError
from llmc.precision.calibration import prefill_feeds
from llmc.precision.check import kl_divergence
from llmc.precision.gate import added_errors
from llmc.precision.int8 import choose_scales, write_qdq
from llmc.precision.linears import linear_layers
from llmc.precision.weight_only import DEFAULT_BLOCK_SIZE, quantize_weights
from llmc.runtime.logprobs import log_softmax

TARGETS = ("int8", "int8-dynamic", "int8-weights", "int4")


@dataclass(frozen=True)
class Sensitivity:
    ranking: list[tuple[str, float]]        # (layer, its added error, or with `exhaustive` the mean KL
                                            # when only it is quantized), worst first
    kept_fp32: list[str]                    # layers spared to meet the budget (empty without one)
    ppl_fp32: float
    ppl_quantized: float                    # with every layer but `kept_fp32` quantized
    ppl_increase_pct: float
    config: dict                            # the mixed-precision file
    seconds: float                          # how long the analysis took


class _Evaluator:
    def __init__(self, windows: list[np.ndarray]):
        self.windows = windows

    def log_probs(self, model: onnx.ModelProto) -> list[np.ndarray]:
        options = session_options(alone=True)
        session = open_session(serialize(model), options)
        out = []
        for w in self.windows:
            out.append(log_softmax(session.run(["logits"], prefill_feeds(session, w))[0][0, :-1]))
        return out

    def perplexity(self, log_probs: list[np.ndarray]) -> float:
        nll = [-lp[np.arange(len(w) - 1), w[1:]] for lp, w in zip(log_probs, self.windows)]
        return float(np.exp(np.concatenate(nll).mean()))


def analyze(model: onnx.ModelProto, target: str, calibration: list[np.ndarray], evaluation: list[np.ndarray], *,
            calibrator: str = "minmax", budget_pct: float | None = None, exhaustive: bool = False,
            progress: Callable[[str], None] = lambda message: None) -> Sensitivity:
    """Rank the linear layers of an optimized (level-2) graph; see the module docstring."""
    if target not in TARGETS:
        raise LlmcError(f"--precision: '{target}' is not one of {', '.join(TARGETS)}")
    began = time.perf_counter()
    linears = linear_layers(model)
    if not linears:
        raise LlmcError("sensitivity: the graph has no linear layer (MatMul by a weight)")
    base, thresholds = model, {}
    if target.startswith("int8") and target != "int8-weights":
        base = copy.deepcopy(model)  # smoothing folds into it; its float function stays the model's
        activations = [l for l in linear_layers(base) if l.name != "lm_head"]
        groups = choose_scales(base, activations, calibration, calibrator, dynamic=target == "int8-dynamic",
                               progress=progress)
        thresholds = {g.input: g.threshold for g in groups}
    evaluator = _Evaluator(evaluation)
    reference = evaluator.log_probs(model)
    ppl_fp32 = evaluator.perplexity(reference)

    def quantized(names: set[str]) -> onnx.ModelProto:
        trial = copy.deepcopy(base)
        chosen = [l for l in linear_layers(trial) if l.name in names]
        activations = [l for l in chosen if l.node.input[0] in thresholds]
        if activations:
            write_qdq(trial, activations, {l.node.input[0]: thresholds[l.node.input[0]] for l in activations})
        weight_only = [l for l in chosen if l.node.input[0] not in thresholds]
        for bits in (4, 8):  # lm_head under int4: int8 weights, compile's rule
            nodes = {id(l.node) for l in weight_only
                     if bits == (4 if target == "int4" and l.name != "lm_head" else 8)}
            if nodes:
                quantize_weights(trial, bits, DEFAULT_BLOCK_SIZE, select=lambda n: id(n) in nodes)
        return trial

    everything = [l.name for l in linears]
    if exhaustive:
        scores = []
        for index, layer in enumerate(linears):
            progress(f"sensitivity: {layer.name} ({index + 1}/{len(linears)})")
            trial = evaluator.log_probs(quantized({layer.name}))
            kl = np.mean([kl_divergence(r, t).mean() for r, t in zip(reference, trial)])
            scores.append((layer.name, float(kl)))
        ranking = sorted(scores, key=lambda item: -item[1])
    else:
        progress(f"sensitivity: each layer's added error, all {len(linears)} quantized")
        values = {l.name: (l.node.input[0], l.node.output[0]) for l in linear_layers(base)}
        ranking = added_errors(serialize(base)["model.onnx"], quantized(set(everything)), evaluation[:2], values)

    spared_by_rank = [name for name, _ in ranking]
    ppls = {0: evaluator.perplexity(evaluator.log_probs(quantized(set(everything))))}

    def within(spared: int) -> bool:  # the `spared` most sensitive layers back in fp32
        if spared not in ppls:
            progress(f"budget: {len(everything) - spared} of {len(everything)} layers quantized")
            ppls[spared] = evaluator.perplexity(evaluator.log_probs(quantized(set(spared_by_rank[spared:]))))
        return 100.0 * (ppls[spared] / ppl_fp32 - 1.0) <= budget_pct

    spared = 0
    if budget_pct is not None and not within(0):
        # Fewest spared layers that meet the budget, by bisection over the ranking (the error
        # falls as layers are spared worst first; every layer spared is fp32, within any budget).
        low, high = 0, len(ranking)
        ppls[high] = ppl_fp32
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if within(middle) else (middle, high)
        spared = high
    kept = spared_by_rank[:spared]
    ppl = ppls[spared]
    config = {"default": target, "rules": dict.fromkeys(kept, "fp32")}
    return Sensitivity(ranking, kept, ppl_fp32, ppl, 100.0 * (ppl / ppl_fp32 - 1.0), config,
                       time.perf_counter() - began)
