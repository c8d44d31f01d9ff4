"""The continuous-batching engine on tiny-llama: batching, preemption and prefix caching never
change what a request generates."""

import pytest

from llmc import LLM, SamplingParams
from llmc.compiler.build import compile_model
from llmc.compiler.paged_engine import PagedOptions
from llmc.errors import LlmcError
from llmc.runtime.engine import Engine
from llmc.runtime.scheduler import SchedulerConfig

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "x", "class Node:\n    def __init__(self):",
           "for i in range(10):", "print('hello')"]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def run_all(engine, prompts, params=GREEDY):
    ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    tokens = [[] for _ in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            tokens[ids[out.request_id]] += out.new_token_ids
    return tokens


@pytest.fixture(scope="module")
def alone(tiny_llama_engine):
    engine = Engine(tiny_llama_engine)
    return [run_all(engine, [p])[0] for p in PROMPTS]


def test_batched_output_equals_each_request_alone(tiny_llama_engine, alone):
    engine = Engine(tiny_llama_engine, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32))
    assert run_all(engine, PROMPTS) == alone


def test_output_after_preemption_equals_output_without(tiny_llama_onnx, tmp_path, alone):
    # 3 blocks of 32 tokens for 6 requests of up to ~60 tokens: the pool runs out mid-decode.
    compile_model(tiny_llama_onnx, tmp_path / "small.plan",
                  paged=PagedOptions(block_size=32, kv_pool_mb=0.375, max_seq_len=64, max_batch=6))
    engine = Engine(tmp_path / "small.plan")
    assert engine.blocks.num_blocks == 3
    assert run_all(engine, PROMPTS) == alone
    assert engine.stats["preemptions"] > 0
    assert engine.blocks.num_free_blocks == 3


def test_prefix_cached_request_generates_the_same_tokens(tiny_llama_engine):
    shared = "# " + "a shared prefix that spans several blocks of the pool. " * 3
    first, second = shared + "def f():", shared + "class C:"
    fresh = run_all(Engine(tiny_llama_engine), [second])[0]
    engine = Engine(tiny_llama_engine)
    run_all(engine, [first])
    assert run_all(engine, [second])[0] == fresh
    assert engine.stats["prefix_hit_rate"] > 0.3


def test_stop_strings_abort_and_per_request_errors(tiny_llama_engine):
    engine = Engine(tiny_llama_engine)
    free_text = LLM(tiny_llama_engine).generate(PROMPTS[0], GREEDY)[0].text
    stop = free_text[5:7]
    kept = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=24, stop=(stop,)))
    cancelled = engine.add_request(PROMPTS[1], GREEDY)
    with pytest.raises(LlmcError, match="leave no room in the engine's 512 positions"):
        engine.add_request("x" * 600, GREEDY)
    engine.step()
    assert engine.abort(cancelled) and not engine.abort(cancelled)
    texts, reasons = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            reasons[out.request_id] = out.finish_reason
    assert reasons[kept] == "stop" and stop not in texts[kept]
    assert free_text.startswith(texts[kept]) and cancelled not in reasons
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_request_larger_than_the_pool_is_refused(tiny_llama_onnx, tmp_path):
    compile_model(tiny_llama_onnx, tmp_path / "tiny.plan",
                  paged=PagedOptions(block_size=32, kv_pool_mb=0.25, max_seq_len=64))
    engine = Engine(tmp_path / "tiny.plan")
    with pytest.raises(LlmcError, match="leave no room|KV pool too small"):
        engine.add_request("y" * 70, GREEDY)


def test_contiguous_engine_is_refused(tiny_llama_onnx, tmp_path):
    compile_model(tiny_llama_onnx, tmp_path / "dense.plan", paged=None)
    with pytest.raises(LlmcError, match="not a paged engine"):
        Engine(tmp_path / "dense.plan")


def test_float16_pool_batched_equals_alone_and_stays_near_the_float32_pool(tiny_llama_onnx, tiny_llama_engine,
                                                                           tmp_path):
    compile_model(tiny_llama_onnx, tmp_path / "kv16.plan", paged=PagedOptions(kv_dtype="float16"))
    # Chunked prompts beside decodes, then each alone: a step reads its own new keys rounded, as
    # later steps read them from the pool, so how a prompt is split cannot change the tokens.
    batched = run_all(Engine(tmp_path / "kv16.plan",
                                       SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)), PROMPTS)
    engine = Engine(tmp_path / "kv16.plan")
    assert batched == [run_all(engine, [p])[0] for p in PROMPTS]
    assert engine.kv.pool.dtype == "float16"
    # Keys and values rounded to float16 (relative error 2^-11) move the logits by far less than
    # their spread.
    ids = LLM(tiny_llama_engine).tokenizer.encode(PROMPTS[3] * 4)
    reference, rounded = LLM(tiny_llama_engine).logits(ids), LLM(tmp_path / "kv16.plan").logits(ids)
    assert 0 < abs(rounded - reference).max() < 1e-2 * reference.std()


def test_token_id_prompts_are_checked_against_the_model_vocabulary(tiny_llama_engine):
    engine = Engine(tiny_llama_engine)
    vocab = engine.manifest.geometry.vocab_size
    engine.add_request([vocab - 1, 0], SamplingParams(max_new_tokens=1))
    with pytest.raises(LlmcError, match=f"prompt r: a token id is outside the model's vocabulary of {vocab}"):
        engine.add_request([1, vocab], request_id="r")
