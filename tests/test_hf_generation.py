"""Hugging Face checkpoint folders through the whole CLI: greedy tokens equal transformers'.

Every family `llmc export` supports (tests/hf_checkpoints.py ALL_FAMILIES) is exported,
compiled with the default options (paged KV where the compiler can express the model, else
contiguous with the reason in the manifest) and run; families with sliding windows or
soft-capping are also compiled contiguous (`--no-paged`) and must match as well.
"""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from hf_checkpoints import ALL_FAMILIES, hf_greedy, hf_model, write_hf_checkpoint

from llmc import LLM, SamplingParams
from llmc.cli import main
from llmc.formats.engine_file import read_manifest

PROMPT = "def fibonacci("
NEW_TOKENS = 32
# Families whose attention differs from plain causal (windows, soft-capping): also run contiguous.
ALSO_CONTIGUOUS = ("mistral", "gemma2", "gemma3")


def _export_and_compile(folder, out, *compile_options):
    runner = CliRunner()
    if not (out / "model.onnx").exists():
        exported = runner.invoke(main, ["export", str(folder), "-o", str(out / "model.onnx")])
        assert exported.exit_code == 0, exported.output
        assert "parity vs PyTorch: max abs diff" in exported.stdout
    engine = out / ("engine.plan" if not compile_options else "engine-contiguous.plan")
    compiled = runner.invoke(main, ["compile", str(out / "model.onnx"), "-o", str(engine), *compile_options])
    assert compiled.exit_code == 0, compiled.output
    return engine


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def compiled(request, tmp_path_factory):
    family = request.param
    folder = write_hf_checkpoint(tmp_path_factory.mktemp(family), family)
    out = tmp_path_factory.mktemp(f"{family}-out")
    engine = _export_and_compile(folder, out)
    # The windows the compiler must honour travel in the export's metadata: one for every layer, or one per layer.
    metadata = {p.key: p.value for p in onnx.load(out / "model.onnx", load_external_data=False).metadata_props}
    windows = {"mistral": ("llmc.sliding_window", "4"), "gemma2": ("llmc.layer_windows", "[4, 0]"),
               "gemma3": ("llmc.layer_windows", "[4, 0]")}
    if family in windows:
        assert metadata[windows[family][0]] == windows[family][1]
    else:
        assert "llmc.sliding_window" not in metadata and "llmc.layer_windows" not in metadata
    manifest = read_manifest(engine)
    # Paged when the compiler can express the model; otherwise contiguous and it says why.
    assert manifest["paged"] is not None or manifest["not_paged"]
    if family in ("llama", "qwen2", "gpt2"):  # plain causal attention must always go paged
        assert manifest["paged"]["block_size"] == 16
    return family, folder, out, engine


def _run(engine) -> dict:
    result = CliRunner().invoke(main, ["run", str(engine), "--prompt", PROMPT,
                                       "--max-new-tokens", str(NEW_TOKENS), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_greedy_tokens_equal_transformers_generate(compiled):
    family, folder, out, engine = compiled
    record = _run(engine)
    assert record["token_ids"] == hf_greedy(folder, record["prompt_token_ids"], NEW_TOKENS)


def test_contiguous_engine_equals_transformers_generate(compiled):
    family, folder, out, _ = compiled
    if family not in ALSO_CONTIGUOUS:
        pytest.skip("plain causal attention: the default engine's test covers it")
    engine = _export_and_compile(folder, out, "--no-paged")
    assert read_manifest(engine)["paged"] is None
    record = _run(engine)
    assert record["token_ids"] == hf_greedy(folder, record["prompt_token_ids"], NEW_TOKENS)


def test_onnx_logits_equal_transformers(compiled):
    family, folder, out, _ = compiled
    reference = hf_model(folder)
    config = reference.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    ids = torch.randint(0, 258, (2, 9), generator=torch.Generator().manual_seed(0))
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones((2, 9), np.int64),
             "position_ids": np.tile(np.arange(9), (2, 1))}
    for i in range(config.num_hidden_layers):
        for part in ("key", "value"):
            feeds[f"past_key_values.{i}.{part}"] = np.zeros((2, kv_heads, 0, head_dim), np.float32)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], feeds)[0]
    with torch.no_grad():
        want = reference(ids).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_every_eos_id_stops_generation(tmp_path):
    """A second EOS id listed only in generation_config.json ends generation where it is produced."""
    folder = write_hf_checkpoint(tmp_path / "ckpt", "llama3")  # config.json: eos_token_id [257, 10]
    prompt_ids = [256, *PROMPT.encode()]
    free = hf_greedy(folder, prompt_ids, 16)
    # A token of the free run that is not already an EOS id and first appears at index >= 2.
    stop_at = next(i for i, t in enumerate(free) if i >= 2 and t not in (257, 10) and t not in free[:i])
    generation_config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(
        json.dumps({**generation_config, "eos_token_id": [257, 10, free[stop_at]]}))
    assert hf_greedy(folder, prompt_ids, 16) == free[:stop_at + 1]  # transformers stops there too
    engine = _export_and_compile(folder, tmp_path)
    completion = LLM(engine).generate(PROMPT, SamplingParams(max_new_tokens=16))[0]
    assert completion.prompt_token_ids == prompt_ids
    assert completion.token_ids == free[:stop_at + 1]
    assert completion.finish_reason == "stop"


def test_tensorrt_dry_run_accepts_every_family(compiled, tmp_path):
    """`llmc compile --backend tensorrt --dry-run`: every node of every family's final graph is one
    TensorRT 11's parser imports, or the paged-attention plugin (one per layer)."""
    from llmc.compiler.build import compile_model
    from llmc.compiler.tensorrt_network import TensorRTOptions

    family, folder, out, engine = compiled
    manifest = compile_model(out / "model.onnx", tmp_path / "trt.plan", backend="tensorrt",
                             tensorrt=TensorRTOptions(dry_run=True))
    check = manifest["tensorrt_check"]
    assert check["unsupported"] == [], check["unsupported"]
    assert check["plugins"] == {"llmc::paged_attention": manifest["geometry"]["num_layers"]}
    assert not (tmp_path / "trt.plan").exists()


def test_openvino_engine_equals_transformers_generate(compiled):
    """--backend openvino on every family: transformers' greedy tokens, or one line saying why not."""
    pytest.importorskip("openvino")
    family, folder, out, _ = compiled
    engine = out / "engine-openvino.plan"
    result = CliRunner().invoke(main, ["compile", str(out / "model.onnx"), "-o", str(engine), "--backend", "openvino"])
    manifest = read_manifest(out / "engine.plan")
    softcapped = manifest["paged"] and any((s["attention"] or {}).get("softcap") for s in manifest["paged"]["segments"])
    if manifest["paged"] is None or softcapped:
        assert result.exit_code != 0 and not engine.exists()
        assert result.output.strip().splitlines()[-1].startswith("llmc: error: ")
        return
    assert result.exit_code == 0, result.output
    record = _run(engine)
    assert record["token_ids"] == hf_greedy(folder, record["prompt_token_ids"], NEW_TOKENS)
