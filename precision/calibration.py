"""Activation ranges for static int8: run the float graph on calibration text and pick, per
tensor, the largest magnitude int8 must represent.

Calibrators (all symmetric, as TensorRT's int8 Q/DQ requires):

    minmax      the largest |x| seen
    percentile  the PERCENTILE-th percentile of |x| (outliers clipped)
    entropy     TensorRT's method: the clipping threshold whose 128-level quantization of the
                |x| histogram loses the least information (smallest KL divergence)

Two passes over the data: the first finds each tensor's largest |x| (and, for SmoothQuant, each
channel's); the second, for percentile and entropy, fills a histogram of |x| on [0, that max].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from llmc.formats.onnx_io import is_large, serialize
from llmc.formats.sessions import open_session, session_options
from llmc.errors import LlmcError

CALIBRATORS = ("minmax", "percentile", "entropy")
# Tokens of calibration data each calibrator needs at least: a percentile of 99.99% needs
# 10,000 samples per tensor; a 2,048-bin histogram needs many more to be smooth.
MIN_TOKENS = {"minmax": 16, "percentile": 128, "entropy": 512}
PERCENTILE = 99.99
BINS = 2048
LEVELS = 128  # int8 magnitudes 0..127


@dataclass
class TensorStats:
    absmax: float = 0.0
    channel_absmax: np.ndarray | None = None  # per last-axis channel
    channel_abssum: np.ndarray | None = None  # per channel, over `rows` rows: mean |x| = abssum / rows
    rows: int = 0
    samples: list[np.ndarray] = field(default_factory=list)  # rows kept to measure quantization error on
    histogram: np.ndarray = field(default_factory=lambda: np.zeros(BINS, np.int64))

    @property
    def channel_absmean(self) -> np.ndarray | None:
        return None if self.channel_abssum is None else self.channel_abssum / max(self.rows, 1)

    @property
    def sample(self) -> np.ndarray | None:
        """The kept rows as one [rows, channels] float32 array, or None."""
        return np.concatenate(self.samples) if self.samples else None


def check_calibrator(calibrator: str, tokens: int | None = None) -> None:
    """Refuse an unknown calibrator, or too little data for it (before any long work)."""
    if calibrator not in CALIBRATORS:
        raise LlmcError(f"--calibrator: '{calibrator}' is not one of {', '.join(CALIBRATORS)}")
    if tokens is not None and tokens < MIN_TOKENS[calibrator]:
        raise LlmcError(f"--int8-calib: {tokens} tokens of calibration data; the {calibrator} calibrator "
                        f"needs at least {MIN_TOKENS[calibrator]}")


def observe(model: onnx.ModelProto, windows: list[np.ndarray], names: list[str], *, histograms: bool,
            sample_rows: int = 0,
            progress: Callable[[str], None] = lambda message: None) -> dict[str, TensorStats]:
    """Statistics of the named float tensors over every window (one sequence each, empty past);
    with `sample_rows`, about that many rows (token positions) of each tensor are kept, spread
    evenly over the windows (a seeded choice, so a compile is reproducible)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    options = session_options(optimize=False, alone=True)  # keep every name
    if is_large(probe):
        raise LlmcError("--int8-calib: models past 2 GB are not calibrated yet")
    session = open_session(serialize(probe), options)
    stats = {n: TensorStats() for n in names}
    progress(f"calibration: ranges over {len(windows)} windows")
    rng = np.random.default_rng(0)
    per_window = -(-sample_rows // max(len(windows), 1))
    for window in windows:
        picked = None
        for name, value in zip(names, session.run(names, prefill_feeds(session, window))):
            rows = value.reshape(-1, value.shape[-1])
            s, magnitude = stats[name], np.abs(rows)
            s.absmax = max(s.absmax, float(magnitude.max(initial=0.0)))
            channels, total = magnitude.max(axis=0), magnitude.sum(axis=0, dtype=np.float64)
            s.channel_absmax = channels if s.channel_absmax is None else np.maximum(s.channel_absmax, channels)
            s.channel_abssum = total if s.channel_abssum is None else s.channel_abssum + total
            s.rows += len(rows)
            if per_window:
                if picked is None:
                    picked = np.sort(rng.choice(len(rows), min(per_window, len(rows)), replace=False))
                s.samples.append(rows[picked].astype(np.float32))
    if histograms:
        progress(f"calibration: histograms over {len(windows)} windows")
        for window in windows:
            for name, value in zip(names, session.run(names, prefill_feeds(session, window))):
                s = stats[name]
                s.histogram += np.histogram(np.abs(value), bins=BINS, range=(0.0, max(s.absmax, 1e-12)))[0]
    return stats


def threshold(stats: TensorStats, calibrator: str) -> float:
    """The |x| that maps to int8's 127 for this tensor."""
    if calibrator == "minmax" or stats.absmax == 0.0:
        return stats.absmax
    width = stats.absmax / BINS
    if calibrator == "percentile":
        cumulative = np.cumsum(stats.histogram) / max(stats.histogram.sum(), 1)
        return float((np.searchsorted(cumulative, PERCENTILE / 100.0) + 1) * width)
    return float((entropy_bins(stats.histogram) + 0.5) * width)


def entropy_bins(histogram: np.ndarray) -> int:
    """Number of histogram bins to keep below the threshold, by minimal KL divergence between
    the clipped distribution and its LEVELS-level quantization (TensorRT's entropy calibration)."""
    hist = histogram.astype(np.float64)
    best, best_kl = len(hist), np.inf
    for keep in range(LEVELS, len(hist) + 1, 16):
        reference = hist[:keep].copy()
        reference[-1] += hist[keep:].sum()  # what is clipped lands in the last bin
        # Merge `keep` bins into LEVELS levels, then spread each level over its non-empty bins.
        edges = np.linspace(0, keep, LEVELS + 1).astype(int)
        candidate = np.zeros(keep)
        for lo, hi in zip(edges[:-1], edges[1:]):
            chunk = hist[lo:hi]
            nonzero = chunk > 0
            if nonzero.any():
                candidate[lo:hi][nonzero] = chunk.sum() / nonzero.sum()
        p, q = reference / max(reference.sum(), 1), candidate / max(candidate.sum(), 1)
        mask = p > 0
        kl = float(np.sum(p[mask] * np.log(p[mask] / np.maximum(q[mask], 1e-12))))
        if kl < best_kl:
            best, best_kl = keep, kl
    return best


def prefill_feeds(session: ort.InferenceSession, token_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Inputs of a decoder-with-past session for one sequence computed from scratch."""
    ids = np.asarray(token_ids, np.int64)[None]
    feeds = {}
    for value in session.get_inputs():
        if value.name == "input_ids":
            feeds[value.name] = ids
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones_like(ids)
        elif value.name == "position_ids":
            feeds[value.name] = np.arange(ids.shape[1])[None]
        else:  # an empty past: [1, kv_heads, 0, head_dim]
            shape = [1 if i == 0 else 0 if i == 2 else d for i, d in enumerate(value.shape)]
            feeds[value.name] = np.zeros(shape, np.float16 if "float16" in value.type else np.float32)
    return feeds
