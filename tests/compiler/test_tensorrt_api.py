"""The TensorRT path against the real TensorRT 11.4 Python API, on a machine without TensorRT.

The bindings wheel of TensorRT 11.4 is downloaded (tests/tensorrt_wheel.py; skipped with the
reason when the registry is unreachable). Its compiled core cannot load here, so a stand-in
replaces exactly that: every name asked of it must be one the 11.4 bindings define. Through it:

- llmc's plugin registers under the wheel's real ``tensorrt.plugin`` package, whose own
  registration-time validation checks the descriptor, the AOT and the JIT implementations;
- `llmc compile --backend tensorrt` runs its whole build through Polygraphy's loaders;
- the runtime backend loads an engine, binds the pool and the step's tensors, runs steps whose
  outputs a fake execution writes, and stores new keys and values in the right pool slots;
- every ``trt.X.Y`` the TensorRT modules name exists in 11.4.

None of this runs TensorRT: scripts/gpu_check.sh does, on a GPU machine.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import llmc
from llmc.compiler.build import compile_model
from llmc.compiler.tensorrt_network import PLUGIN_ATTRIBUTES, TensorRTOptions
from llmc.errors import LlmcError
from llmc.formats.engine_file import read_engine
from llmc.formats.manifest import TensorRTBuild
from llmc.plugins.paged_attention import PLUGIN_ID, PagedBatch

tensorrt_wheel = pytest.importorskip("tensorrt_wheel")
TENSORRT_MODULES = ("compiler/tensorrt_build.py", "plugins/tensorrt_plugin.py", "runtime/backends/tensorrt.py")


@pytest.fixture(scope="module")
def wheel():
    try:
        return tensorrt_wheel.wheel_folder()
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def trt(wheel, monkeypatch):
    """The stand-in, installed as `tensorrt` for one test (the plugin registration reset)."""
    from llmc.plugins import tensorrt_plugin

    stub = tensorrt_wheel.StubTensorRT(wheel)
    for name in [m for m in sys.modules if m == "tensorrt" or m.startswith("tensorrt.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorrt", stub)
    tensorrt_plugin.register_plugin.cache_clear()
    yield stub
    tensorrt_plugin.register_plugin.cache_clear()
    for name in [m for m in sys.modules if m.startswith("tensorrt.")]:
        del sys.modules[name]


def test_the_stand_in_refuses_names_tensorrt_11_4_lacks(trt):
    assert trt.Builder and trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS
    with pytest.raises(AttributeError, match="no NetworkDefinitionCreationFlag.EXPLICIT_BATCH"):
        trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH  # removed in TensorRT 10
    with pytest.raises(AttributeError, match="no BuilderFlag.FP16_STRICT"):
        trt.BuilderFlag.FP16_STRICT


def test_every_tensorrt_name_llmc_uses_exists_in_11_4(wheel):
    names = tensorrt_wheel.api_names(wheel)
    root = Path(llmc.__file__).parent
    used = set()
    for module in TENSORRT_MODULES:
        for node in ast.walk(ast.parse((root / module).read_text())):
            chain = []
            while isinstance(node, ast.Attribute):
                chain.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id == "trt" and chain and not chain[-1].startswith("__"):
                used.add(".".join(reversed(chain)))  # (__version__ is the Python package's)
    assert len(used) >= 15, used  # the modules do use TensorRT
    missing = sorted(u for u in used if not all(part in names for part in u.split(".")))
    assert not missing, f"not in TensorRT 11.4: {missing}"


def test_plugin_registers_under_the_real_tensorrt_plugin_package(trt):
    from llmc.plugins.tensorrt_plugin import INPUT_NAMES, register_plugin

    register_plugin()
    from tensorrt.plugin._lib import QDP_REGISTRY

    plugin = QDP_REGISTRY[PLUGIN_ID]
    assert list(plugin.input_tensor_names) == list(INPUT_NAMES)
    # The attributes the parser hands the plugin are those map_plugin_nodes writes on its nodes.
    assert set(plugin.input_attrs) == set(PLUGIN_ATTRIBUTES)
    assert plugin.aot_impl_func is not None and plugin.impl_func is not None
    assert [(args[1]) for args in trt.registered] == ["llmc"]  # the creator, in llmc's namespace


def test_the_real_validation_runs(trt):
    import tensorrt.plugin as trtp

    # Defined without this file's postponed annotations: the validator reads real types.
    source = ("def descriptor(x: trtp.TensorDesc, scale: float = 1.0) -> trtp.TensorDesc:\n"
              "    return x.like()\n")
    namespace = {"trtp": trtp}
    exec(compile(source, "descriptor", "exec", dont_inherit=True), namespace)
    with pytest.raises(ValueError, match="Argument scale has a default value"):
        trtp.register("llmc_test::with_default")(namespace["descriptor"])


def _fake_network(trt, model_inputs):
    """What the parser would have made: a network with the graph's inputs (Polygraphy checks the
    profile's names against them), and a timing cache Polygraphy can save."""
    inputs = [types.SimpleNamespace(name=v.name, is_shape_tensor=False, dtype=trt.float32,
                                    shape=tuple(d.dim_value or -1 for d in v.type.tensor_type.shape.dim))
              for v in model_inputs]
    trt.overrides["Builder().create_network().num_inputs"] = len(inputs)
    trt.overrides["Builder().create_network().get_input"] = inputs.__getitem__
    trt.overrides["Builder().create_builder_config().get_timing_cache().serialize"] = \
        lambda: contextlib.nullcontext(b"timing cache")


@pytest.fixture
def built_engine(trt, tiny_llama_onnx, tmp_path, monkeypatch):
    """tiny-llama through `compile_model(backend="tensorrt")` with the stand-in; the engine's
    TensorRT section is what the stand-in serialized (empty)."""
    from llmc.compiler import tensorrt_build

    monkeypatch.setattr(tensorrt_build, "current_gpu", lambda: {"name": "NVIDIA H200", "compute_capability": "9.0"})
    real_build = tensorrt_build.build_engine

    def build_engine(model, profile, options, progress):
        _fake_network(trt, model.graph.input)
        return real_build(model, profile, options, progress)

    monkeypatch.setattr(tensorrt_build, "build_engine", build_engine)
    lines = []
    manifest = compile_model(tiny_llama_onnx, tmp_path / "engine.plan", backend="tensorrt",
                             tensorrt=TensorRTOptions(workspace_mb=512, hardware_compatible=True,
                                                      timing_cache=str(tmp_path / "timing.cache"), max_num_tokens=256),
                             progress=lines.append)
    return tmp_path / "engine.plan", manifest, lines


def test_compile_builds_through_polygraphy_with_the_options_asked(built_engine, trt):
    path, manifest, lines = built_engine
    for name in ("NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS", "MemoryPoolType.WORKSPACE",
                 "HardwareCompatibilityLevel.AMPERE_PLUS", "ProfilingVerbosity.DETAILED",
                 "Builder().create_optimization_profile().set_shape", "Builder().build_serialized_network",
                 "OnnxParser().parse_from_file"):
        assert name in trt.used, name
    assert "BuilderFlag.VERSION_COMPATIBLE" not in trt.used  # not asked
    assert (path.parent / "timing.cache").read_bytes() == b"timing cache"
    assert any(line.startswith("building the TensorRT engine") for line in lines)
    engine = read_engine(path)
    assert {s.name for s in engine.manifest.sections} == {"engine.trt", "tokenizer.json"}
    assert engine.manifest.tensorrt == TensorRTBuild(
        version=tensorrt_wheel.VERSION, gpu="NVIDIA H200", compute_capability="9.0",
        plugins={PLUGIN_ID: "1"}, hardware_compatible=True, version_compatible=False, optimization_level=3,
        max_num_tokens=256, build_s=manifest["tensorrt"]["build_s"])


def test_parser_errors_fail_the_build_with_nothing_written(trt, tiny_llama_onnx, tmp_path, monkeypatch):
    from llmc.compiler import tensorrt_build

    monkeypatch.setattr(tensorrt_build, "current_gpu", lambda: {"name": "x", "compute_capability": "9.0"})
    trt.overrides["OnnxParser().parse_from_file"] = lambda path: False
    trt.overrides["OnnxParser().num_errors"] = 1
    trt.overrides["OnnxParser().get_error"] = lambda i: "In node 3 (paged_attention): Plugin not found"
    with pytest.raises(LlmcError, match="parser rejected the graph: In node 3 .*Plugin not found"):
        compile_model(tiny_llama_onnx, tmp_path / "engine.plan", backend="tensorrt")
    assert list(tmp_path.iterdir()) == []


def test_a_tensorrt_engine_without_tensorrt_gets_one_line_naming_the_extra(built_engine, monkeypatch):
    from click.testing import CliRunner

    from llmc.cli import main

    path, _, _ = built_engine
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # not installed
    result = CliRunner().invoke(main, ["run", str(path), "--prompt", "hi"])
    assert result.exit_code == 2
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and "TensorRT engine" in errors[0] and "llmc[tensorrt]" in errors[0], errors
    assert result.stdout == ""


def test_no_gpu_fails_before_building(trt, tiny_llama_onnx, tmp_path, monkeypatch):
    from llmc.compiler import tensorrt_build

    def no_gpu():
        raise LlmcError("--backend tensorrt: no NVIDIA GPU found (neither torch.cuda nor nvidia-smi sees one)")

    monkeypatch.setattr(tensorrt_build, "current_gpu", no_gpu)
    with pytest.raises(LlmcError, match="no NVIDIA GPU"):
        compile_model(tiny_llama_onnx, tmp_path / "engine.plan", backend="tensorrt")
    assert "Builder" not in trt.used and list(tmp_path.iterdir()) == []


# The fixture's engine is built hardware-compatible: any Ampere-or-newer GPU runs it.
@pytest.mark.parametrize("gpu, runs", [(None, False), ("9.0", True), ("8.0", True), ("7.5", False)])
def test_deploy_check_of_a_tensorrt_engine(built_engine, monkeypatch, gpu, runs):
    from llmc.plugins import cuda_device
    from llmc.runtime.deploy_check import deploy_checks

    path, _, _ = built_engine

    def current_gpu():
        if gpu is None:
            raise LlmcError("no NVIDIA GPU found (neither torch.cuda nor nvidia-smi sees one)")
        return {"name": "NVIDIA X", "compute_capability": gpu}

    monkeypatch.setattr(cuda_device, "current_gpu", current_gpu)
    checks = deploy_checks(str(path))
    assert all(c["ok"] for c in checks) == runs, checks
    if not runs:
        detail = checks[-1]["detail"]
        assert ("no NVIDIA GPU" in detail) if gpu is None else ("NVIDIA H200 (compute capability 9.0)" in detail
                                                                 and "NVIDIA X (7.5)" in detail)


class _FakeExecution:
    """TensorRT's engine and execution context as the runtime backend calls them: shapes follow
    the bound inputs, and a step writes outputs derived from its inputs (keys = token id + layer,
    values = minus that, logits row r = its row index), through the bound addresses."""

    def __init__(self, geometry, block_size, trt):
        self.g, self.trt = geometry, trt
        self.names = (["input_ids", "position_ids", "block_tables", "context_lens", "query_start_loc", "logits_rows"]
                      + [f"{p}_cache.{i}" for i in range(geometry.num_layers) for p in ("key", "value")]
                      + ["logits"] + [f"new_{p}.{i}" for i in range(geometry.num_layers) for p in ("key", "value")])
        self.shapes, self.addresses = {}, {}

    # ICudaEngine
    num_io_tensors = property(lambda self: len(self.names))

    def get_tensor_name(self, index):
        return self.names[index]

    def get_tensor_mode(self, name):
        output = name == "logits" or name.startswith("new_")
        return self.trt.TensorIOMode.OUTPUT if output else self.trt.TensorIOMode.INPUT

    def get_tensor_dtype(self, name):
        return self.trt.float32

    def create_execution_context(self):
        return self

    # IExecutionContext
    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, address):
        self.addresses[name] = address
        return True

    def get_tensor_shape(self, name):
        tokens, seqs = self.shapes["input_ids"][1], self.shapes["logits_rows"][0]
        return (1, seqs, self.g.vocab_size) if name == "logits" else (tokens, self.g.num_kv_heads, self.g.head_dim)

    def execute_async_v3(self, stream_handle):
        ids = self._array("input_ids", np.int64, self.shapes["input_ids"])[0]
        rows = self._array("logits_rows", np.int64, self.shapes["logits_rows"])
        for layer in range(self.g.num_layers):
            for part, sign in (("key", 1), ("value", -1)):
                out = self._array(f"new_{part}.{layer}", np.float32, self.get_tensor_shape("new_key.0"))
                out[:] = sign * (ids + layer)[:, None, None]
        self._array("logits", np.float32, self.get_tensor_shape("logits"))[0] = rows[:, None]
        return True

    def _array(self, name, dtype, shape):
        count = int(np.prod(shape))
        buffer = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(self.addresses[name])
        return np.frombuffer(buffer, dtype).reshape(shape)


def test_runtime_binds_runs_and_stores_keys_in_their_slots(built_engine, trt, wheel):
    from llmc.runtime.backends.tensorrt import TensorRTDecoder

    path, _, _ = built_engine
    engine = read_engine(path)
    fake = _FakeExecution(engine.manifest.geometry, engine.manifest.paged.block_size, trt)
    names = tensorrt_wheel.api_names(wheel)
    assert all(n in names for n in ("num_io_tensors", "get_tensor_name", "get_tensor_mode", "get_tensor_dtype",
                                    "create_execution_context", "set_input_shape", "set_tensor_address",
                                    "get_tensor_shape", "execute_async_v3"))  # the fake mirrors real names
    trt.overrides["Runtime().deserialize_cuda_engine"] = lambda data: fake
    decoder = TensorRTDecoder(engine, kv_pool_mb=4, device="cpu")
    assert set(fake.addresses) == set(decoder.pools)  # the pool is bound once, at load
    block = decoder.block_size
    # Two sequences: 3 new tokens after 5 cached (blocks 4, 7), and one decode after block_size cached (2, 3).
    batch = PagedBatch(np.array([[4, 7], [2, 3]]), np.array([5, block]), np.array([0, 3, 4]))
    tokens = np.array([10, 11, 12, 20])
    logits = decoder.step(tokens, np.array([5, 6, 7, block]), batch)
    np.testing.assert_array_equal(logits, np.array([[2.0], [3.0]]) * np.ones((1, engine.manifest.geometry.vocab_size)))
    key = decoder.pools["key_cache.1"].numpy()
    value = decoder.pools["value_cache.0"].numpy()
    assert key[4, 0, 5, 0] == 11 and key[4, 0, 6, 0] == 12 and key[4, 0, 7, 0] == 13 and key[3, 0, 0, 0] == 21
    assert value[4, 0, 5, 0] == -10 and value[3, 0, 0, 0] == -20
    assert np.count_nonzero(key[:, 0, :, 0]) == 4  # nothing else written
    decoder.copy_blocks([(4, 9)])
    np.testing.assert_array_equal(decoder.pools["key_cache.1"].numpy()[9], key[4])


@pytest.mark.parametrize("build, here, message", [
    (dict(version="11.4.0.106"), ("11.5.0.1", "9.0"), "built with TensorRT 11.4.0.106, this machine has 11.5.0.1"),
    (dict(version="11.4.0.106", version_compatible=True), ("12.0.0.1", "9.0"), "this machine has 12.0.0.1"),
    (dict(compute_capability="9.0"), ("11.4.0.106", "8.9"), "built for NVIDIA H200 (compute capability 9.0)"),
    (dict(compute_capability="9.0", hardware_compatible=True), ("11.4.0.106", "7.5"), "compute capability 9.0"),
])
def test_an_engine_for_another_gpu_or_tensorrt_is_refused_naming_both(build, here, message):
    from llmc.runtime.backends.tensorrt import check_compatible

    fields = dict(version="11.4.0.106", gpu="NVIDIA H200", compute_capability="9.0", plugins={},
                  hardware_compatible=False, version_compatible=False, optimization_level=3, max_num_tokens=1,
                  build_s=1.0)
    with pytest.raises(LlmcError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_compatible(TensorRTBuild(**{**fields, **build}), here[0], {"name": "GPU", "compute_capability": here[1]},
                         "e.plan")
    # Built compatible where that is allowed, the same pairs load.
    relaxed = {**fields, **build, "version_compatible": True, "hardware_compatible": True}
    if here[0].startswith("11.") and float(here[1]) >= 8.0:
        check_compatible(TensorRTBuild(**relaxed), here[0], {"name": "GPU", "compute_capability": here[1]}, "e.plan")


def test_current_gpu_names_what_is_missing_without_one():
    import shutil

    import torch

    from llmc.plugins.cuda_device import current_gpu

    if torch.cuda.is_available() or shutil.which("nvidia-smi"):
        gpu = current_gpu()
        assert gpu["name"] and float(gpu["compute_capability"]) > 0
    else:
        with pytest.raises(LlmcError, match="no NVIDIA GPU found"):
            current_gpu()
