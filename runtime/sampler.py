"""Choosing the next token from logits: a pure function of logits, settings and a generator."""

from __future__ import annotations

import numpy as np

from llmc.runtime.sampling_params import SamplingParams


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Pick one token id from a row of logits.

    Args:
        logits: [vocab] scores for the next token.
        params: the request's settings; temperature 0 is greedy.
        rng: the request's own generator, so its draws do not depend on other requests.
    """
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
    return int(rng.choice(probs.size, p=probs))
