"""`llmc compile` on graphs that do not come straight from `llmc export`."""

import json

import numpy as np
import onnx
import pytest

from llmc import LLM, SamplingParams
from llmc.formats import onnx_io
from llmc.compiler.build import compile_model
from llmc.compiler.export import export
from llmc.errors import LlmcError
from llmc.tokenizer import byte_level_tokenizer


def test_foreign_graph_with_config_and_tokenizer_beside_it(tiny_llama_onnx, tiny_llama_engine, tmp_path):
    # As Optimum or onnxruntime-genai leave it: no llmc metadata, HF files in the same folder.
    model = onnx.load(tiny_llama_onnx)
    del model.metadata_props[:]
    onnx.save(model, tmp_path / "model.onnx")
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_attention_heads": 4, "max_position_embeddings": 512}))
    byte_level_tokenizer().save(tmp_path)
    manifest = compile_model(tmp_path / "model.onnx", tmp_path / "engine.plan")
    assert manifest["geometry"]["num_heads"] == 4 and manifest["geometry"]["max_positions"] == 512
    params = SamplingParams(max_new_tokens=8)
    ours = LLM(tmp_path / "engine.plan").generate("foreign", params)[0]
    reference = LLM(tiny_llama_engine).generate("foreign", params)[0]
    assert ours.token_ids == reference.token_ids


def test_missing_tokenizer_is_named(tiny_llama_onnx, tmp_path):
    model = onnx.load(tiny_llama_onnx)
    kept = [p for p in model.metadata_props if p.key != "llmc.tokenizer"]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    onnx.save(model, tmp_path / "model.onnx")
    with pytest.raises(LlmcError, match="no tokenizer embedded and no tokenizer.json beside it"):
        compile_model(tmp_path / "model.onnx", tmp_path / "engine.plan")
    with pytest.raises(LlmcError, match="--tokenizer: no tokenizer.json"):
        compile_model(tmp_path / "model.onnx", tmp_path / "engine.plan", tokenizer=tmp_path)
    assert not (tmp_path / "engine.plan").exists()


def test_large_models_use_external_data(tmp_path, monkeypatch):
    # Pretend the 2 GB limit is tiny so the external-data path runs on a small model.
    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_THRESHOLD", 1000)
    monkeypatch.setattr("llmc.compiler.export.EXTERNAL_DATA_THRESHOLD", 1000)
    check = export("tiny-gpt2", tmp_path / "model.onnx")
    assert check.max_abs < 1e-4
    assert (tmp_path / "model.onnx.data").stat().st_size > (tmp_path / "model.onnx").stat().st_size
    graph_only = onnx.load(tmp_path / "model.onnx", load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph_only.graph.initializer)
    compile_model(tmp_path / "model.onnx", tmp_path / "engine.plan")
    completion = LLM(tmp_path / "engine.plan").generate("x", SamplingParams(max_new_tokens=4))[0]
    assert len(completion.token_ids) == 4 and np.all(np.array(completion.token_ids) < 258)
