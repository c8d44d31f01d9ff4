"""Draft tokens for speculative decoding, looked up in the sequence's own tokens.

Prompt-lookup decoding: text often repeats what came before it (a summary quotes its source, code
edits copy code, an answer repeats names, a stuck model loops), so the tokens that followed the
latest earlier occurrence of the sequence's last n tokens are a cheap guess of what comes next.
The engine runs the guess as extra tokens of the sequence's step and keeps the longest prefix that
greedy decoding would have produced anyway (engine.py), so outputs do not change; a decode step
reads every weight once however many tokens it holds, so each accepted guess is a token almost
for free. No draft model, nothing to train.

Beside other sequences a guess is not free: a step of many decodes is bound by compute as much as
by reading the weights, so each extra token costs about what it would in a prompt. A request
there guesses only as far as its guesses are likely to be kept (`likely`).
"""

from __future__ import annotations

# n-gram lengths looked up, longest first. A single token's last occurrence guesses poorly on
# real text, and a rejected draft makes its step dearer: on 12 real-text prompts to SmolLM2-135M
# fp32 (4 guesses a step), n-grams of 3 down to 1 made 1,858 guesses for 638 kept, 3 down to 2
# made 1,026 for 579, at the same decode rate.
MAX_NGRAM, MIN_NGRAM = 3, 2
# Beside other sequences, the least chance of being kept at which a guess pays. Measured on the
# 25M Llama fp32 (steps of 4-64 sequences 192 positions in, 2 threads): an extra token costs a
# step 0.16-0.23 ms, against 0.26-0.68 ms of the step for each sequence's token: a break-even of
# a third (4-16 sequences) to two thirds (64).
KEEP_CHANCE = 0.5
# How much a request's record of guesses counts one step later: a request whose text stops (or
# starts) repeating itself is judged by its last ten or so steps.
RECORD_DECAY = 0.9


class PromptLookup:
    """The n-grams of one sequence, indexed as it grows.

    Args:
        tokens: the sequence's tokens (prompt then output), a list the caller grows in place.
    """

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram → where the token after its latest occurrence is
        self._indexed = 0  # n-grams followed by a token before this position are in _latest
        # Guesses kept, and guesses tried (those up to and including the first turned down), decayed.
        self._kept = self._tried = 0.0

    def record(self, guessed: int, kept: int) -> None:
        """A step ran `guessed` guesses and kept the first `kept`."""
        self._kept += kept
        self._tried += kept + (kept < guessed)

    def likely(self, limit: int) -> list[int]:
        """The draft for a step beside other sequences: the first of up to `limit` guesses that
        are each at least KEEP_CHANCE likely to be kept, by the request's record (a guess is kept
        only if the ones before it were, so the n-th is kept with the record's rate to the n-th
        power; a request with no record yet counts as one guess tried and kept). Called once a
        step, which ages the record."""
        self._kept *= RECORD_DECAY
        self._tried *= RECORD_DECAY
        chance = (self._kept + 1) / (self._tried + 1)
        count = 0
        while count < limit and chance ** (count + 1) >= KEEP_CHANCE:
            count += 1
        return self.propose(count)

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that may come next (none when the last n tokens never occurred
        before). Where the occurrence runs into the sequence's end, the draft continues from its
        own start, as a loop would."""
        tokens = self.tokens
        end = len(tokens)
        if limit < 1:
            return []
        for position in range(self._indexed + 1, end):  # n-grams with a token after them
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if position >= n:
                    self._latest[tuple(tokens[position - n:position])] = position
        self._indexed = max(self._indexed, end - 1)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            follows = self._latest.get(tuple(tokens[end - n:])) if end >= n else None
            if follows is not None:
                draft: list[int] = []
                for i in range(limit):
                    at = follows + i
                    draft.append(tokens[at] if at < end else draft[at - end])
                return draft
        return []
