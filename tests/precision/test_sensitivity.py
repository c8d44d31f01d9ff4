"""llmc sensitivity: every layer ranked, the budget met by sparing the worst, the file usable."""

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

from llmc.compiler.pipeline import optimize
from llmc.errors import LlmcError
from llmc.precision.linears import linear_layers
from llmc.precision.plan import read_config
from llmc.precision.sensitivity import analyze
from llmc.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[2] / "data"

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("exhaustive", [False, True])
def test_ranking_covers_every_layer_worst_first(level2, exhaustive):
    windows = [RNG.integers(3, 258, 48) for _ in range(2)]
    result = analyze(level2, "int4", windows, windows, exhaustive=exhaustive)
    names = [name for name, _ in result.ranking]
    assert sorted(names) == sorted(l.name for l in linear_layers(level2))
    errors = [kl for _, kl in result.ranking]
    assert errors == sorted(errors, reverse=True) and errors[0] > 0
    if exhaustive:  # a KL divergence; an added error may be below zero (a layer can shrink the error it is given)
        assert errors[-1] > 0
    assert result.kept_fp32 == [] and result.config == {"default": "int4", "rules": {}}


def test_budget_spares_the_most_sensitive_layers_first(trained_onnx):
    # The trained model: on random weights quantization may even "improve" perplexity.
    model, _ = optimize(onnx.load(trained_onnx), level=2)
    text = (DATA / "pystdlib-text" / "heldout" / "heldout.txt").read_text()[:4000]
    ids = np.array(Tokenizer.from_folder(DATA / "pystdlib-llama").encode(text))
    windows = [ids[:200], ids[200:400]]
    free = analyze(model, "int4", windows, windows)
    assert free.ppl_increase_pct > 0
    budget = free.ppl_increase_pct / 4  # impossible with every layer quantized
    result = analyze(model, "int4", windows, windows, budget_pct=budget)
    assert result.kept_fp32 == [name for name, _ in result.ranking[:len(result.kept_fp32)]]
    assert 0 < len(result.kept_fp32) and result.ppl_increase_pct <= budget


def test_cli_writes_a_file_compile_accepts(tiny_llama_onnx, tmp_path):
    data = tmp_path / "calib"
    data.mkdir()
    np.save(data / "ids.npy", RNG.integers(3, 258, (4, 40)))
    out = tmp_path / "mix.json"
    done = subprocess.run(["llmc", "sensitivity", str(tiny_llama_onnx), "--int8-calib", str(data),
                           "--accuracy-budget", "100", "-o", str(out), "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert len(report["ranking"]) == 17 and report["config"]["default"] == "int8"
    assert read_config(str(out)).default == "int8"
    bad = subprocess.run(["llmc", "sensitivity", str(tiny_llama_onnx), "--int8-calib", str(data),
                          "--precision", "int2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--precision: 'int2'" in bad.stderr


def test_unknown_target_is_refused(level2):
    with pytest.raises(LlmcError, match="'fp8' is not one of"):
        analyze(level2, "fp8", [], [])
