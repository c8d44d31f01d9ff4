"""Log-probabilities from the engine (`SamplingParams.logprobs`, `prompt_logprobs`) against
transformers' log-softmax on the same tokens, on the model trained on the standard library
(data/pystdlib-llama), fp32: prompts in one chunk and in several, a request preempted in its
prefill, the prefix cache, sampled and speculated tokens, and a step shared with other requests."""

import inspect
import json

import numpy as np
import pytest

from llmc.errors import LlmcError
from llmc.formats.engine_file import read_engine
from llmc.formats.manifest import kv_block_bytes
from llmc.runtime.engine import Engine
from llmc.runtime.logprobs import token_logprobs
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import SchedulerConfig


# fp32 engine against fp32 PyTorch: the same sums in another order (measured ~1e-5).
ATOL = 2e-4
TOP = 5


@pytest.fixture(scope="module")
def text_ids(trained_engine):
    """Standard-library source the model was trained on, as the engine's token ids."""
    tokenizer = Engine(trained_engine).tokenizer
    return tokenizer.encode(inspect.getsource(json.decoder))


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, dict]:
    """Each request's tokens, logprobs, prompt logprobs and the step its first token came in."""
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    results = {i: {"tokens": [], "logprobs": [], "prompt_logprobs": None, "steps": 0} for i in ids}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for output in engine.step():
            assert output.error is None, output.error
            result = results[output.request_id]
            if output.prompt_logprobs is not None:
                assert result["prompt_logprobs"] is None, "prompt logprobs came twice"
                result["prompt_logprobs"], result["steps"] = output.prompt_logprobs, steps
            result["tokens"] += output.new_token_ids
            result["logprobs"] += output.logprobs or []
    return [results[i] for i in ids]


def assert_matches(reference_rows: np.ndarray, found, tokens: list[int], top: int):
    """`found` (TokenLogprob per position) against the reference's rows for `tokens`."""
    assert [f.token for f in found] == list(tokens)
    got = np.array([f.logprob for f in found])
    want = reference_rows[np.arange(len(tokens)), tokens]
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    for row, f in zip(reference_rows, found):
        assert len(f.top) == top
        ids = [t for t, _ in f.top]
        np.testing.assert_allclose([lp for _, lp in f.top], row[ids], atol=ATOL, rtol=0)
        if top:  # the top set is the reference's, up to near-ties at its edge
            assert row[ids].min() >= np.sort(row)[-top] - ATOL


@pytest.mark.parametrize("budget", [512, 48], ids=["one chunk", "chunks of 48"])
def test_prompt_and_output_logprobs_equal_transformers(trained_engine, trained_log_probs, text_ids, budget):
    engine = Engine(trained_engine, SchedulerConfig(max_num_batched_tokens=budget, max_prefill_tokens=budget),
                    speculative_tokens=0)
    prompt = text_ids[:200]
    (result,) = run(engine, [prompt], [SamplingParams(max_new_tokens=12, logprobs=TOP, prompt_logprobs=TOP)])
    rows = trained_log_probs(prompt + result["tokens"])
    assert result["prompt_logprobs"][0] is None and len(result["prompt_logprobs"]) == len(prompt)
    assert_matches(rows[:len(prompt) - 1], result["prompt_logprobs"][1:], prompt[1:], TOP)
    assert_matches(rows[len(prompt) - 1:-1], result["logprobs"], result["tokens"], TOP)
    # one prefill, in as many steps as the budget cuts it into, not a step per prompt token
    assert result["steps"] == -(-len(prompt) // budget)


def test_cached_prefix_preemption_sampling_speculation_and_company(trained_engine, trained_log_probs, text_ids):
    """Every way a token can come: the prefix cache holds the prompt already (the request must
    compute it anyway), a preemption restarts a prefill, a sampled token, guessed tokens kept,
    beside requests that ask for nothing."""
    engine = Engine(trained_engine, SchedulerConfig(max_num_batched_tokens=64, max_prefill_tokens=64),
                    kv_pool_mb=None, speculative_tokens=4)
    prompt = text_ids[300:460]
    run(engine, [prompt], [SamplingParams(max_new_tokens=2)])  # fills the prefix cache
    wanted = [SamplingParams(max_new_tokens=24, logprobs=TOP, prompt_logprobs=TOP),  # greedy: guesses
              SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, logprobs=0, prompt_logprobs=2)]
    others = [SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=8, temperature=0.7, seed=1)]
    prompts = [prompt, text_ids[500:590], text_ids[40:120], text_ids[700:710]]
    results = run(engine, prompts, wanted + others)
    assert engine.stats["speculative_tokens_kept"] > 0, "no guess was kept: the speculated path went untested"
    for prompt_ids, params, result in zip(prompts, wanted, results):
        rows = trained_log_probs(prompt_ids + result["tokens"])
        assert len(result["prompt_logprobs"]) == len(prompt_ids)
        assert_matches(rows[:len(prompt_ids) - 1], result["prompt_logprobs"][1:], prompt_ids[1:],
                       params.prompt_logprobs)
        assert_matches(rows[len(prompt_ids) - 1:-1], result["logprobs"], result["tokens"], params.logprobs)
    for result in results[2:]:
        assert result["logprobs"] == [] and result["prompt_logprobs"] is None


def test_a_prefill_preempted_midway_reports_each_prompt_token_once(trained_engine, trained_log_probs, text_ids):
    """A pool of one sequence's blocks: two decodes outgrow it while the newest request is in
    its prefill, which is preempted and computed again."""
    manifest = read_engine(trained_engine, verify=False).manifest
    paged = manifest.paged
    pool_mb = kv_block_bytes(manifest.geometry, paged.block_size, paged.kv_dtype) * \
        -(-paged.max_seq_len // paged.block_size) / 2**20
    engine = Engine(trained_engine, SchedulerConfig(max_num_batched_tokens=32, max_prefill_tokens=8),
                    kv_pool_mb=pool_mb, speculative_tokens=0)
    preempted = []
    preempt = engine.scheduler._preempt

    def recording(request):
        preempted.append((request.request_id, None if request.prompt_logprobs is None
                          else len(request.prompt_logprobs)))
        preempt(request)
    engine.scheduler._preempt = recording
    # Two decodes whose prompts fill their blocks, and which together end up holding the whole pool;
    # the newest request's prompt takes all but one of the blocks they leave at first.
    block, half = paged.block_size, paged.max_seq_len // 2
    prompts = [text_ids[1000:1000 + 6 * block], text_ids[2000:2000 + 6 * block],
               text_ids[:paged.max_seq_len - 13 * block]]
    params = [SamplingParams(max_new_tokens=half - 6 * block, ignore_eos=True)] * 2 + \
        [SamplingParams(max_new_tokens=8, prompt_logprobs=1)]
    results = run(engine, prompts, params)
    assert any(partial is not None and 1 < partial < len(prompts[2]) for _, partial in preempted), preempted
    rows = trained_log_probs(prompts[2] + results[2]["tokens"])
    assert len(results[2]["prompt_logprobs"]) == len(prompts[2])
    assert_matches(rows[:len(prompts[2]) - 1], results[2]["prompt_logprobs"][1:], prompts[2][1:], 1)


def test_token_logprobs_top_is_ordered_and_bounded():
    logits = np.array([[0.0, 3.0, 1.0, 3.0, -2.0]])
    (found,) = token_logprobs(logits, [4], 3)
    assert [t for t, _ in found.top] == [1, 3, 2]  # ties by id
    assert found.logprob == pytest.approx(-2.0 - np.log(np.exp(logits).sum()))
    (everything,) = token_logprobs(logits, [0], 20)  # more than the vocabulary: all of it
    assert len(everything.top) == 5


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, True, 2.0])
def test_bad_logprobs_settings_are_refused(field, value):
    with pytest.raises(LlmcError, match=field):
        SamplingParams(**{field: value})
