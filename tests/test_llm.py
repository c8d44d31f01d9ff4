"""Reference generation through the Python API, against PyTorch recomputing the whole sequence."""

import pytest
import torch

from llmc import LLM, SamplingParams
from llmc.models import load_model

PROMPTS = ["def fibonacci(", "import os\n", "x"]


@pytest.fixture(scope="module")
def llm(tiny_llama_engine):
    return LLM(tiny_llama_engine)


def torch_greedy(prompt_ids, steps):
    """Greedy decoding by running the full sequence through PyTorch at every step (no cache)."""
    model = load_model("tiny-llama").model
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            x = torch.tensor([ids])
            logits, _ = model(x, torch.ones_like(x), torch.arange(len(ids))[None], [
                (torch.zeros(1, model.num_kv_heads, 0, model.head_dim),) * 2] * model.num_layers)
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_greedy_matches_pytorch_without_cache(llm):
    completion = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=16))[0]
    assert completion.token_ids == torch_greedy(completion.prompt_token_ids, 16)
    assert completion.finish_reason == "length"
    assert completion.text == llm.tokenizer.decode(completion.token_ids)


def test_batched_left_padded_equals_each_alone(llm):
    params = SamplingParams(max_new_tokens=10)
    together = llm.generate(PROMPTS, params)
    alone = [llm.generate(p, params)[0] for p in PROMPTS]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5)
    first = llm.generate(PROMPTS, params)
    second = llm.generate(PROMPTS[:1], params)
    assert first[0].token_ids == second[0].token_ids
    other_seed = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=1.0, seed=6))
    assert other_seed[0].token_ids != first[0].token_ids


def test_stop_token_ends_the_completion(llm):
    free = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=12))[0].token_ids
    stop = free[4]
    first = free.index(stop)
    stopped = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))[0]
    assert stopped.token_ids == free[: first + 1]
    assert stopped.finish_reason == "stop"


def test_generation_stops_at_the_position_limit(llm):
    limit = llm.manifest.geometry.max_positions
    prompt = "a" * (limit - 4)  # + BOS = limit - 3 tokens
    completion = llm.generate(prompt, SamplingParams(max_new_tokens=50))[0]
    assert len(completion.prompt_token_ids) + len(completion.token_ids) == limit
    assert completion.finish_reason == "length"


def test_stream_yields_the_generated_tokens(llm):
    params = SamplingParams(max_new_tokens=9)
    chunks = list(llm.stream(PROMPTS[2], params))
    completion = llm.generate(PROMPTS[2], params)[0]
    assert [c.token_id for c in chunks] == completion.token_ids
    assert "".join(c.text for c in chunks) == completion.text
    assert [c.finish_reason for c in chunks] == [None] * 8 + ["length"]


def test_mismatched_params_list_is_refused(llm):
    with pytest.raises(ValueError, match="2 sampling settings for 3 prompts"):
        llm.generate(PROMPTS, [SamplingParams()] * 2)


def test_one_engine_serves_every_call_and_keeps_its_prefix_cache(tiny_llama_engine):
    llm = LLM(tiny_llama_engine)
    engine = llm.engine
    prompt = "class Node:\n    def __init__(self, value):\n        self.value = value\n" * 2
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    first = llm.generate(prompt, params)[0]
    assert engine.blocks.stats.cached_prompt_tokens == 0
    # logits borrow fresh blocks from the same block manager and give them back
    logits = llm.logits(first.prompt_token_ids)
    assert logits.shape == (len(first.prompt_token_ids), llm.manifest.geometry.vocab_size)
    assert int(logits[-1].argmax()) == first.token_ids[0]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    streamed = [chunk.token_id for chunk in llm.stream(prompt, params)]
    assert llm.engine is engine and streamed == first.token_ids
    assert engine.blocks.stats.cached_prompt_tokens > 0  # the second call reused the first's blocks


def test_leaving_a_stream_early_frees_its_request(llm):
    stream = llm.stream("def f(x):", SamplingParams(max_new_tokens=20, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


@pytest.mark.parametrize("prompt, message", [("", "prompt 0: empty"),
                                             ("ab\udcffc", "prompt 0: not valid text \\(character 3")])
def test_empty_and_non_unicode_prompts_are_refused(llm, prompt, message):
    from llmc.errors import LlmcError

    with pytest.raises(LlmcError, match=message):
        llm.generate(prompt)
