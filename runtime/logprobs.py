"""Log-probabilities of tokens under a model's logits: what `llmc check`, the engine's `logprobs`
and `prompt_logprobs`, and the server's OpenAI answers report.

Every figure is the model's own distribution, the log-softmax of its logits in float64: before the
temperature, top-k/top-p and penalties a request samples with (OpenAI's and vLLM's convention;
an evaluation scores the model, not the sampler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
# Rows whose float64 log-softmax is held at once: a prompt chunk's every row at a 150k vocabulary
# would take 600 MB at 512 rows; 32 keep it under 40 MB.
ROWS_AT_ONCE = 32
# Rows exponentiated at once: temporaries of 16 rows (6 MB at a 49k vocabulary) instead of
# arrays as large as the logits, each a fresh allocation. On a 255 x 49152 window (`llmc check`,
# the accuracy gate) the log-softmax took 0.07 s instead of 0.3-0.4 s, with the same result bit
# for bit: each row is reduced alone either way.
EXP_ROWS = 16


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the `top` most likely tokens at its position (id,
    log-probability), most likely first; ties in id order."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64."""
    out = np.array(logits, dtype=np.float64)
    out -= out.max(-1, keepdims=True)
    out -= np.log(row_sums(np.exp, out))[..., None]
    return out


def row_sums(function, *arrays: np.ndarray) -> np.ndarray:
    """`function(*arrays).sum(-1)` for arrays of one shape, computed `EXP_ROWS` rows at a time."""
    shape = arrays[0].shape
    rows = [a.reshape(-1, shape[-1]) for a in arrays]
    sums = np.empty(len(rows[0]))
    for begin in range(0, len(sums), EXP_ROWS):
        sums[begin:begin + EXP_ROWS] = function(*(r[begin:begin + EXP_ROWS] for r in rows)).sum(-1)
    return sums.reshape(shape[:-1])


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """For each row of [rows, vocab] `logits`, the log-probability of that row's token in
    `tokens`, with the `top` most likely tokens."""
    logits = np.asarray(logits).reshape(len(tokens), -1)
    out = []
    for begin in range(0, len(tokens), ROWS_AT_ONCE):
        rows = log_softmax(logits[begin:begin + ROWS_AT_ONCE])
        for row, token in zip(rows, tokens[begin:begin + ROWS_AT_ONCE]):
            best: tuple[tuple[int, float], ...] = ()
            if top:
                candidates = np.argpartition(-row, top - 1)[:top] if top < row.size else np.arange(row.size)
                order = sorted(candidates.tolist(), key=lambda t: (-row[t], t))
                best = tuple((t, float(row[t])) for t in order)
            out.append(TokenLogprob(int(token), float(row[token]), best))
    return out
