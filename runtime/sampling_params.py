"""Per-request sampling settings, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmc.errors import LlmcError
from llmc.runtime.logprobs import MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Args:
        max_new_tokens: tokens to generate at most (≥ 1).
        temperature: 0 picks the most likely token (greedy); larger values flatten the distribution.
        top_k: sample only among the k most likely tokens; 0 disables.
        top_p: sample only from the smallest set of tokens whose probability reaches p (0 < p ≤ 1).
        min_p: drop tokens whose probability is below min_p × the top token's (0 disables).
        repetition_penalty: divide positive (multiply negative) logits of tokens already in the
            prompt or output by this (Hugging Face's rule; 1 disables).
        presence_penalty: subtract this from the logits of tokens already generated (OpenAI's
            rule; 0 disables, negative encourages repeats).
        seed: makes sampling reproducible per request; None draws fresh entropy.
        stop_token_ids: extra token ids that end the completion (the tokenizer's EOS always does).
        stop: strings that end the completion when they appear in its text (excluded from it).
        ignore_eos: keep generating past EOS (benchmarks that need fixed output lengths).
        logprobs: report each generated token's log-probability and this many most likely
            alternatives at its position (runtime/logprobs.py); None reports none.
        prompt_logprobs: the same for every prompt token after the first, computed in the
            prompt's prefill (the request then skips the prefix cache: a cached token has no
            logits); None reports none.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise LlmcError(f"max_new_tokens must be an integer ≥ 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise LlmcError(f"temperature must be ≥ 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise LlmcError(f"top_k must be an integer ≥ 0 (0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise LlmcError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise LlmcError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            raise LlmcError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not -2 <= self.presence_penalty <= 2:
            raise LlmcError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise LlmcError(f"seed must be a non-negative integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise LlmcError(f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {value!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise LlmcError(f"stop strings must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
