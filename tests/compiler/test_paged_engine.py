"""`llmc compile` builds paged-KV engines by default; `llmc run` on them matches the contiguous
engine token for token."""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from llmc.cli import main
from llmc.formats.engine_file import read_engine, read_manifest
from llmc.plugins.paged_attention import PagedBatch
from paged_cases import Stepper

PROMPTS = ["def fibonacci(", "import os", "x = [", "while True:"]


def llmc(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def run_tokens(engine):
    args = ["run", engine, "--max-new-tokens", 10, "--json"]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    result = llmc(*args)
    assert result.exit_code == 0, result.output
    return [json.loads(line)["token_ids"] for line in result.stdout.splitlines()]


def test_default_engine_is_paged_and_sized_from_the_options(tiny_llama_engine):
    paged = read_manifest(tiny_llama_engine)["paged"]
    assert paged["block_size"] == 16 and paged["max_batch"] == 64 and paged["max_seq_len"] == 512
    assert paged["num_blocks"] == 16 * 512 // 16  # 16 full-length sequences; the 64 seats share them
    # 2 (K and V) × 4 layers × 2 kv heads × 16 tokens × 64 dims × 4 bytes per block
    assert paged["pool_mb"] == pytest.approx(512 * 2 * 4 * 2 * 16 * 64 * 4 / 2**20)
    assert "paged: 512 blocks of 16 tokens" in llmc("inspect", tiny_llama_engine).stdout
    assert paged["kv_dtype"] == "float32"  # auto: the model's


def test_float16_pool_holds_the_same_blocks_in_half_the_memory(tiny_llama_onnx, tiny_llama_engine, tmp_path):
    result = llmc("compile", tiny_llama_onnx, "-o", tmp_path / "kv16.plan", "--kv-cache-dtype", "fp16")
    assert result.exit_code == 0, result.output
    paged, reference = (read_manifest(p)["paged"] for p in (tmp_path / "kv16.plan", tiny_llama_engine))
    assert paged["kv_dtype"] == "float16" and paged["num_blocks"] == reference["num_blocks"]
    assert paged["pool_mb"] == pytest.approx(reference["pool_mb"] / 2)


@pytest.mark.parametrize("options", [["--block-size", "8", "--max-batch", "3"],
                                     ["--kv-pool-mb", "2", "--max-seq-len", "64", "--max-batch", "1"]])
def test_paged_greedy_tokens_equal_the_contiguous_engine(tiny_llama_onnx, tmp_path, options):
    assert llmc("compile", tiny_llama_onnx, "-o", tmp_path / "dense.plan", "--no-paged").exit_code == 0
    result = llmc("compile", tiny_llama_onnx, "-o", tmp_path / "paged.plan", *options)
    assert result.exit_code == 0, result.output
    assert read_manifest(tmp_path / "dense.plan")["paged"] is None
    assert read_manifest(tmp_path / "paged.plan")["paged"]["max_batch"] == int(options[options.index("--max-batch") + 1])
    assert run_tokens(tmp_path / "paged.plan") == run_tokens(tmp_path / "dense.plan")


@pytest.mark.parametrize("options,message", [
    (["--block-size", "48"], "--block-size: 48 is not supported"),
    (["--kv-pool-mb", "0.01"], "--kv-pool-mb: 0.01 MiB holds 0 blocks"),
    (["--max-seq-len", "4096"], "--max-seq-len: 4096 exceeds the model's 512 positions"),
    (["--max-batch", "0"], "--max-batch: must be ≥ 1"),
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype: 'int8' is not one of auto, fp16, fp32"),
])
def test_bad_paged_options(tiny_llama_onnx, tmp_path, options, message):
    result = llmc("compile", tiny_llama_onnx, "-o", tmp_path / "e.plan", *options)
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert not (tmp_path / "e.plan").exists()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """The Mistral fixture checkpoint (sliding window 4 on every layer), exported with llmc."""
    from hf_checkpoints import write_hf_checkpoint

    from llmc.compiler.export import export

    folder = write_hf_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral")
    onnx_path = tmp_path_factory.mktemp("mistral-onnx") / "model.onnx"
    export(str(folder), onnx_path)
    return folder, onnx_path


def test_sliding_window_model_compiles_paged_and_matches_transformers(mistral, tmp_path):
    import torch
    from hf_checkpoints import hf_model

    from llmc import LLM, SamplingParams
    from llmc.compiler.build import compile_model
    from llmc.compiler.paged_engine import PagedOptions
    from llmc.runtime.engine import Engine
    from llmc.runtime.scheduler import SchedulerConfig

    folder, onnx_path = mistral
    # Blocks of 2 tokens under a window of 4: blocks fall behind the window and are freed as
    # sequences grow.
    paged = compile_model(onnx_path, tmp_path / "paged.plan", paged=PagedOptions(block_size=2, max_batch=4))
    dense = compile_model(onnx_path, tmp_path / "dense.plan", paged=None)
    assert paged["paged"]["window"] == 4 and paged["sliding_window"] == 4 and "not_paged" not in paged
    assert dense["paged"] is None
    # All longer than the window; the last one is prefilled in chunks of up to 24 tokens (the
    # dense form), its blocks freed between chunks.
    prompts = ["def fibonacci(n):", "import os", "x = [1, 2", "class Node:\n    def __init__(self, value):\n" * 2]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = Engine(tmp_path / "paged.plan", SchedulerConfig(max_num_seqs=4, max_prefill_tokens=24))
    ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    got = [[] for _ in prompts]
    checked = 0
    while engine.has_unfinished():
        for out in engine.step():
            got[ids[out.request_id]] += out.new_token_ids
        for request in engine.scheduler.running:
            # After a step, a sequence of c computed tokens (of n slots) keeps the blocks from
            # position c - 3 on, which its next token's window reads, however long it has grown.
            c, n = request.num_computed, engine.blocks.num_tokens(request.request_id)
            live = [b for b in engine.blocks.block_table(request.request_id) if b is not None]
            assert len(live) == -(-n // 2) - max(0, c - 3) // 2
            checked += 1
    assert checked > 40
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # nothing leaked
    reference = hf_model(folder)
    contiguous = LLM(tmp_path / "dense.plan")
    for completion, tokens in zip(contiguous.generate(prompts, params), got):
        ids_ = torch.tensor([completion.prompt_token_ids])
        with torch.no_grad():
            want = reference.generate(ids_, attention_mask=torch.ones_like(ids_), do_sample=False,
                                      max_new_tokens=12, eos_token_id=257, pad_token_id=257)
        assert tokens == want[0, ids_.shape[1]:].tolist()
        assert tokens == completion.token_ids


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_alternating_windows_and_softcap_compile_paged_and_match_transformers(family, tmp_path):
    """Gemma-2 (soft-capped attention; sliding layer 0, global layer 1) and Gemma-3 (the same
    windows, no capping): every position's logits, from the dense prefill form (20 tokens) and
    the kernel (10 tokens), and greedy tokens equal transformers'."""
    import numpy as np
    import torch
    from hf_checkpoints import hf_model, write_hf_checkpoint

    from llmc import LLM, SamplingParams
    from llmc.compiler.build import compile_model
    from llmc.compiler.export import export
    from llmc.compiler.paged_engine import PagedOptions

    folder = write_hf_checkpoint(tmp_path / "hf", family)
    export(str(folder), tmp_path / "model.onnx")
    manifest = compile_model(tmp_path / "model.onnx", tmp_path / "paged.plan", paged=PagedOptions(block_size=2))
    assert manifest["paged"] is not None and manifest["layer_windows"] == [4, 0]
    assert manifest["paged"]["window"] is None  # a global layer reads every block: none is freed
    llm, reference = LLM(tmp_path / "paged.plan"), hf_model(folder)
    for ids in (np.arange(30, 50), np.arange(60, 70)):
        with torch.no_grad():
            want = reference(torch.tensor(ids[None])).logits[0].numpy()
        np.testing.assert_allclose(llm.logits(ids), want, atol=1e-4, rtol=0)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    [completion] = llm.generate(["def fibonacci(n):"], params)
    prompt = torch.tensor([completion.prompt_token_ids])
    with torch.no_grad():
        want = reference.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=10, min_new_tokens=10)
    assert completion.token_ids == want[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("options", [["--fp16"], ["--weights", "int4", "--force"]])
def test_only_the_rows_asked_for_are_projected_to_logits_and_they_are_the_same(tiny_llama_onnx, tmp_path, options):
    engine_path = tmp_path / "engine.plan"
    result = llmc("compile", tiny_llama_onnx, "-o", engine_path, *options)
    assert result.exit_code == 0, result.output
    engine = read_engine(engine_path)
    paged = engine.manifest.paged
    graph = lambda section: onnx.ModelProto.FromString(bytes(engine.sections[section])).graph  # noqa: E731
    segments = [graph(segment.section) for segment in paged.segments]
    single = graph(paged.single_sequence)
    last_attention = max(i for i, n in enumerate(single.node) if n.op_type == "GroupQueryAttention")
    # Past the last attention (the paged graph's last segment starts after it) every product reads
    # rows gathered from a value before it: the last layer's output projection and MLP compute only
    # the rows asked for, not every token.
    for nodes, after in (([n for s in segments for n in s.node], segments[-1].node), (single.node, single.node[last_attention + 1:])):
        producers = {out: n for n in nodes for out in n.output}
        products = [n for n in after if n.op_type in ("MatMul", "MatMulNBits")]
        assert len(products) >= 4  # output projection, MLP, vocabulary
        assert products[-1].input[0] == "logits_hidden"  # the vocabulary projection
        for product in products:
            value = product.input[0]
            while not (producers[value].op_type == "Gather" and "logits_rows" in producers[value].input):
                assert producers[value].op_type not in ("GroupQueryAttention", "Reshape"), product.name
                value = producers[value].input[0]
                assert value in producers, product.name  # the attention's output, ungathered
    ids = np.random.default_rng(0).integers(0, engine.manifest.geometry.vocab_size, 40)
    batch = PagedBatch(np.arange(3)[None], np.zeros(1, np.int64), np.array([0, len(ids)]))
    for single_sequence in (True, False):
        decoder = Stepper.open(engine, kv_pool_mb=4, threads=1, single_sequence=single_sequence)
        every = decoder.step(ids, np.arange(len(ids)), batch, rows=np.arange(len(ids)))
        chosen = decoder.step(ids, np.arange(len(ids)), batch, rows=np.array([7, 39]))
        np.testing.assert_allclose(chosen, every[[7, 39]], rtol=0, atol=1e-5)
