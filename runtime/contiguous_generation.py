"""Reference generation through the decoder's past/present tensors (a contiguous KV cache).

All prompts run as one left-padded batch: a prefill of the whole batch, then one decode step per
new token. This is the simple, obviously-correct path that later runtimes must match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterator, Sequence

import numpy as np

from llmc.runtime.backends.onnxruntime import OnnxRuntimeDecoder
from llmc.runtime.sampler import sample
from llmc.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of request `index`; `finish_reason` is set on its last token."""

    index: int
    token_id: int
    finish_reason: str | None  # "stop" (EOS or a stop token), "length" (token or position limit)


def generate_tokens(decoder: OnnxRuntimeDecoder, prompts: Sequence[Sequence[int]],
                    params: Sequence[SamplingParams], eos_ids: Collection[int]) -> Iterator[TokenEvent]:
    """Generate for a batch of tokenized prompts, yielding tokens as they are produced.

    Args:
        decoder: the backend running one step of the graph.
        prompts: token ids per request, each non-empty and shorter than the model's positions.
        params: sampling settings per request.
        eos_ids: the tokenizer's end-of-sequence ids (any of them ends a request).
    """
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    input_ids = np.zeros((batch, width), np.int64)
    mask = np.zeros((batch, width), np.int64)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    rngs = [np.random.default_rng(p.seed) for p in params]
    budgets = [min(p.max_new_tokens, decoder.geometry.max_positions - len(prompt))
               for p, prompt in zip(params, prompts)]
    generated = [0] * batch
    outputs: list[list[int]] = [[] for _ in prompts]
    running = set(range(batch))
    cache = decoder.empty_cache(batch)

    while running:
        # Padding positions get position 0; they are masked out and never attended to.
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -input_ids.shape[1]:]
        logits, cache = decoder.step(input_ids, mask, positions, cache)
        next_ids = np.zeros((batch, 1), np.int64)
        for row in sorted(running):
            token = sample(logits[row, -1], params[row], rngs[row], prompts[row], outputs[row])
            outputs[row].append(token)
            next_ids[row, 0] = token
            generated[row] += 1
            reason = finish_reason(token, generated[row], budgets[row], params[row], eos_ids)
            if reason:
                running.discard(row)
            yield TokenEvent(row, token, reason)
        input_ids = next_ids
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)


def finish_reason(token: int, generated: int, budget: int, params: SamplingParams,
                   eos_ids: Collection[int]) -> str | None:
    if token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos):
        return "stop"
    if generated >= budget:
        return "length"
    return None
