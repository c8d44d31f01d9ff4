"""`llmc check`: how far an engine's outputs are from a reference ONNX model's, on real text.

Both run every window of the held-out data from scratch (no cache), and the report compares
their next-token distributions position by position:

    perplexity           exp(mean negative log-likelihood of the actual next token), each model
    ppl_increase_pct     100 · (engine / reference − 1)
    top1_agreement       fraction of positions where both predict the same most likely token
    mean_kl              mean KL(reference ‖ engine) of the next-token distributions, nats
    logit_cosine         mean cosine similarity of the logit vectors
    first_divergence     the first generated token where greedy generation (from the first
                         window's opening tokens) differs, or None within `generate` tokens

The reference is the graph the engine was compiled from (or any decoder-with-past graph with
the same vocabulary); it runs in onnxruntime with an empty past, unoptimized.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnxruntime as ort

from llmc.formats.decoder_interface import recognize_decoder
from llmc.formats.onnx_io import load_onnx
from llmc.formats.sessions import session_options
from llmc.errors import LlmcError
from llmc.precision.calibration import prefill_feeds
from llmc.precision.data import read_documents, windows
from llmc.runtime.logprobs import log_softmax, row_sums


@dataclass(frozen=True)
class AccuracyReport:
    tokens: int                 # positions compared (predictions made)
    windows: int
    reference_ppl: float
    engine_ppl: float
    ppl_increase_pct: float
    top1_agreement: float
    mean_kl: float
    logit_cosine: float
    first_divergence: int | None
    generated: int              # greedy tokens compared

    def to_dict(self) -> dict:
        return asdict(self)


class ReferenceModel:
    """A decoder-with-past ONNX file run from scratch: logits at every position of one sequence."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None):
        model = load_onnx(path, load_weights=False)  # the session reads the weights
        self.interface = recognize_decoder(model, Path(path))
        options = session_options(threads, optimize=False, alone=True)
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.vocab_size = self.interface.geometry.vocab_size

    def logits(self, token_ids: np.ndarray) -> np.ndarray:
        return self.session.run(["logits"], prefill_feeds(self.session, token_ids))[0][0].astype(np.float32)


def check(engine, reference: ReferenceModel, data: str | os.PathLike, *, window: int = 256,
          max_tokens: int = 4096, generate: int = 32,
          progress: Callable[[str], None] = lambda message: None) -> AccuracyReport:
    """Compare `engine` (an `LLM`) with `reference` on the documents in `data`.

    Args:
        engine: the engine under test.
        reference: the reference model.
        data: folder of held-out text or token arrays (precision/data.py).
        window: tokens per window (capped by both models' positions).
        max_tokens: tokens read from the data at most.
        generate: greedy tokens compared for `first_divergence`.
    """
    vocab = engine.manifest.geometry.vocab_size
    if reference.vocab_size != vocab:
        raise LlmcError(f"--reference: vocabulary {reference.vocab_size} differs from the engine's {vocab}")
    if window < 2 or max_tokens < 2:
        raise LlmcError("--window and --max-tokens must be at least 2")
    length = min(window, engine.max_seq_len, reference.interface.geometry.max_positions)
    pieces = windows(read_documents(data, engine.tokenizer, vocab), length, max_tokens)
    if not pieces:
        raise LlmcError(f"--data: {data} holds no document of 2 tokens or more")
    nll_ref, nll_eng, agree, kl, cosine = [], [], [], [], []
    for index, piece in enumerate(pieces):
        progress(f"window {index + 1}/{len(pieces)} ({len(piece)} tokens)")
        ref_logits, eng_logits = reference.logits(piece)[:-1], engine.logits(piece)[:-1]
        for total, part in zip((nll_ref, nll_eng, agree, kl),
                               position_metrics(log_softmax(ref_logits), log_softmax(eng_logits), piece[1:])):
            total.append(part)
        cosine.append((ref_logits * eng_logits).sum(-1)
                      / (np.linalg.norm(ref_logits, axis=-1) * np.linalg.norm(eng_logits, axis=-1) + 1e-12))
    progress(f"greedy generation, {generate} tokens each")
    prompt = pieces[0][:min(16, len(pieces[0]))]
    divergence = _first_divergence(engine, reference, prompt, generate, length)
    ppl_ref = float(np.exp(np.concatenate(nll_ref).mean()))
    ppl_eng = float(np.exp(np.concatenate(nll_eng).mean()))
    return AccuracyReport(
        tokens=int(sum(len(p) - 1 for p in pieces)), windows=len(pieces), reference_ppl=ppl_ref,
        engine_ppl=ppl_eng, ppl_increase_pct=100.0 * (ppl_eng / ppl_ref - 1.0),
        top1_agreement=float(np.concatenate(agree).mean()), mean_kl=float(np.concatenate(kl).mean()),
        logit_cosine=float(np.concatenate(cosine).mean()), first_divergence=divergence, generated=generate)


def _first_divergence(engine, reference: ReferenceModel, prompt: np.ndarray, count: int, limit: int) -> int | None:
    """Greedy continuation by recomputation from `prompt` with both; the index of the first
    differing token, or None."""
    ref_ids, eng_ids = list(prompt), list(prompt)
    for step in range(min(count, limit - len(prompt))):
        ref_ids.append(int(reference.logits(np.array(ref_ids))[-1].argmax()))
        eng_ids.append(int(engine.logits(np.array(eng_ids))[-1].argmax()))
        if ref_ids[-1] != eng_ids[-1]:
            return step
    return None


def position_metrics(reference: np.ndarray, candidate: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per position, from log-probabilities: each model's negative log-likelihood of the target,
    whether their most likely tokens agree, and KL(reference ‖ candidate)."""
    rows = np.arange(len(targets))
    return (-reference[rows, targets], -candidate[rows, targets], reference.argmax(-1) == candidate.argmax(-1),
            kl_divergence(reference, candidate))


def kl_divergence(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """KL(reference ‖ candidate) per row, from log-probabilities."""
    return row_sums(lambda ref, cand: np.exp(ref) * (ref - cand), reference, candidate)
