"""The Optimum helper venv works when the suite runs in a fresh venv, not only in a system-wide install.

A fresh `python -m venv` (no system packages) gets only the packages the helper relies on the
running environment for, at the versions the suite runs (torch, onnx, onnxruntime, read with
importlib.metadata); from it `optimum_venv.optimum_python()` builds the helper and Optimum exports
a checkpoint. The helper must import those packages from the fresh venv, never from the base
interpreter's site-packages (what `--system-site-packages` gave it: there, a fresh venv's suite
found no onnx). The export must equal transformers' logits.

Both venvs are cached under $LLMC_TEST_CACHE (first run: ~1-2 min of pip, torch from local disk;
later runs: the export, ~15 s). Skipped, saying why, when pip cannot install them.
"""

import hashlib
import importlib.metadata
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hf_checkpoints import hf_model, write_hf_checkpoint
from optimum_venv import CACHE

TESTS = Path(__file__).parent
# What the helper takes from the running environment (optimum-onnx's own pins come from pip).
SHARED = ("torch", "onnx", "onnxruntime")
ATOL = 1e-4


def _pip(python: Path, *requirements: str) -> None:
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *requirements],
                             capture_output=True, text=True)
    if install.returncode:
        last = (install.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"pip install {' '.join(requirements)} failed: {last}")


@pytest.fixture(scope="module")
def fresh_venv() -> Path:
    """A cached venv without system packages holding only SHARED, at the suite's versions."""
    requirements = [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in SHARED]
    venv = CACHE / f"fresh-venv-{hashlib.sha256(' '.join(requirements).encode()).hexdigest()[:10]}"
    python, ready = venv / "bin" / "python", venv / ".llmc-ready"
    if not ready.is_file():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        _pip(python, *requirements)
        ready.write_text(" ".join(requirements))
    return python


def _in(python: Path, code: str) -> dict:
    run = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=TESTS)
    if "ExporterUnavailable" in run.stderr:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_optimum_helper_built_from_a_fresh_venv_exports_transformers_logits(fresh_venv, tmp_path):
    outer = _in(fresh_venv, "import json, sys; print(json.dumps({'prefix': sys.prefix, 'base': sys.base_prefix}))")
    # The fresh venv itself lacks what the suite's environment has beyond SHARED.
    missing = subprocess.run([str(fresh_venv), "-c", "import transformers"], capture_output=True)
    assert missing.returncode != 0
    helper = Path(_in(fresh_venv, "import json, optimum_venv; print(json.dumps(str(optimum_venv.optimum_python())))"))
    seen = _in(helper, "import json, sys, onnx, onnxruntime, torch, transformers, optimum.exporters.onnx; "
                       "print(json.dumps({'path': sys.path, 'transformers': transformers.__version__, "
                       "**{m.__name__: m.__file__ for m in (onnx, onnxruntime, torch)}}))")
    for name in SHARED:
        assert seen[name].startswith(outer["prefix"]), f"{name} from {seen[name]}, not the fresh venv"
    base_site = sysconfig.get_paths(vars={"base": outer["base"], "platbase": outer["base"]})["purelib"]
    assert base_site not in seen["path"]
    assert seen["transformers"].startswith("4.57.")

    folder = write_hf_checkpoint(tmp_path / "llama", "llama")
    out = tmp_path / "optimum"
    run = subprocess.run([str(helper), str(TESTS / "optimum_export.py"), str(folder), str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    model = hf_model(folder)
    ids = np.array([[5, 17, 99, 3, 250]], np.int64)
    config = model.config
    empty = np.zeros((1, config.num_key_value_heads, 0, config.head_dim), np.float32)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(5)[None]}
    feeds.update({i.name: empty for i in session.get_inputs() if i.name.startswith("past_key_values.")})
    logits = session.run(["logits"], feeds)[0]
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(logits, want, atol=ATOL, rtol=0)
