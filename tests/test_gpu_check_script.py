"""The GPU check scripts' parts that need no GPU: scripts/gpu_check_tensorrt.py's helpers read what
the CLI prints (run here on onnxruntime engines) and skip without TensorRT; scripts/gpu_check.py
packs a launch as TensorRT does, makes metadata outside the op's contract and says when there
is no device; scripts/gpu_check.sh passes its arguments on. What needs the GPU (the driver
loading the PTX, the launches, the timings) runs only there."""

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return load("gpu_check_tensorrt")


@pytest.fixture(scope="module")
def gpu_check():
    return load("gpu_check")


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


def test_missing_tensorrt_is_skipped_unless_required(script, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import raises ImportError
    assert script.main([]) == 0
    out = capsys.readouterr().out
    assert "SKIP tensorrt: not installed" in out and "0 passed, 0 failed, 1 skipped" in out
    assert script.main(["--require-tensorrt"]) == 1
    assert "FAIL tensorrt: not installed" in capsys.readouterr().out
    assert script.main(["--skip"]) == 0
    assert "SKIP tensorrt: --no-tensorrt" in capsys.readouterr().out


def test_kernel_args_follow_the_kernel_signature(gpu_check):
    """Pointers as 8 bytes and the scalars as int32, in the order the compiled kernel declares
    its parameters (inputs, extra scalars, output: tests/plugins check the PTX has that order)."""
    from llmc.plugins import tensorrt_plugin

    signature = tensorrt_plugin.triton_signature("fp16", "fp32", dict.fromkeys(tensorrt_plugin.INPUT_NAMES[5:], "i64"))
    args = gpu_check.kernel_args([1000 + i for i in range(8)], (3, 5, 37, 20), [2000])
    assert [ctypes.sizeof(a) for a in args] == [8 if kind.startswith("*") else 4 for kind in signature.values()]
    assert [type(a) for a in args] == [ctypes.c_int32 if kind == "i32" else ctypes.c_uint64
                                       for kind in signature.values()]
    assert [a.value for a in args] == [*range(1000, 1008), 3, 5, 37, 20, 2000]
    with pytest.raises(ValueError, match="does not fit int32"):
        gpu_check.kernel_args([0] * 8, (2**31, 0, 0, 0), [0])


def test_aot_launch_passes_the_plugins_launch_to_the_driver(gpu_check):
    """What the check hands cuLaunchKernel: launch_params' grid, block and shared memory, and the
    tensors' addresses around the scalars, on the stream torch uses."""
    torch = pytest.importorskip("torch")
    from llmc.plugins.paged_attention_triton import kernel_config

    inputs, _ = gpu_check.make_batch(torch, np.random.default_rng(0), gpu_check.MIXED, 16, 64, 2, "float16", "cpu")
    out = torch.empty_like(inputs["query"])
    cfg = kernel_config(4, 2, 64, 16, None, fp32=False)
    kernel = {"name": "k", "ptx": ".version 8.0", "threads": 128, "shared": 4096}
    calls = []

    class Driver:
        def load(self, ptx, name):
            calls.append(("load", ptx, name))
            return "function"

        def launch(self, function, launch, stream, args):
            calls.append(("launch", function, launch, stream, [a.value for a in args]))

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        current_stream=lambda: types.SimpleNamespace(cuda_stream=7), synchronize=lambda: None))
    gpu_check.aot_launch(fake_torch, Driver(), inputs, kernel, cfg, out)
    (_, ptx, name), (_, function, launch, stream, args) = calls
    tokens, seqs = sum(n for n, _ in gpu_check.MIXED), len(gpu_check.MIXED)
    assert (ptx, name, function, stream) == (".version 8.0", "k", "function", 7)
    assert launch.grid == (tokens // cfg.block_q + seqs + 1, 2) and (launch.block_x, launch.shared_mem) == (128, 4096)
    order = ("query", "key", "value", "key_cache", "value_cache", "block_tables", "context_lens", "query_start_loc")
    extra = [seqs, inputs["block_tables"].shape[1], tokens, inputs["key_cache"].shape[0]]
    assert args == [inputs[n].data_ptr() for n in order] + extra + [out.data_ptr()]


def test_made_up_metadata_breaks_the_contract(gpu_check):
    rng = np.random.default_rng(0)
    for dtype in (np.int32, np.int64):
        tables, lens, starts = zip(*(gpu_check.made_up_metadata(rng, 3, 2, 10, 4, 16, dtype) for _ in range(20)))
        assert {a.dtype for a in tables + lens + starts} == {np.dtype(dtype)}
        assert tables[0].shape == (3, 2) and lens[0].shape == (3,) and starts[0].shape == (4,)
        tables, lens, starts = (np.concatenate([a.ravel() for a in x]) for x in (tables, lens, starts))
        assert tables.min() == np.iinfo(dtype).min and tables.max() == np.iinfo(dtype).max
        assert (tables == 4).any() and (tables == -1).any()       # one past the pool, just below it
        assert (lens > 2 * 16).any() and (lens < 0).any()          # more than the table holds
        assert (starts > 10).any() and (starts < 0).any()          # past the tokens, below 0


def test_without_a_cuda_device_the_check_says_so(gpu_check, capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert gpu_check.main([]) == 2
    assert "no CUDA device; use --cpu-interpret" in capsys.readouterr().err


def test_gpu_check_sh_passes_its_arguments_on(tmp_path):
    """A stand-in `python` records each call: the kernel check gets --quick unless --full, the
    TensorRT check --skip for --no-tensorrt; a failing part makes the exit status 1."""
    log = tmp_path / "calls"
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exit 0\necho "$@" >> {log}\n'
                    f'case "$1" in *gpu_check_tensorrt.py) exit "${{TENSORRT_EXIT:-0}}";; esac\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}

    def run(*args, **extra_env):
        log.write_text("")
        done = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), *args], env={**env, **extra_env},
                              capture_output=True, text=True, timeout=60)
        return done.returncode, log.read_text().splitlines()

    assert run() == (0, ["scripts/gpu_check.py --quick", "scripts/gpu_check_tensorrt.py"])
    assert run("--full", "--no-timing", "--no-tensorrt") == (
        0, ["scripts/gpu_check.py --no-timing", "scripts/gpu_check_tensorrt.py --skip"])
    assert run("--require-tensorrt", TENSORRT_EXIT="1") == (
        1, ["scripts/gpu_check.py --quick", "scripts/gpu_check_tensorrt.py --require-tensorrt"])


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (llmc[test])")
def test_gpu_check_sh_passes_shellcheck():
    done = subprocess.run(["shellcheck", str(SCRIPTS / "gpu_check.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
