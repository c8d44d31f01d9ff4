"""A paged engine graph (level 2 + lower-paged-attention) generates exactly what the dense
reference generation does, and its logits equal the original graph's."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from llmc import LLM, SamplingParams
from llmc.compiler.compare import run_onnx
from llmc.compiler.decoder_interface import recognize_decoder
from llmc.compiler.pipeline import optimize
from llmc.errors import LlmcError
from llmc.passes.lower_paged_attention import LowerPagedAttention
from llmc.plugins.paged_attention import PagedBatch
from llmc.runtime.paged_generation import PagedDecoder, generate_paged

PROMPTS = ["def fibonacci(", "import os\n", "x", "class Node:\n    def __init__(self):"]


def paged_decoder(onnx_path, block_size, num_blocks=64):
    model, _ = optimize(onnx.load(onnx_path), level=2)
    LowerPagedAttention(block_size).run(model)
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    geometry = recognize_decoder(onnx.load(onnx_path, load_external_data=False), onnx_path).geometry
    return PagedDecoder(session, geometry, block_size, num_blocks)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_greedy_tokens_equal_the_dense_reference(tiny_llama_onnx, tiny_llama_engine, block_size):
    llm = LLM(tiny_llama_engine)
    params = SamplingParams(max_new_tokens=12)
    reference = [llm.generate(p, params)[0].token_ids for p in PROMPTS]
    blocks = 512 // block_size + 8
    decoder = paged_decoder(tiny_llama_onnx, block_size, blocks)
    prompt_ids = [llm.encode(p) for p in PROMPTS]
    got = [[] for _ in PROMPTS]
    for event in generate_paged(decoder, prompt_ids, [params] * len(PROMPTS), llm.tokenizer.eos_id):
        got[event.index].append(event.token_id)
    assert got == reference
    assert sorted(decoder.free_blocks) == list(range(blocks))  # every block came back


def test_packed_prefill_logits_equal_the_original_graph(tiny_llama_onnx):
    decoder = paged_decoder(tiny_llama_onnx, 16)
    rng = np.random.default_rng(0)
    lens = [5, 9, 1]
    prompts = [rng.integers(0, 258, n) for n in lens]
    tables = []
    for n in lens:
        table = []
        decoder.allocate(table, n)
        tables.append(table)
    width = max(len(t) for t in tables)
    batch = PagedBatch(np.array([t + [0] * (width - len(t)) for t in tables]), np.zeros(3, np.int64),
                       np.concatenate([[0], np.cumsum(lens)]))
    positions = np.concatenate([np.arange(n) for n in lens])
    logits = decoder.step(np.concatenate(prompts), positions, batch)
    original = onnx.load(tiny_llama_onnx)
    for s, prompt in enumerate(prompts):
        feeds = {"input_ids": prompt[None], "attention_mask": np.ones((1, len(prompt)), np.int64),
                 "position_ids": np.arange(len(prompt))[None]}
        for i in range(4):
            for part in ("key", "value"):
                feeds[f"past_key_values.{i}.{part}"] = np.zeros((1, 2, 0, 64), np.float32)
        want = run_onnx(original, feeds)["logits"][0, -1]
        np.testing.assert_allclose(logits[s], want, atol=1e-4, rtol=0)


def test_uncanonicalized_attention_is_refused(tiny_llama_onnx):
    model = onnx.load(tiny_llama_onnx)  # not optimized: attention is still decomposed
    with pytest.raises(LlmcError, match="layer 0's attention could not be canonicalized"):
        LowerPagedAttention().run(model)


def test_unsupported_block_size_is_refused():
    with pytest.raises(LlmcError, match="--block-size: 48 is not supported"):
        LowerPagedAttention(48)


def test_full_pool_is_a_clear_error(tiny_llama_onnx):
    decoder = paged_decoder(tiny_llama_onnx, 16, num_blocks=1)
    with pytest.raises(LlmcError, match="KV pool of 1 blocks is full"):
        list(generate_paged(decoder, [[1] * 20], [SamplingParams()], None))
