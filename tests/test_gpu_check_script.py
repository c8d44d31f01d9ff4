"""scripts/gpu_check_tensorrt.py's checks read what the CLI prints: its helpers run here on
onnxruntime engines (the TensorRT builds themselves need a GPU machine with TensorRT)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check_tensorrt.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_check_tensorrt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_greedy_tokens_and_bench_lines_parse(script, tiny_llama_engine):
    tokens = script.greedy_tokens(tiny_llama_engine)
    assert len(tokens) == len(script.PROMPTS) and all(len(t) == script.NEW_TOKENS for t in tokens)
    checks = script.Checks()
    script.bench(checks, tiny_llama_engine, requests=4)
    assert [r[0] for r in checks.results] == ["PASS", "PASS"], checks.results
    assert "throughput_tok_s" in checks.results[0][2] and "ttft_ms_p99" in checks.results[0][2]
    assert "decode_tok_s" in checks.results[1][2]


def test_accuracy_line_reads_the_gate_report(script, trained_onnx, tmp_path):
    from llmc.compiler.build import compile_model

    engine = tmp_path / "fp32.plan"
    compile_model(trained_onnx, engine)
    checks = script.Checks()
    script.accuracy(checks, engine, trained_onnx, "trained fp32")
    (status, name, detail), = checks.results
    assert status == "PASS" and ("perplexity +0.00%" in detail or "perplexity -0.00%" in detail), detail


def test_missing_tensorrt_fails_the_run(script, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import raises ImportError
    assert script.main([]) == 1
    out = capsys.readouterr().out
    assert "FAIL tensorrt importable" in out and "0 passed, 1 failed" in out
