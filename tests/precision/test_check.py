"""llmc check: metrics against PyTorch and NumPy, the CI gate, and bad input."""

import json
import subprocess

import numpy as np
import pytest
import torch

from llmc.compiler.build import compile_model
from llmc.compiler.export import _FlatDecoder, model_geometry, sample_inputs
from llmc.errors import LlmcError
from llmc.llm import LLM
from llmc.models.registry import load_model
from llmc.precision.check import ReferenceModel, check
from llmc.precision.plan import PrecisionOptions

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 6


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    folder = tmp_path_factory.mktemp("held")
    (folder / "a.txt").write_text(TEXT)
    return folder


@pytest.fixture(scope="module")
def int4_engine(tiny_llama_onnx, tmp_path_factory):
    path = tmp_path_factory.mktemp("int4") / "engine.plan"
    compile_model(tiny_llama_onnx, path, precision=PrecisionOptions(weights="int4", force=True))  # no data: random weights
    return path


def test_reference_perplexity_equals_pytorch(tiny_llama_onnx, tiny_llama_engine, held_out):
    report = check(LLM(tiny_llama_engine), ReferenceModel(tiny_llama_onnx), held_out, window=64)
    loaded = load_model("tiny-llama")
    flat = _FlatDecoder(loaded.model)
    ids = np.array(loaded.tokenizer.encode(TEXT))
    nll = []
    for start in range(0, len(ids) - 1, 64):
        piece = torch.tensor(ids[start:start + 64])[None]
        if piece.shape[1] < 2:
            continue
        inputs = sample_inputs(model_geometry(loaded.model), 1, piece.shape[1], 0, seed=0)
        inputs["input_ids"] = piece
        with torch.no_grad():
            logits = flat(*inputs.values())[0]
        logp = torch.log_softmax(logits[0, :-1].double(), -1)
        nll.append(-logp[torch.arange(piece.shape[1] - 1), piece[0, 1:]].numpy())
    expected = float(np.exp(np.concatenate(nll).mean()))
    assert report.tokens == sum(len(n) for n in nll)
    assert report.reference_ppl == pytest.approx(expected, rel=1e-4)
    # The fp32 engine is the same function: no measurable difference.
    assert abs(report.ppl_increase_pct) < 1e-3 and report.top1_agreement == 1.0
    assert report.mean_kl < 1e-8 and report.logit_cosine > 0.99999 and report.first_divergence is None


def test_int4_engine_shows_its_error(tiny_llama_onnx, int4_engine, held_out):
    report = check(LLM(int4_engine), ReferenceModel(tiny_llama_onnx), held_out, window=64)
    assert report.mean_kl > 1e-5 and report.logit_cosine < 0.9999
    assert report.top1_agreement < 1.0


def test_cli_gate_and_json(tiny_llama_onnx, int4_engine, held_out):
    run = lambda *extra: subprocess.run(  # noqa: E731
        ["llmc", "check", str(int4_engine), "--reference", str(tiny_llama_onnx),
         "--data", str(held_out), "--window", "64", "--generate", "4", "--json", *extra],
        capture_output=True, text=True)
    passing = run()
    assert passing.returncode == 0, passing.stderr
    report = json.loads(passing.stdout)
    assert report["passed"] and report["tokens"] > 0
    failing = run("--max-ppl-increase", str(report["ppl_increase_pct"] - 1e-6))
    assert failing.returncode == 1 and "exceeds --max-ppl-increase" in failing.stderr
    assert json.loads(failing.stdout)["passed"] is False


def test_bad_input(tiny_llama_onnx, tiny_llama_engine, tmp_path):
    engine, reference = LLM(tiny_llama_engine), ReferenceModel(tiny_llama_onnx)
    with pytest.raises(LlmcError, match="is not a folder"):
        check(engine, reference, tmp_path / "missing")
    with pytest.raises(LlmcError, match="holds no .txt"):
        check(engine, reference, tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(LlmcError, match=r"bad.jsonl:2: not valid JSON"):
        check(engine, reference, tmp_path)
    (tmp_path / "bad.jsonl").unlink()
    np.save(tmp_path / "ids.npy", np.array([1, 2, 99999]))
    with pytest.raises(LlmcError, match=r"ids.npy: token id 99999 is outside the model's vocabulary of 258"):
        check(engine, reference, tmp_path)
