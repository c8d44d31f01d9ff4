"""Incremental detokenization: a request's new text per token, cut at stop strings, in O(1) per token.

Decoding. Decoding every token alone loses what depends on its neighbours (a multi-byte character
split across tokens, a SentencePiece decoder dropping the first token's leading space), and
decoding the whole output every token costs O(length) per token. As vLLM does, `IncrementalText`
decodes a short window instead: `prefix` tokens already emitted (for context) followed by the
tokens not yet emitted, and emits the window's text beyond the prefix's text. The window starts
on the prompt's last tokens, so the first output token decodes as the continuation of the prompt.
Text ending in U+FFFD (a character whose bytes have not all arrived) is held back until it
completes; then the emitted tokens become the next prefix. For byte-level tokenizers the emitted
text equals `tokenizer.decode(output_ids)`; a decoder that strips the leading space of the text
(SentencePiece's Metaspace) keeps the space of the first output token, which continues the prompt.

Stop strings. Text that could be the start of a stop string is never emitted: the longest tail
of the text that is a proper prefix of some stop string is held back, so every occurrence begins
in the held-back tail or later, and one search of the tail plus the new text finds it. The
search also covers the held-back part of a character still arriving (up to its first U+FFFD),
so `add` reports the stop at the very token whose text first contains the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmc.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the first output token, for its leading space (vLLM uses 5).
_PROMPT_CONTEXT = 5
# Tokens held back (text ending in U+FFFD, or no text) before they are emitted anyway: a real
# character is at most 4 bytes, so only a run of invalid bytes or of skipped special tokens gets
# here, and this bounds the work per token.
_MAX_HELD = 16


class IncrementalText:
    """Turns one request's output tokens into text deltas, one token at a time.

    Args:
        tokenizer: the model's tokenizer; its `decode` (which skips special tokens) is the only
            call made.
        prompt_ids: the prompt's token ids; only the last few are decoded, as context.
        stop: strings that end the text (each excluded from it, as is everything after it).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 stop: Sequence[str] = ()) -> None:
        self._decode = tokenizer.decode
        self._stop = tuple(stop)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        # The window: ids[:read] were emitted and decode to `prefix` (context only); ids[read:]
        # are held back.
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix = self._decode(self._ids)
        if self._prefix.endswith("\ufffd"):
            # Prompt ids that end inside a character: the window would not split cleanly there.
            self._ids, self._prefix = [], ""
        self._read = len(self._ids)
        self._pending = ""  # decoded, not emitted: could be the start of a stop string
        self._parts: list[str] = []
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has appeared; later tokens add nothing."""
        return self._stopped

    @property
    def text(self) -> str:
        """All text emitted so far (joined on each call: O(length))."""
        return "".join(self._parts)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Take the next output token.

        Args:
            token_id: the token just generated.
        Returns:
            (delta, stopped): the text this token completes, and whether a stop string appeared,
            in which case delta ends just before it and the request is finished.
        """
        if self._stopped:
            return "", True
        self._ids.append(token_id)
        window = self._decode(self._ids)
        new = window[len(self._prefix):]
        if (new and not new.endswith("\ufffd")) or len(self._ids) - self._read > _MAX_HELD:
            settled, tentative = new, ""
            # The emitted tokens become the next window's context.
            del self._ids[:self._read]
            self._read = len(self._ids)
            self._prefix = self._decode(self._ids)
        else:
            # Text before the last character still arriving cannot change any more, so a stop
            # string in it is found now, though it is emitted only once the character completes.
            settled, tentative = "", new.rstrip("\ufffd")
        return self._cut(settled, tentative)

    def flush(self) -> str:
        """Emit everything held back, at the end of a request not ended by a stop string: a tail
        that was the start of a stop string. A last character whose bytes never all came (one
        U+FFFD at the very end: the output was cut inside it) is dropped, not shown as a
        replacement character; a run of invalid bytes still shows as one U+FFFD each."""
        if self._stopped:
            return ""
        window = self._decode(self._ids)
        delta = self._pending + window[len(self._prefix):]
        before = next((part[-1] for part in reversed(self._parts) if part), "")  # the last character emitted
        if delta.endswith("\ufffd") and not (delta[:-1] or before).endswith("\ufffd"):
            delta = delta[:-1]
        self._pending, self._ids, self._read, self._prefix = "", [], 0, ""
        self._parts.append(delta)
        return delta

    def _cut(self, settled: str, tentative: str) -> tuple[str, bool]:
        """Emit settled text up to a stop string, or up to a tail that may begin one."""
        text = self._pending + settled
        if not self._stop:
            self._pending = ""
            self._parts.append(text)
            return text, False
        searched = text + tentative
        found = [at for at in (searched.find(s) for s in self._stop) if at >= 0]
        if found:
            delta = searched[:min(found)]
            self._stopped, self._pending = True, ""
            self._parts.append(delta)
            return delta, True
        keep = self._stop_prefix_length(text)
        delta, self._pending = text[:len(text) - keep], text[len(text) - keep:]
        self._parts.append(delta)
        return delta, False

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
