"""`llmc serve`'s log-probabilities as evaluation tools read them, on the model trained on the
standard library (data/pystdlib-llama), fp32, against transformers on the same checkpoint:

- completions with `echo` and `logprobs`, one prompt and a batch, streamed and not;
- a multiple-choice evaluation run the way lm-evaluation-harness's `local-completions` runs one
  (a batch of tokenized context + continuation prompts, `echo`, `max_tokens` 1, `logprobs` 1,
  the continuation's summed `token_logprobs`) and the way a string-prompt tool does (`max_tokens`
  0, the continuation found by `text_offset`), each agreeing with the same scoring done in-process.
"""

import inspect
import json

import httpx
import numpy as np
import pytest

from llmc.runtime.engine import Engine
from llmc.server import ServerOptions, create_app

pytest.importorskip("uvicorn")

from test_server import running  # noqa: E402

MODEL = "pystdlib"
ATOL = 2e-4  # per token: fp32 engine against fp32 PyTorch
CHOICES = 4


@pytest.fixture(scope="module")
def served(trained_engine):
    engine = Engine(trained_engine)
    with running(create_app(engine, ServerOptions(model_name=MODEL))) as url:
        yield url, engine


def complete(url: str, **body) -> dict:
    answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_echo_and_logprobs_equal_transformers_streamed_or_not(served, trained_log_probs):
    url, engine = served
    text = inspect.getsource(json.encoder)[:600]
    ids = engine.tokenizer.encode(text)
    whole = complete(url, prompt=text, echo=True, logprobs=3, max_tokens=6, temperature=0)["choices"][0]
    logprobs = whole["logprobs"]
    assert whole["text"].startswith(text) and len(logprobs["tokens"]) == len(ids) + 6
    rows = trained_log_probs(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    want = rows[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(logprobs["token_logprobs"][1:len(ids)], want, atol=ATOL, rtol=0)
    for row, top in zip(rows[:len(ids) - 1], logprobs["top_logprobs"][1:len(ids)]):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(row.max(), abs=ATOL)
    # the offsets walk the echoed text token by token
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    # greedy: the first generated token is the most likely one after the prompt
    assert logprobs["token_logprobs"][len(ids)] == pytest.approx(rows[-1].max(), abs=ATOL)
    # streamed: the prompt comes first, then the same tokens and figures
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": text, "echo": True, "logprobs": 3, "max_tokens": 6, "temperature": 0,
            "stream": True}) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                lines.append(json.loads(line[6:])["choices"][0])
    assert lines[0]["text"] == text and "".join(c["text"] for c in lines) == whole["text"]
    streamed = [lp for c in lines for lp in c["logprobs"]["token_logprobs"]]
    assert streamed[0] is None
    np.testing.assert_allclose(streamed[1:], logprobs["token_logprobs"][1:], atol=1e-6, rtol=0)
    assert [o for c in lines for o in c["logprobs"]["text_offset"]] == logprobs["text_offset"]


def multiple_choice_set(engine: Engine, items: int = 12) -> list[tuple[list[int], list[list[int]], int]]:
    """(context ids, continuation ids of each choice, the right one) from standard-library source:
    the context is a few lines, the right continuation the next line, the others lines from
    elsewhere in the same module. Seeded, so the set is the same every run."""
    rng = np.random.default_rng(7)
    lines = [line for line in inspect.getsource(json.decoder).splitlines() if len(line.strip()) > 12]
    out = []
    for _ in range(items):
        at = int(rng.integers(3, len(lines) - 1))
        others = rng.choice([i for i in range(len(lines)) if lines[i] != lines[at]], CHOICES - 1, replace=False)
        choices = [lines[at], *(lines[i] for i in others)]
        order = rng.permutation(CHOICES)
        context = engine.tokenizer.encode("\n".join(lines[at - 3:at]) + "\n")
        continuations = [engine.tokenizer.inner.encode(choices[i], add_special_tokens=False).ids for i in order]
        out.append((context, continuations, int(np.argmax(order == 0))))
    return out


def test_multiple_choice_scores_over_http_agree_with_transformers(served, trained_log_probs):
    url, engine = served
    items = multiple_choice_set(engine)
    in_process = [[trained_log_probs(ctx + cont)[np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1), cont].sum()
                   for cont in conts] for ctx, conts, _ in items]
    # lm-evaluation-harness's local-completions: token-id prompts in a batch, max_tokens 1
    prompts = [ctx + cont for ctx, conts, _ in items for cont in conts]
    answer = complete(url, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert [c["index"] for c in answer["choices"]] == list(range(len(prompts)))
    harness, at = [], 0
    for ctx, conts, _ in items:
        row = []
        for cont in conts:
            token_logprobs = answer["choices"][at]["logprobs"]["token_logprobs"]
            assert len(token_logprobs) == len(ctx) + len(cont) + 1  # the generated token last
            row.append(sum(token_logprobs[len(ctx):-1]))
            at += 1
        harness.append(row)
    # a tool with string prompts: max_tokens 0, the continuation's tokens found by text_offset;
    # in process, the same string tokenized with its offsets
    strings, strings_in_process = [], []
    for ctx, conts, _ in items[:4]:
        context_text = engine.tokenizer.decode(ctx)
        row, row_in_process = [], []
        for cont in conts:
            text = context_text + engine.tokenizer.decode(cont)
            choice = complete(url, prompt=text, echo=True, logprobs=0, max_tokens=0)["choices"][0]
            assert choice["finish_reason"] == "length" and choice["text"] == text
            offsets, token_logprobs = choice["logprobs"]["text_offset"], choice["logprobs"]["token_logprobs"]
            row.append(sum(lp for o, lp in zip(offsets, token_logprobs) if o >= len(context_text)))
            ids, encoded = engine.tokenizer.encode(text), engine.tokenizer.inner.encode(text, add_special_tokens=False)
            bos = len(ids) - len(encoded.ids)  # a BOS the engine puts first, where the model has one
            rows = trained_log_probs(ids)
            row_in_process.append(sum(rows[i - 1, ids[i]] for i in range(max(1, bos), len(ids))
                                      if encoded.offsets[i - bos][0] >= len(context_text)))
        strings.append(row)
        strings_in_process.append(row_in_process)
    in_process, harness = np.array(in_process), np.array(harness)
    np.testing.assert_allclose(harness, in_process, atol=ATOL * 40, rtol=0)
    assert (harness.argmax(1) == in_process.argmax(1)).all()
    np.testing.assert_allclose(strings, strings_in_process, atol=ATOL * 40, rtol=0)
    right = np.mean(in_process.argmax(1) == [answer for _, _, answer in items])
    assert right > 1 / CHOICES, f"accuracy {right}: the set does not tell the model's knowledge apart"
