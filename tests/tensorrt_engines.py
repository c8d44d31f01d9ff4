"""TensorRT engine files made on a machine without TensorRT: the stand-in of tests/tensorrt_wheel.py
installed as `tensorrt`, and tiny-llama built through `compile_model(backend="tensorrt")` with it.

Fixtures for the tests that build or run such an engine; a test module takes them by importing
them (``from tensorrt_engines import build, built_engine, trt, wheel``). `attention_free` is a
computation for the stand-in's engine whose outputs can be checked from the step's layout alone.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from llmc.compiler.build import compile_model
from llmc.compiler.tensorrt_network import TensorRTOptions

tensorrt_wheel = pytest.importorskip("tensorrt_wheel")
GPU = {"name": "NVIDIA H200", "compute_capability": "9.0"}


@pytest.fixture(scope="module")
def wheel():
    try:
        folder = tensorrt_wheel.wheel_folder()
        tensorrt_wheel.tensorrt_api(folder)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    return folder


@pytest.fixture
def trt(wheel, monkeypatch):
    """The stand-in, installed as `tensorrt` for one test (the plugin registration reset)."""
    pytest.importorskip("triton", reason="triton is not installed (the plugin's registration needs it)")
    from llmc.plugins import tensorrt_plugin

    stub = tensorrt_wheel.StubTensorRT(wheel)
    for name in [m for m in sys.modules if m == "tensorrt" or m.startswith("tensorrt.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorrt", stub)
    register = tensorrt_plugin.register_plugin  # a test may replace it
    register.cache_clear()
    yield stub
    register.cache_clear()
    for name in [m for m in sys.modules if m.startswith("tensorrt.")]:
        del sys.modules[name]


@pytest.fixture
def build(trt, monkeypatch):
    """`compile_(onnx_path, output, **TensorRTOptions)` -> (manifest, progress lines), on `GPU`."""
    from llmc.compiler import tensorrt_build

    monkeypatch.setattr(tensorrt_build, "current_gpu", lambda: GPU)

    def compile_(onnx_path, output, **options):
        lines = []
        manifest = compile_model(onnx_path, output, backend="tensorrt", tensorrt=TensorRTOptions(**options),
                                 progress=lines.append)
        return manifest, lines

    return compile_


@pytest.fixture
def built_engine(build, tiny_llama_onnx, tmp_path):
    """tiny-llama through `compile_model(backend="tensorrt")` with the stand-in."""
    manifest, lines = build(tiny_llama_onnx, tmp_path / "engine.plan", workspace_mb=512, hardware_compatible=True,
                            timing_cache=str(tmp_path / "timing.cache"), max_num_tokens=24)
    return tmp_path / "engine.plan", manifest, lines


def attention_free(description, inputs):
    """What the tests' engine computes, from the step's layout alone: each token's key = its id +
    layer, its value minus that; logits row r: [the slot its attention would write (its
    sequence's cached length + its index), its token id, its position, …]."""
    ids, positions = inputs["input_ids"][0], inputs["position_ids"][0]
    starts, cached = inputs["query_start_loc"], inputs["context_lens"]
    sequence = np.repeat(np.arange(len(cached)), np.diff(starts))
    slots = cached[sequence] + np.arange(len(ids)) - starts[sequence]
    layers = sum(1 for t in description["outputs"] if t["name"].startswith("new_key."))
    shapes = {t["name"]: t["shape"] for t in description["outputs"]}
    out = {}
    for layer in range(layers):
        heads, dim = shapes[f"new_key.{layer}"][1:]
        out[f"new_key.{layer}"] = np.broadcast_to((ids + layer)[:, None, None], (len(ids), heads, dim))
        out[f"new_value.{layer}"] = -out[f"new_key.{layer}"]
    rows = inputs["logits_rows"]
    logits = np.zeros((1, len(rows), shapes["logits"][2]), np.float32)
    logits[0, :, 0], logits[0, :, 1], logits[0, :, 2] = slots[rows], ids[rows], positions[rows]
    out["logits"] = logits
    return out
