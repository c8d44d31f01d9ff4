"""IncrementalText: deltas add up to the full decode, cut at the first stop string, at bounded cost."""

from __future__ import annotations

import functools
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models
import tokenizers

from llmc.runtime import detokenizer
from llmc.runtime.detokenizer import IncrementalText
from llmc.tokenizer import Tokenizer, byte_level_tokenizer
from smollm2 import smollm2_folder

REPO = Path(__file__).resolve().parents[2]
BYTES = byte_level_tokenizer()
LLAMA = Tokenizer.from_folder(REPO / "data" / "pystdlib-llama")
PROMPT = "def f(x):\n    return x"
# Text that UTF-8 can carry (no lone surrogates), without U+FFFD, which stands for a partial character.
CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd")


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    try:
        return Tokenizer.from_folder(smollm2_folder())
    except RuntimeError as exc:  # the package registry unreachable
        pytest.skip(str(exc))


def reference(tok: Tokenizer, ids: list[int], stop: list[str]) -> tuple[str, int | None]:
    """What the engine emitted before IncrementalText: the whole output decoded at every token,
    cut at the first stop string. Returns the final text and the index of the stopping token."""
    for i in range(len(ids)):
        text = tok.decode(ids[:i + 1])
        found = [at for at in (text.find(s) for s in stop) if at >= 0]
        if found:
            return text[:min(found)], i
    text = tok.decode(ids)
    if text.endswith("\ufffd") and not text.endswith("\ufffd\ufffd"):
        text = text[:-1]  # cut inside a character: dropped, not shown as a replacement character
    return text, None


def run(tok: Tokenizer, prompt: list[int], ids: list[int], stop: list[str]) -> tuple[list[str], int | None, str]:
    """Feed ids until a stop; returns the deltas, the stopping index and the flushed tail."""
    inc = IncrementalText(tok, prompt, stop)
    final = reference(tok, ids, stop)[0]
    deltas = []
    for i, token in enumerate(ids):
        delta, stopped = inc.add(token)
        deltas.append(delta)
        assert final.startswith("".join(deltas))  # nothing emitted is ever taken back
        if stopped:
            assert inc.flush() == ""
            assert inc.text == final
            return deltas, i, ""
    tail = inc.flush()
    assert inc.text == "".join(deltas) + tail
    return deltas, None, tail


def check_against_reference(tok, prompt, ids, stop):
    deltas, stopped_at, tail = run(tok, prompt, ids, stop)
    expected, expected_stop = reference(tok, ids, stop)
    assert "".join(deltas) + tail == expected
    assert stopped_at == expected_stop
    return deltas


@st.composite
def stop_strings(draw, text: str) -> list[str]:
    """Stop strings: pieces of the text (so that they occur) and short random strings."""
    stops = []
    for _ in range(draw(st.integers(0, 3))):
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start:start + draw(st.integers(1, 4))])
        else:
            stops.append(draw(st.text(CHARS, min_size=1, max_size=3)))
    # A stop string holding U+FFFD would match a character still arriving; none is meant to.
    return [s for s in stops if "\ufffd" not in s]


def no_forced_emission():
    """Random ids can hold back more than _MAX_HELD tokens of invalid bytes, where emitting them
    anyway may cut a character; the random-id properties check exactness below that bound."""
    return mock.patch.object(detokenizer, "_MAX_HELD", 10**9)


@settings(max_examples=1000, deadline=None)
@given(data=st.data(), ids=st.lists(st.integers(0, BYTES.vocab_size - 1), max_size=40))
def test_random_bytes_and_specials_match_the_full_decode(data, ids):
    stop = data.draw(stop_strings(BYTES.decode(ids)))
    with no_forced_emission():
        check_against_reference(BYTES, BYTES.encode(PROMPT), ids, stop)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), text=st.text(CHARS, max_size=30))
def test_valid_text_never_emits_a_partial_character(data, text):
    ids = BYTES.encode(text)[1:]  # without BOS: an output, not a prompt
    stop = data.draw(stop_strings(text))
    deltas = check_against_reference(BYTES, BYTES.encode(PROMPT), ids, stop)
    assert not any(d.endswith("\ufffd") for d in deltas)


@settings(max_examples=500, deadline=None)
@given(data=st.data(), ids=st.lists(st.integers(0, LLAMA.vocab_size - 1), max_size=30))
def test_random_bpe_tokens_match_the_full_decode(data, ids):
    stop = data.draw(stop_strings(LLAMA.decode(ids)))
    with no_forced_emission():
        check_against_reference(LLAMA, LLAMA.encode(PROMPT), ids, stop)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_smollm2_tokens_match_the_full_decode(data):
    tok = smollm2_tokenizer()
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    stop = data.draw(stop_strings(tok.decode(ids)))
    with no_forced_emission():
        check_against_reference(tok, tok.encode(PROMPT), ids, stop)


def test_a_character_split_across_tokens_is_emitted_when_complete():
    ids = BYTES.encode("a日😀")[1:]  # one token per byte: 1 + 3 + 4
    inc = IncrementalText(BYTES, BYTES.encode(PROMPT))
    assert [inc.add(t) for t in ids] == [("a", False), ("", False), ("", False), ("日", False),
                                         ("", False), ("", False), ("", False), ("😀", False)]
    assert inc.flush() == ""


def test_flush_emits_a_partial_stop_string_and_drops_a_partial_character():
    inc = IncrementalText(BYTES, stop=["STOP"])
    assert [inc.add(t)[0] for t in BYTES.encode("abST")[1:]] == ["a", "b", "", ""]
    assert inc.flush() == "ST"
    inc = IncrementalText(BYTES)
    assert inc.add(BYTES.encode("x")[1])[0] == "x"
    assert inc.add(BYTES.encode("é")[1])[0] == ""  # the first of its two bytes
    assert inc.flush() == ""  # cut inside a character: dropped, never a replacement character
    assert inc.text == "x"


def test_stop_string_is_cut_and_reported_at_its_token():
    ids = BYTES.encode("say hi. STOP, then more")[1:]
    inc = IncrementalText(BYTES, stop=["xyz", "STOP", "hi!"])
    out = [inc.add(t) for t in ids[:12]]
    assert [d for d, _ in out] == ["s", "a", "y", " ", "", "", "hi.", " ", "", "", "", ""]
    assert [s for _, s in out] == [False] * 11 + [True]  # at the P of STOP
    assert inc.text == "say hi. "
    assert inc.add(ids[12]) == ("", True)


def test_a_stop_string_before_a_character_still_arriving_stops_at_once():
    # A BPE token "bÃ" = "b" + the first byte of "é": the stop "ab" is complete at that token,
    # though its text ends inside a character.
    symbols = [chr(c) for c in range(ord("a"), ord("c"))] + ["Ã", "©"]
    vocab = {s: i for i, s in enumerate(symbols)} | {"bÃ": len(symbols)}
    inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("b", "Ã")]))
    inner.decoder = decoders.ByteLevel()
    tok = Tokenizer(inner)
    ids = [vocab["a"], vocab["bÃ"], vocab["©"]]
    assert tok.decode(ids) == "abé"
    assert check_against_reference(tok, [], ids, ["ab"]) == ["", ""]
    assert check_against_reference(tok, [], ids, ["bé"]) == ["a", "", ""]


def test_the_first_token_keeps_the_space_that_continues_the_prompt():
    # SentencePiece's decoder drops the leading space of a text; decoded after the prompt's last
    # tokens, the first output token keeps it.
    inner = tokenizers.Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    inner.decoder = decoders.Metaspace()
    tok = Tokenizer(inner)
    assert tok.decode([1]) == "world"
    inc = IncrementalText(tok, [0])
    assert [inc.add(1), inc.add(1)] == [(" world", False), (" world", False)]


def test_work_per_token_does_not_grow_with_the_output():
    text = "".join(f"def f{i}(x):\n    return x * {i}  # 数 {i} 😀 é\n" for i in range(2000))
    ids = LLAMA.encode(text)[:4000]
    assert len(ids) == 4000
    lengths = []
    decode = LLAMA.decode
    tok = Tokenizer.from_json(LLAMA.to_json())
    tok.decode = lambda window: lengths.append(len(window)) or decode(window)
    inc = IncrementalText(tok, LLAMA.encode(PROMPT), stop=["never appears", "nor this"])
    deltas = [inc.add(t)[0] for t in ids]
    assert "".join(deltas) + inc.flush() == LLAMA.decode(ids)
    assert max(lengths) <= 8  # the emitted window plus a character's few held-back tokens
    assert len(lengths) <= 2 * len(ids) + 2


def test_a_run_of_invalid_bytes_is_emitted_after_max_held_tokens():
    ids = [0x80] * 100  # lone continuation bytes: never a character
    lengths = []
    tok = byte_level_tokenizer()
    tok.decode = lambda window: lengths.append(len(window)) or BYTES.decode(window)
    inc = IncrementalText(tok)
    assert "".join(inc.add(t)[0] for t in ids) + inc.flush() == "\ufffd" * 100
    assert max(lengths) <= 2 * detokenizer._MAX_HELD + 2
