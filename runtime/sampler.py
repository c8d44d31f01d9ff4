"""Choosing the next token from logits: a pure function of logits, settings, history and a generator."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from llmc.runtime.sampling_params import SamplingParams


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           prompt: Sequence[int] = (), output: Sequence[int] = ()) -> int:
    """Pick one token id from a row of logits.

    Args:
        logits: [vocab] scores for the next token.
        params: the request's settings; temperature 0 is greedy (after penalties).
        rng: the request's own generator, so its draws do not depend on other requests.
        prompt: the request's prompt tokens (for the repetition penalty).
        output: the tokens it generated so far (repetition and presence penalties).
    """
    logits = penalized(logits, params, prompt, output)
    if params.greedy:
        return int(np.argmax(logits))
    scores = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scores.size:
        kth = np.partition(scores, -params.top_k)[-params.top_k]
        scores = np.where(scores >= kth, scores, -np.inf)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # Keep every token up to and including the one that brings the mass to top_p.
        keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    if params.min_p > 0:
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


def is_argmax(params: SamplingParams) -> bool:
    """Whether `sample` picks the row's largest logit for these settings (greedy, no penalty):
    a step then takes all such rows' tokens in one pass over its logits."""
    return params.greedy and not _penalizes(params)


def _penalizes(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.presence_penalty != 0


def penalized(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int],
              output: Sequence[int]) -> np.ndarray:
    """Logits after the repetition and presence penalties (unchanged when both are off)."""
    if not _penalizes(params):
        return logits
    logits = logits.astype(np.float64)
    if params.repetition_penalty != 1:
        seen = np.unique(np.concatenate([np.asarray(prompt, np.int64), np.asarray(output, np.int64)]))
        logits[seen] = np.where(logits[seen] > 0, logits[seen] / params.repetition_penalty,
                                logits[seen] * params.repetition_penalty)
    if params.presence_penalty and len(output):
        logits[np.unique(np.asarray(output, np.int64))] -= params.presence_penalty
    return logits
