"""onnxruntime-genai model builder outputs through `llmc compile` and `llmc run`.

Each seeded checkpoint (tests/hf_checkpoints.py) is converted by genai's builder
(tests/genai_builder.py, cached); the folder holds genai_config.json and no config.json.
The compiled engine — paged by default — must produce transformers' greedy tokens, with every
layer's GroupQueryAttention canonicalized (canonicalize-gqa) so that the paged lowering applies.
Families the builder refuses are skipped with its message.
"""

import json

import pytest
from click.testing import CliRunner
from genai_builder import BuilderRefused, genai_model
from hf_checkpoints import hf_greedy

from llmc import LLM, SamplingParams
from llmc.cli import main
from llmc.formats.engine_file import read_manifest

PROMPT = "def fibonacci("
NEW_TOKENS = 32
# Builder outputs whose attention is plain causal, or windowed on every layer (Mistral).
# gemma3, gpt2 and gpt_neox: genai 0.18's builder refuses them (skipped with its reason).
FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma3", "gpt2", "gpt_neox")
# genai's Mistral graph attends to the whole past (local_window_size -1; the window is only in
# genai_config.json): a contiguous engine keeps the graph's meaning, so only paged matches HF.
CONTIGUOUS_DIFFERS = ("mistral",)


def _build(family: str, precision: str = "fp32"):
    try:
        return genai_model(family, precision)
    except BuilderRefused as refused:
        pytest.skip(str(refused))


def _compile(genai, checkpoint, engine, *options):
    # The builder re-saves the tokenizer and may add a token past the vocabulary (Qwen2's
    # <|endoftext|>): take the checkpoint's own, as a user with the Hugging Face folder would.
    result = CliRunner().invoke(main, ["compile", str(genai / "model.onnx"), "-o", str(engine),
                                       "--tokenizer", str(checkpoint), *options])
    return result


def _run(engine) -> dict:
    result = CliRunner().invoke(main, ["run", str(engine), "--prompt", PROMPT,
                                       "--max-new-tokens", str(NEW_TOKENS), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module", params=FAMILIES)
def built(request):
    return (request.param, *_build(request.param))


def test_paged_engine_equals_transformers_generate(built, tmp_path):
    family, checkpoint, genai = built
    assert not (genai / "config.json").exists()  # geometry comes from genai_config.json
    engine = tmp_path / "engine.plan"
    compiled = _compile(genai, checkpoint, engine)
    assert compiled.exit_code == 0, compiled.output
    manifest = read_manifest(engine)
    layers = manifest["geometry"]["num_layers"]
    assert manifest["paged"] is not None, manifest.get("not_paged")
    assert {"pass": "canonicalize-gqa", "matches": layers} == {
        k: v for k, v in next(e for e in manifest["optimization"] if e["pass"] == "canonicalize-gqa").items()
        if k in ("pass", "matches")}
    if family == "mistral":  # the window comes from genai_config.json's sliding_window
        assert manifest["sliding_window"] == 4
    record = _run(engine)
    assert record["token_ids"] == hf_greedy(checkpoint, record["prompt_token_ids"], NEW_TOKENS)


def test_contiguous_engine_equals_transformers_generate(built, tmp_path):
    family, checkpoint, genai = built
    if family in CONTIGUOUS_DIFFERS:
        pytest.skip("genai's graph has no sliding window; only the paged engine applies it")
    engine = tmp_path / "engine.plan"
    compiled = _compile(genai, checkpoint, engine, "--no-paged")
    assert compiled.exit_code == 0, compiled.output
    assert read_manifest(engine)["paged"] is None
    record = _run(engine)
    assert record["token_ids"] == hf_greedy(checkpoint, record["prompt_token_ids"], NEW_TOKENS)


def test_ring_buffer_cache_is_refused_in_one_line(tmp_path):
    """Gemma-2 from genai: its local layer's GQA keeps a ring cache of `window` slots
    (sliding_window_cache=1), another interface than past/present: exit 2, naming the node."""
    checkpoint, genai = _build("gemma2")
    result = _compile(genai, checkpoint, tmp_path / "engine.plan")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert "sliding_window_cache=1" in lines[-1] and "layers.0/attn/GroupQueryAttention" in lines[-1]
    assert not (tmp_path / "engine.plan").exists()


@pytest.mark.parametrize("options", [(), ("--no-paged",)], ids=["paged", "contiguous"])
def test_batch_of_unequal_prompts_equals_transformers(options, tmp_path):
    """Prompts of different lengths in one batch (left-padded when contiguous): the positions
    computed from attention_mask keep each row's own numbering, as transformers' does alone."""
    checkpoint, genai = _build("llama")
    engine = tmp_path / "engine.plan"
    compiled = _compile(genai, checkpoint, engine, *options)
    assert compiled.exit_code == 0, compiled.output
    prompts = ["def fibonacci(", "x", "Hello, world"]
    completions = LLM(engine).generate(prompts, SamplingParams(max_new_tokens=16))
    for completion in completions:
        want = hf_greedy(checkpoint, completion.prompt_token_ids, NEW_TOKENS)[:16]
        assert completion.token_ids == want, completion.prompt


def test_int4_output_equals_genai_own_generation(tmp_path):
    """The builder's int4 form (MatMulNBits weights) compiles paged, and its greedy tokens equal
    onnxruntime-genai's own generation over the same files (the reference for a quantized graph)."""
    import onnxruntime_genai as og

    checkpoint, genai = _build("llama", "int4")
    engine = tmp_path / "engine.plan"
    compiled = _compile(genai, checkpoint, engine)
    assert compiled.exit_code == 0, compiled.output
    assert read_manifest(engine)["paged"] is not None
    record = _run(engine)
    prompt_ids = record["prompt_token_ids"]
    model = og.Model(str(genai))
    params = og.GeneratorParams(model)
    total = len(prompt_ids) + NEW_TOKENS
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    generator = og.Generator(model, params)
    generator.append_tokens([prompt_ids])
    reference = []
    while not generator.is_done():
        generator.generate_next_token()
        reference.append(int(generator.get_next_tokens()[0]))
    assert record["token_ids"] == reference[:len(record["token_ids"])] and len(record["token_ids"]) == NEW_TOKENS


def test_tensorrt_dry_run_accepts_the_builders_graph(built, tmp_path):
    """genai's graph, its GroupQueryAttention canonicalized and lowered to the plugin, passes
    `--backend tensorrt --dry-run`: no onnxruntime contrib op is left for TensorRT."""
    family, checkpoint, genai = built
    result = _compile(genai, checkpoint, tmp_path / "trt.plan", "--backend", "tensorrt", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "plugins llmc::paged_attention ×2" in result.stdout and "ok:" in result.stdout
