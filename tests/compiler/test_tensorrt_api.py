"""The TensorRT path against TensorRT 11.4 itself, on a machine without TensorRT.

The bindings wheel of TensorRT 11.4 is downloaded (tests/tensorrt_wheel.py; skipped with the
reason when the registry is unreachable or objdump is missing). Its compiled core cannot load
without TensorRT's libraries; the stand-in replaces exactly that, and refuses what TensorRT refuses:

- the API map read from the bindings' registration code: members on their class, values on
  their enum, keywords among the method's argument names; every ``trt.X.Y`` llmc names, and every
  method of the stand-in's core, is checked against it;
- `llmc compile --backend tensorrt` through Polygraphy and the stand-in's parser and builder:
  what was built (inputs, dimension names, profile, flags) read back from the engine; a refused
  layer, an unregistered plugin, a profile TensorRT would reject, each failing in one line;
- the runtime backend on the stand-in's engine: shapes inside the profile, equally named
  dimensions equal, every address bound, types as the engine has them; steps larger than the
  profile split; the pool capped at the profile.

None of this runs TensorRT: scripts/gpu_check.sh does what it can on a GPU machine.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import llmc
from llmc.compiler.build import compile_model
from llmc.compiler.tensorrt_network import PLUGIN_ATTRIBUTES
from llmc.errors import LlmcError
from llmc.formats.engine_file import read_engine
from llmc.formats.manifest import TensorRTBuild
from llmc.plugins.paged_attention import PLUGIN_ID, PagedBatch
from paged_cases import Stepper
from tensorrt_engines import attention_free, build, built_engine, trt, wheel  # noqa: F401 (fixtures)

tensorrt_wheel = pytest.importorskip("tensorrt_wheel")
TENSORRT_MODULES = ("compiler/tensorrt_build.py", "plugins/tensorrt_plugin.py", "runtime/backends/tensorrt.py")


# --- The map and the stand-in refuse what TensorRT 11.4 lacks ------------------------------------------

def test_the_map_places_members_on_their_class(wheel):
    api = tensorrt_wheel.tensorrt_api(wheel)
    # The 11.4 docstrings: set_input_shape is the context's, the profile's shapes are the engine's.
    assert "set_input_shape" in api.members("IExecutionContext") and "set_input_shape" not in api.members("ICudaEngine")
    assert "get_tensor_profile_shape" in api.members("ICudaEngine")
    assert "get_tensor_profile_shape" not in api.members("IExecutionContext")
    assert api.enums["TensorIOMode"] == {"NONE", "INPUT", "OUTPUT"}
    assert {"PREFER_AOT_PYTHON_PLUGINS", "STRONGLY_TYPED"} <= api.enums["NetworkDefinitionCreationFlag"]
    assert "EXPLICIT_BATCH" not in api.enums["NetworkDefinitionCreationFlag"]  # removed in TensorRT 10
    assert api.arguments("IOptimizationProfile", "set_shape") == [["input", "max", "min", "opt"]]
    assert api.arguments("IPluginRegistry", "get_creator") == [["plugin_namespace", "type", "version"]]
    assert api.bases["Logger"] == {"ILogger"} and "WARNING" in api.members("Logger")  # exported severities
    assert "constant_value" not in api.members("IDimensionExpr")  # get_constant_value is


def test_the_stand_in_refuses_what_tensorrt_11_4_lacks(trt):
    assert trt.Builder and trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS
    with pytest.raises(AttributeError, match="no EXPLICIT_BATCH"):
        trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH
    with pytest.raises(AttributeError, match="TensorRT 11.4's BuilderFlag has no FP16_STRICT"):
        trt.BuilderFlag.FP16_STRICT
    with pytest.raises(AttributeError, match="TensorRT 11.4's IExecutionContext has no get_tensor_profile_shape"):
        trt.IExecutionContext.get_tensor_profile_shape
    with pytest.raises(AttributeError, match="TensorIOMode has no WORKSPACE"):
        trt.TensorIOMode.WORKSPACE  # a member of another enum (MemoryPoolType)
    config = trt.Builder(trt.Logger(trt.Logger.WARNING)).create_builder_config()
    with pytest.raises(TypeError, match="set_shape takes no keyword maximum"):
        trt.IOptimizationProfile.set_shape(None, input="x", min=(1,), opt=(1,), maximum=(2,))  # the binding's: max
    with pytest.raises(AttributeError, match="IBuilderConfig has no attribute fp16 to set"):
        config.fp16 = True  # TensorRT 11 has no weakly typed precision flags
    assert trt.float16 is trt.DataType.HALF and str(trt.int8) == "DataType.INT8"


def test_every_tensorrt_name_llmc_uses_is_a_member_of_its_class(trt):
    root = Path(llmc.__file__).parent
    chains = set()
    for module in TENSORRT_MODULES:
        for node in ast.walk(ast.parse((root / module).read_text())):
            chain = []
            while isinstance(node, ast.Attribute):
                chain.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id == "trt" and chain and not chain[-1].startswith("__"):
                chains.add(tuple(reversed(chain)))
    assert len(chains) >= 20, chains  # the modules do use TensorRT
    for chain in sorted(chains):
        value = trt
        for name in chain:
            value = getattr(value, name)  # AttributeError names what TensorRT 11.4 lacks
    assert not {u for u in trt.unmapped if u.split(".")[0] in {c[0] for c in chains}}, trt.unmapped


def test_the_stand_in_core_has_only_members_and_argument_names_of_11_4(trt):
    api = trt.api
    for name, fake in trt.fakes.items():
        for member, value in vars(fake).items():
            if member.startswith("_"):
                continue
            assert member in api.members(name), f"{name}.{member} is not TensorRT 11.4's"
            overloads = api.arguments(name, member)
            if callable(value) and overloads:
                params = {p for p in inspect.signature(value).parameters if p != "self"}
                assert any(params <= set(args) for args in overloads), f"{name}.{member}{params}: 11.4 has {overloads}"


def test_plugin_registers_under_the_real_tensorrt_plugin_package(trt):
    from llmc.plugins.tensorrt_plugin import INPUT_NAMES, register_plugin

    register_plugin()
    from tensorrt.plugin._lib import QDP_REGISTRY

    plugin = QDP_REGISTRY[PLUGIN_ID]
    assert list(plugin.input_tensor_names) == list(INPUT_NAMES)
    # The attributes the parser hands the plugin are those map_plugin_nodes writes on its nodes.
    assert set(plugin.input_attrs) == set(PLUGIN_ATTRIBUTES)
    assert plugin.aot_impl_func is not None and plugin.impl_func is not None
    assert [namespace for _, namespace in trt.registered] == ["llmc"]  # the creator, in llmc's namespace


def test_the_real_validation_runs(trt):
    import tensorrt.plugin as trtp

    # Defined without this file's postponed annotations: the validator reads real types.
    source = ("def descriptor(x: trtp.TensorDesc, scale: float = 1.0) -> trtp.TensorDesc:\n"
              "    return x.like()\n")
    namespace = {"trtp": trtp}
    exec(compile(source, "descriptor", "exec", dont_inherit=True), namespace)
    with pytest.raises(ValueError, match="Argument scale has a default value"):
        trtp.register("llmc_test::with_default")(namespace["descriptor"])


# --- The stand-in's builder and engine refuse what TensorRT refuses --------------------------------------

def _two_inputs(tmp_path, dims) -> str:
    values = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [d, 8]) for name, d in zip("ab", dims)]
    graph = helper.make_graph([helper.make_node("Concat", ["a", "b"], ["y"], name="concat", axis=0)], "g", values,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 8])])
    path = tmp_path / "two.onnx"
    onnx.save(helper.make_model(graph), path)
    return str(path)


def _logger(trt):
    errors = []

    class Logger(trt.ILogger):
        def log(self, severity, msg):
            errors.append(msg)

    return Logger(), errors


def _build(trt, path, ranges):
    logger, errors = _logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    assert trt.OnnxParser(network, logger).parse_from_file(path)
    config, profile = builder.create_builder_config(), builder.create_optimization_profile()
    for name, (low, high) in ranges.items():
        profile.set_shape(name, (low, 8), (low, 8), (high, 8))
    config.add_optimization_profile(profile)
    return builder.build_serialized_network(network, config), errors, logger


def test_equally_named_dimensions_must_overlap_in_the_profile_and_agree_at_run_time(trt, tmp_path):
    """NVIDIA's sampleNamedDimensions: "TensorRT supports this feature by checking that in the
    optimization profile these dimensions have overlapping intervals and that at runtime they
    have the same value"."""
    path = _two_inputs(tmp_path, ["n", "n"])
    plan, errors, _ = _build(trt, path, {"a": (1, 4), "b": (8, 16)})
    assert plan is None and "named 'n'" in errors[-1]
    plan, errors, logger = _build(trt, path, {"a": (1, 16), "b": (1, 16)})
    engine = trt.Runtime(logger).deserialize_cuda_engine(bytes(plan))
    context = engine.create_execution_context()
    assert not context.set_input_shape("a", (17, 8))  # past the profile's max
    assert "outside the profile" in errors[-1]
    buffers = {name: np.zeros((4, 8), np.float32) for name in ("a", "b", "y")}
    trt.execute = lambda description, inputs: {"y": np.concatenate([inputs["a"], inputs["b"]])[:4]}
    assert context.set_input_shape("a", (2, 8)) and context.set_input_shape("b", (3, 8))
    for name, array in buffers.items():
        context.set_tensor_address(name, array.ctypes.data)
    assert not context.execute_async_v3(0) and "dimensions named 'n' must be equal" in errors[-1]
    assert context.set_input_shape("b", (2, 8)) and context.execute_async_v3(0)


def test_an_input_without_a_shape_or_address_fails_the_step(trt, tmp_path):
    plan, errors, logger = _build(trt, _two_inputs(tmp_path, ["n", "m"]), {"a": (1, 4), "b": (1, 4)})
    context = trt.Runtime(logger).deserialize_cuda_engine(bytes(plan)).create_execution_context()
    trt.execute = lambda description, inputs: {}
    assert context.set_input_shape("a", (1, 8)) and not context.execute_async_v3(0)
    assert "input shapes not specified: b" in errors[-1]
    assert context.set_input_shape("b", (1, 8)) and not context.execute_async_v3(0)
    assert "no address set" in errors[-1]


# --- llmc compile --backend tensorrt through Polygraphy and the stand-in ----------------------------------

def test_compile_builds_what_the_graph_and_options_ask(built_engine, trt):
    path, manifest, lines = built_engine
    engine = read_engine(path)
    built = json.loads(bytes(engine.sections["engine.trt"]))
    assert built["creation_flags"] == ["PREFER_AOT_PYTHON_PLUGINS"] and built["builder_flags"] == []
    assert "AMPERE_PLUS" in built["hardware_compatibility_level"]
    from llmc.plugins.tensorrt_plugin import ptx_capability
    assert ptx_capability() == 80  # the plugin's PTX runs on every GPU the engine may meet
    inputs = {t["name"]: t for t in built["inputs"]}
    assert inputs["input_ids"]["dims"] == [None, "tokens"] and inputs["logits_rows"]["dims"] == ["rows"]
    assert inputs["context_lens"]["dims"] == ["seqs"] and inputs["key_cache.0"]["dims"][0] == "blocks"
    assert built["profile"]["input_ids"] == [[1, 1], [1, 24], [1, 24]]  # min(max_batch, max_num_tokens) decodes
    assert built["profile"]["logits_rows"] == [[1], [24], [24]]
    assert sum(1 for _, op in built["layers"] if op == "paged_attention") == engine.manifest.geometry.num_layers
    assert (path.parent / "timing.cache").read_bytes() == b"timing cache"
    assert any(line.startswith("building the TensorRT engine") for line in lines)
    assert {s.name for s in engine.manifest.sections} == {"engine.trt", "tokenizer.json"}
    assert engine.manifest.tensorrt == TensorRTBuild(
        version=tensorrt_wheel.VERSION, gpu="NVIDIA H200", compute_capability="9.0",
        plugins={PLUGIN_ID: "1"}, hardware_compatible=True, version_compatible=False, optimization_level=3,
        max_num_tokens=24, build_s=manifest["tensorrt"]["build_s"])


def test_version_compatible_sets_the_builder_flag(build, tiny_llama_onnx, tmp_path, monkeypatch):
    build(tiny_llama_onnx, tmp_path / "e.plan", version_compatible=True)
    built = json.loads(bytes(read_engine(tmp_path / "e.plan").sections["engine.trt"]))
    assert built["builder_flags"] == ["VERSION_COMPATIBLE"] and built["hardware_compatibility_level"] is None
    from llmc.plugins import tensorrt_plugin
    monkeypatch.setattr(tensorrt_plugin, "current_gpu", lambda: {"compute_capability": "8.9"})
    assert tensorrt_plugin.ptx_capability() == 89  # not hardware-compatible: the build GPU's own architecture


def test_a_layer_the_builder_refuses_is_named_in_one_line(build, trt, tiny_llama_onnx, tmp_path):
    trt.refuse_layers["paged.1/PagedAttention"] = "no kernel for these types"
    with pytest.raises(LlmcError) as error:
        build(tiny_llama_onnx, tmp_path / "e.plan")
    message = str(error.value)
    assert message.startswith("--backend tensorrt: TensorRT refused layer paged.1/PagedAttention: ")
    assert "no kernel for these types" in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_the_cli_prints_a_refused_build_as_one_line(build, trt, tiny_llama_onnx, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from llmc.cli import main

    trt.refuse_layers["paged.0/PagedAttention"] = "no kernel"
    result = CliRunner().invoke(main, ["compile", str(tiny_llama_onnx), "-o", str(tmp_path / "e.plan"),
                                       "--backend", "tensorrt"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("llmc:")]
    assert errors[-1].startswith("llmc: error: --backend tensorrt: TensorRT refused layer paged.0/PagedAttention")
    assert "internal error" not in result.stderr


def test_a_plugin_not_registered_before_parsing_fails_naming_it(build, trt, tiny_llama_onnx, tmp_path, monkeypatch):
    from llmc.compiler import tensorrt_build

    monkeypatch.setattr("llmc.plugins.tensorrt_plugin.register_plugin", lambda: None)
    with pytest.raises(LlmcError, match=r"parser rejected the graph: In node paged.0/PagedAttention: Plugin not "
                                        r"found: llmc::paged_attention \(and 3 more\)"):
        build(tiny_llama_onnx, tmp_path / "e.plan")
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


# --- The runtime backend on the stand-in's engine -------------------------------------------------------

@pytest.fixture
def decoder(built_engine, trt):
    from llmc.runtime.backends.registry import attach_cache
    from llmc.runtime.backends.tensorrt import TensorRTBackend

    trt.execute = attention_free
    path, _, _ = built_engine
    engine = read_engine(path)
    backend = TensorRTBackend(engine, device="cpu")
    return Stepper(backend, attach_cache(backend, engine, kv_pool_mb=1000))


def test_runtime_binds_runs_and_stores_keys_in_their_slots(decoder):
    block = decoder.backend.block_size
    # Two sequences: 3 new tokens after 5 cached (blocks 4, 7), and one decode after block_size cached (2, 3).
    batch = PagedBatch(np.array([[4, 7], [2, 3]]), np.array([5, block]), np.array([0, 3, 4]))
    logits = decoder.step(np.array([10, 11, 12, 20]), np.array([5, 6, 7, block]), batch)
    np.testing.assert_array_equal(logits[:, :3], [[7, 12, 7], [block, 20, block]])  # each sequence's last token
    key, value = decoder.backend.pools["key_cache.1"].numpy(), decoder.backend.pools["value_cache.0"].numpy()
    assert key[4, 0, 5, 0] == 11 and key[4, 0, 6, 0] == 12 and key[4, 0, 7, 0] == 13 and key[3, 0, 0, 0] == 21
    assert value[4, 0, 5, 0] == -10 and value[3, 0, 0, 0] == -20
    assert np.count_nonzero(key[:, 0, :, 0]) == 4  # nothing else written
    decoder.kv.copy_blocks([(4, 9)])
    np.testing.assert_array_equal(decoder.backend.pools["key_cache.1"].numpy()[9], key[4])


def test_logits_of_every_token_of_one_sequence(decoder):
    """`Engine.logits` (llmc check) asks for more rows than sequences: with logits_rows named
    like the sequences, TensorRT would refuse the step."""
    ids = np.arange(100, 110)
    batch = PagedBatch(np.array([[0]]), np.array([0]), np.array([0, 10]))
    logits = decoder.step(ids, np.arange(10), batch, rows=np.arange(10))
    np.testing.assert_array_equal(logits[:, :3], np.stack([np.arange(10), ids, np.arange(10)], axis=1))


def test_a_step_larger_than_the_profile_runs_as_pieces_in_order(decoder):
    """The engine takes 24 tokens (max_num_tokens) and 64 sequences: a 40-token prompt beside two
    decodes runs as two pieces, the second reading what the first stored."""
    table = np.array([[1, 2, 3], [5, 6, 7], [8, 9, 10]])
    batch = PagedBatch(table, np.array([3, 0, 17]), np.array([0, 1, 41, 42]))
    ids = np.concatenate([[7], np.arange(200, 240), [9]])
    positions = np.concatenate([[3], np.arange(40), [17]])
    rows = np.array([0, 10, 40, 41])
    logits = decoder.step(ids, positions, batch, rows=rows)
    np.testing.assert_array_equal(logits[:, 0], positions[rows])  # every token's slot is its position
    np.testing.assert_array_equal(logits[:, 1], ids[rows])
    key = decoder.backend.pools["key_cache.0"].numpy()[:, 0, :, 0]
    assert decoder.backend.block_size == 16
    stored = np.concatenate([key[5], key[6], key[7]])[:40]
    np.testing.assert_array_equal(stored, np.arange(200, 240))  # the whole prompt, in its slots


def test_the_pool_is_capped_at_the_profile_and_types_checked(decoder, built_engine, trt):
    from llmc.runtime.backends.tensorrt import TensorRTBackend

    path, _, _ = built_engine
    profile = json.loads(bytes(read_engine(path).sections["engine.trt"]))["profile"]
    assert decoder.kv.num_blocks == profile["key_cache.0"][2][0]  # 1000 MiB asked
    trt.execute = attention_free
    engine = read_engine(path)
    described = json.loads(bytes(engine.sections["engine.trt"]))
    described["inputs"][0]["dtype"] = "INT32"  # an engine built from another graph
    engine.sections["engine.trt"] = json.dumps(described).encode()
    with pytest.raises(LlmcError, match="the engine's input input_ids is DataType.INT32; this runtime binds DataType.INT64"):
        TensorRTBackend(engine, device="cpu")


def test_a_shape_outside_the_profile_is_one_line_naming_the_input_and_range(decoder):
    table = np.zeros((1, 40), np.int64)  # wider than max_seq_len / block_size
    with pytest.raises(LlmcError, match=r"input block_tables of shape \[1, 40\] is outside the engine's profile "
                                        r"\(min \[1, 1\], max \[64, \d+\]\)"):
        decoder.step(np.array([1]), np.array([0]), PagedBatch(table, np.array([0]), np.array([0, 1])))


@pytest.mark.parametrize("starts, most, seqs, pieces", [
    ([0, 3, 4], 24, 64, [[(0, 0, 3), (1, 3, 4)]]),
    ([0, 30], 24, 64, [[(0, 0, 24)], [(0, 24, 30)]]),
    ([0, 1, 2, 3], 24, 2, [[(0, 0, 1), (1, 1, 2)], [(2, 2, 3)]]),
    ([0, 10, 30, 31], 16, 64, [[(0, 0, 10), (1, 10, 16)], [(1, 16, 30), (2, 30, 31)]]),
])
def test_split_step_keeps_order_and_limits(starts, most, seqs, pieces):
    from llmc.runtime.backends.tensorrt import split_step

    assert split_step(np.array(starts), most, seqs) == pieces


@pytest.mark.parametrize("build, here, message", [
    (dict(version="11.4.0.106"), ("11.5.0.1", "9.0"), "built with TensorRT 11.4.0.106, this machine has 11.5.0.1"),
    (dict(version="11.4.0.106"), ("11.4.0.107", "9.0"), "this machine has 11.4.0.107"),  # the exact release
    (dict(version="11.4.0.106", version_compatible=True), ("12.0.0.1", "9.0"), "this machine has 12.0.0.1"),
    (dict(version="11.4.0.106", version_compatible=True), ("11.3.0.1", "9.0"), "this machine has 11.3.0.1"),
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


@pytest.mark.parametrize("built, here", [("11.4.0.106", "11.4.0.106"), ("11.4.0.106", "11.5.0.1")])
def test_a_version_compatible_engine_runs_on_the_same_or_a_later_11(built, here):
    from llmc.runtime.backends.tensorrt import check_compatible

    check_compatible(TensorRTBuild(version=built, gpu="NVIDIA H200", compute_capability="9.0", plugins={},
                                   hardware_compatible=True, version_compatible=True, optimization_level=3,
                                   max_num_tokens=1, build_s=1.0), here, {"name": "GPU", "compute_capability": "8.6"},
                     "e.plan")


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
