"""The accuracy gate of `llmc compile`: no quantized engine is written silently worse than asked.

A quarter of the calibration windows (every `HOLD_BACK`-th) is held back from calibration. After
the precision rewrite, the rewritten graph and the float graph it came from both run on those
windows in onnxruntime, and their next-token distributions are compared as `llmc check` does
(perplexity increase, top-1 agreement, mean KL). Past `max_ppl_increase` percent the compile
stops with one line naming the layers that add the most error, unless forced.

Held-back data shares the calibration data's domain, so it cannot show calibration that is
narrower than the traffic (another language, only code). The engine is also measured on a short
general text shipped with llmc (`GENERAL_TEXT`: prose and Python); past the limit there while the
held-back data passes, the compile warns that the calibration data may be too narrow.

A layer's added error is measured on the first held-back window: the relative error of its output
(rewritten graph against float graph) minus that of its input, so error carried in from the layers
above is not counted again (`added_errors`, which `llmc sensitivity` ranks layers by too).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from llmc.formats.onnx_io import serialize
from llmc.formats.sessions import open_session, session_options
from llmc.errors import LlmcError
from llmc.precision.calibration import prefill_feeds
from llmc.precision.check import position_metrics
from llmc.precision.data import windows
from llmc.runtime.logprobs import log_softmax

DEFAULT_MAX_PPL_INCREASE = 3.0  # percent
HOLD_BACK = 4                   # every 4th calibration window is held back
MIN_HELD_TOKENS = 256
FP16_MAX = 65504.0
GENERAL_TEXT = Path(__file__).resolve().parent / "text" / "general.txt"


@dataclass(frozen=True)
class GateReport:
    tokens: int
    reference_ppl: float
    engine_ppl: float
    ppl_increase_pct: float
    top1_agreement: float
    mean_kl: float
    max_ppl_increase: float
    passed: bool
    forced: bool
    general_text_ppl_increase_pct: float | None  # on GENERAL_TEXT, when a tokenizer was given

    def to_dict(self) -> dict:
        return asdict(self)


def split(windows: list[np.ndarray], what: str, *, required: bool = True) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(calibration, held back); refuses data too small to hold enough back, unless the check is
    not `required` (then nothing is held back)."""
    held = windows[HOLD_BACK - 1::HOLD_BACK]
    tokens = sum(len(w) for w in held)
    if tokens < MIN_HELD_TOKENS and not required:
        return windows, []
    if tokens < MIN_HELD_TOKENS:
        raise LlmcError(f"{what}: {sum(len(w) for w in windows)} tokens of data; the accuracy check holds back "
                        f"every {HOLD_BACK}th window and needs {MIN_HELD_TOKENS} tokens there: give more text "
                        f"(at least {HOLD_BACK * MIN_HELD_TOKENS} tokens) or --force to skip the check")
    kept = [w for i, w in enumerate(windows) if i % HOLD_BACK != HOLD_BACK - 1]
    return kept, held


def general_text_windows(tokenizer, vocab_size: int, max_positions: int) -> list[np.ndarray]:
    """`GENERAL_TEXT` cut into windows like the calibration data's (tokens past the vocabulary,
    which a model with a smaller one than its tokenizer cannot take, leave it out)."""
    ids = np.asarray(tokenizer.encode(GENERAL_TEXT.read_text(encoding="utf-8")), np.int64)
    if not ids.size or ids.max() >= vocab_size:
        return []
    return windows([ids], min(256, max_positions), 1024)


def check_accuracy(reference: bytes, model: onnx.ModelProto, held: list[np.ndarray],
                   layers: dict[str, tuple[str, str]], *, max_ppl_increase: float, force: bool,
                   half: frozenset[str] = frozenset(), general_windows: list[np.ndarray] = (),
                   float_weight_products: bool = False,
                   progress: Callable[[str], None] = lambda message: None) -> GateReport:
    """Compare `model` (after the precision rewrite) with the float graph `reference` (its
    serialized bytes) on the held-back windows; raise past the limit unless `force`.

    Args:
        layers: the rewritten linear layers, name → (input value, output value).
        general_windows: `GENERAL_TEXT` in the model's tokens (see the module docstring).
        half: the values `model` computes in fp16: those the float graph takes beyond fp16's range
            are named. onnxruntime's CPU kernels often compute them in fp32 anyway, so the engine
            may pass here and still overflow on a GPU: a warning when it passes.
        float_weight_products: weight-only layers multiply float activations (TensorRT's
            arithmetic), not int8-rounded ones (onnxruntime's MatMulNBits).
    """
    overflow = _overflow_hint(reference, held[0], half) if half else None
    float_session = _session(reference, optimized=False)
    quantized = _session(serialize(model)["model.onnx"], optimized=True, float_weight_products=float_weight_products)
    tokens, (ppl_ref, ppl, increase), top1, kl = _compare(float_session, quantized, held, overflow)
    general = _compare(float_session, quantized, general_windows, overflow)[1][2] if len(general_windows) else None
    report = GateReport(tokens, ppl_ref, ppl, increase, top1, kl, max_ppl_increase, increase <= max_ppl_increase,
                        force and increase > max_ppl_increase, general)
    progress(f"accuracy on {tokens} held-back tokens: perplexity {increase:+.2f}% (limit {max_ppl_increase:g}%), "
             f"top-1 agreement {top1:.3f}" + (f"; on llmc's general text {general:+.2f}%" if general is not None else ""))
    if not report.passed:
        cause = overflow or "layers adding the most error: " + ", ".join(
            f"{name} ({error:.1%})" for name, error in added_errors(reference, model, held[:1], layers)[:3])
        message = (f"accuracy: perplexity {increase:+.1f}% on {report.tokens} held-back calibration tokens exceeds "
                   f"--max-ppl-increase {max_ppl_increase:g}%; {cause}")
        if not force:
            raise LlmcError(f"{message} (keep them in higher precision with --precision-config, "
                            f"or --force to write the engine anyway)")
        progress(f"warning: {message}; written anyway (--force)")
    elif overflow:
        progress(f"warning: {overflow}")
    if report.passed and general is not None and general > max_ppl_increase:
        progress(f"warning: on llmc's general text (prose and Python) perplexity rises {general:+.1f}%, past "
                 f"{max_ppl_increase:g}%, while the held-back calibration data passes: the calibration data may be "
                 f"narrower than your traffic; calibrate on text like it and confirm with `llmc check --data`")
    return report


def _compare(float_session, quantized, windows: list[np.ndarray], overflow: str | None):
    """(tokens, (reference ppl, engine ppl, increase %), top-1 agreement, mean KL) over `windows`."""
    nll_ref, nll_q, agree, kl = [], [], [], []
    for window in windows:
        ref = log_softmax(float_session.run(["logits"], prefill_feeds(float_session, window))[0][0, :-1])
        logits = quantized.run(["logits"], prefill_feeds(quantized, window))[0][0, :-1]
        if not np.isfinite(logits).all():
            raise LlmcError(f"accuracy: the engine's logits are not finite on held-back text"
                            f"{'; ' + overflow if overflow else ''}")
        for total, part in zip((nll_ref, nll_q, agree, kl), position_metrics(ref, log_softmax(logits), window[1:])):
            total.append(part)
    ppl_ref, ppl_q = float(np.exp(np.concatenate(nll_ref).mean())), float(np.exp(np.concatenate(nll_q).mean()))
    return (int(sum(len(w) - 1 for w in windows)), (ppl_ref, ppl_q, 100.0 * (ppl_q / ppl_ref - 1.0)),
            float(np.concatenate(agree).mean()), float(np.concatenate(kl).mean()))


def added_errors(reference: bytes, model: onnx.ModelProto, windows: list[np.ndarray],
                 layers: dict[str, tuple[str, str]]) -> list[tuple[str, float]]:
    """Each layer's output error minus its input error (relative L2, the float graph as truth),
    largest first. Errors are taken after the best per-channel rescaling: SmoothQuant and AWQ
    divide a layer's input, and fold the divisor into another layer's output columns, by a
    per-channel scale, which is not an error."""
    values = sorted({v for pair in layers.values() for v in pair})
    rewritten = serialize(model)["model.onnx"]
    runs = [(_run_with_outputs(reference, values, w), _run_with_outputs(rewritten, values, w)) for w in windows]

    def error(name: str) -> float:
        exact = np.concatenate([f[name].reshape(-1, f[name].shape[-1]) for f, _ in runs]).astype(np.float64)
        got = np.concatenate([q[name].reshape(-1, q[name].shape[-1]) for _, q in runs]).astype(np.float64)
        exact = exact * ((exact * got).sum(0) / np.maximum((exact * exact).sum(0), 1e-30))  # · c, least squares
        return float(np.linalg.norm(got - exact) / max(np.linalg.norm(exact), 1e-30))

    added = [(name, error(out) - error(inp)) for name, (inp, out) in layers.items()]
    return sorted(added, key=lambda item: -item[1])


def _run_with_outputs(model_bytes: bytes, names: list[str], window: np.ndarray) -> dict[str, np.ndarray]:
    probe = onnx.load_from_string(model_bytes)
    known = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in known)  # any type
    session = _session(probe.SerializeToString(), optimized=False)
    return dict(zip(names, session.run(names, prefill_feeds(session, window))))


def _overflow_hint(reference: bytes, window: np.ndarray, half: frozenset[str]) -> str | None:
    """Which of the `half` values exceed fp16's range in the float graph, and what to do; None
    when none does. Fill values (float32's lowest, as in attention masks) saturate, not overflow."""
    model = onnx.load_from_string(reference)
    names = [o for n in model.graph.node for o in n.output if o in half]
    values = _run_with_outputs(reference, names, window)
    over = [(name, top) for name, v in values.items() if v.size
            for top in [float(np.abs(v[np.abs(v) < 1e38]).max(initial=0.0))] if top > FP16_MAX]
    if not over:
        return None
    named = ", ".join(f"{name} reaches {top:.3g}" for name, top in over[:3])
    return (f"activations overflow fp16 ({named}; fp16 holds up to {FP16_MAX:g}): compile without --fp16, "
            f"or keep the layers computing them in fp32 with a --precision-config rule")


def _session(model_bytes: bytes, *, optimized: bool, float_weight_products: bool = False) -> ort.InferenceSession:
    # Unoptimized keeps every value name, as the reference of `llmc check` does.
    return open_session({"model.onnx": model_bytes},
                        session_options(optimize=optimized, alone=True, float_weight_products=float_weight_products))
