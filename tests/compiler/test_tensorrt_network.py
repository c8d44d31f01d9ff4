"""`llmc compile --backend tensorrt`: the graph TensorRT's parser would read, checked without TensorRT.

Plugin-node mapping, the optimization profile and the dry-run's node check, on hand-made graphs
(each fault named) and on tiny-llama compiled through the CLI at every precision the TensorRT
path takes. The build itself needs TensorRT: here only its refusal is checked.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from llmc.cli import main
from llmc.compiler.build import compile_model
from llmc.compiler.tensorrt_network import (TensorRTOptions, check_network, map_plugin_nodes,
                                            optimization_profile, standard_norms)
from llmc.errors import LlmcError


def _paged_node(**attrs) -> onnx.ModelProto:
    names = ["q", "k", "v", "key_cache.0", "value_cache.0", "block_tables", "context_lens", "query_start_loc"]
    node = helper.make_node("PagedAttention", names, ["out"], name="paged.0", domain="llmc", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("llmc", 1)])


def test_paged_attention_nodes_become_plugin_nodes_with_every_attribute():
    model = _paged_node(scale=0.125)
    assert map_plugin_nodes(model) == 1
    node = model.graph.node[0]
    assert (node.op_type, node.domain) == ("paged_attention", "")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"scale": 0.125, "window": 0, "softcap": 0.0, "plugin_namespace": b"llmc", "plugin_version": b"1"}
    assert [o.domain for o in model.opset_import] == [""]
    assert check_network(model).plugins == {"llmc::paged_attention": 1}


def test_a_paged_attention_node_without_scale_is_refused():
    with pytest.raises(LlmcError, match="paged.0.*scale"):
        map_plugin_nodes(_paged_node(window=4))


def _inputs_model(*inputs) -> onnx.ModelProto:
    values = [helper.make_tensor_value_info(name, TensorProto.INT64, shape) for name, shape in inputs]
    graph = helper.make_graph([helper.make_node("Identity", [inputs[0][0]], ["y"])], "g", values,
                              [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    return helper.make_model(graph)


def test_profile_ranges_come_from_the_build_options():
    model = _inputs_model(("input_ids", [1, "tokens"]), ("block_tables", ["seqs", "max_blocks"]),
                          ("query_start_loc", ["seqs_plus_1"]), ("key_cache.0", ["blocks", 2, 16, 64]))
    profile = optimization_profile(model, max_batch=8, max_seq_len=100, block_size=16, num_blocks=50,
                                   max_num_tokens=256)
    assert profile == {"input_ids": ((1, 1), (1, 8), (1, 256)),
                       "block_tables": ((1, 1), (8, 7), (8, 7)),  # ceil(100 / 16) blocks per sequence
                       "query_start_loc": ((2,), (9,), (9,)),
                       "key_cache.0": ((1, 2, 16, 64), (50, 2, 16, 64), (50, 2, 16, 64))}


def test_a_dimension_without_a_range_names_its_input():
    with pytest.raises(LlmcError, match="input past: dimension 'past_len'"):
        optimization_profile(_inputs_model(("past", [1, "past_len"])), max_batch=1, max_seq_len=16,
                             block_size=16, num_blocks=1, max_num_tokens=16)


def _one_node_model(node, inputs, outputs, initializers=(), opset=23, domains=()) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]
                             + [helper.make_opsetid(d, 1) for d in domains])


def _value(name, element=TensorProto.FLOAT, shape=(2, 4)):
    return helper.make_tensor_value_info(name, element, list(shape))


def _faults():
    scale = numpy_helper.from_array(np.array(0.5, np.float32), "scale")
    uint8_zero = numpy_helper.from_array(np.array(0, np.uint8), "zero")
    return {
        "contrib op": (_one_node_model(helper.make_node("MatMulNBits", ["x", "b"], ["y"], name="n", domain="com.microsoft"),
                                       [_value("x"), _value("b")], [_value("y")], domains=["com.microsoft"]),
                       "domain 'com.microsoft'"),
        "no importer": (_one_node_model(helper.make_node("Unique", ["x"], ["y"], name="n"), [_value("x")], [_value("y")]),
                        "no importer for Unique"),
        "double input": (_one_node_model(helper.make_node("Relu", ["x"], ["y"], name="n"),
                                         [_value("x", TensorProto.DOUBLE)], [_value("y")]), "DOUBLE"),
        "uint8 zero point": (_one_node_model(helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["y"], name="n"),
                                             [_value("x")], [_value("y", TensorProto.UINT8)], [scale, uint8_zero]),
                             "UINT8 zero point"),
        "run-time scale": (_one_node_model(helper.make_node("QuantizeLinear", ["x", "s"], ["y"], name="n"),
                                           [_value("x"), _value("s", shape=())], [_value("y", TensorProto.INT8)]),
                           "computed at run time"),
        "integer matmul": (_one_node_model(helper.make_node("MatMul", ["x", "w"], ["y"], name="n"),
                                           [_value("x", TensorProto.INT32), _value("w", TensorProto.INT32)],
                                           [_value("y", TensorProto.INT32)]), "INT32"),
        "opset 25": (_one_node_model(helper.make_node("Relu", ["x"], ["y"], name="n"), [_value("x")], [_value("y")],
                                     opset=25), "opset 25"),
        "attention with past": (_one_node_model(helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"],
                                                                 ["y", "present_k", "present_v"], name="n"),
                                                [_value(n) for n in ("q", "k", "v", "pk", "pv")],
                                                [_value("y"), _value("present_k"), _value("present_v")]), "one output"),
    }


@pytest.mark.parametrize("fault", list(_faults()))
def test_each_unsupported_node_is_named_with_the_reason(fault):
    model, reason = _faults()[fault]
    report = check_network(model)
    assert not report.ok
    assert any(reason in line for line in report.unsupported), report.unsupported
    assert all(line.startswith(("node n ", "input x", "model:")) for line in report.unsupported), report.unsupported


def test_supported_nodes_pass():
    scale = numpy_helper.from_array(np.array(0.5, np.float32), "scale")
    model = _one_node_model(helper.make_node("QuantizeLinear", ["x", "scale"], ["y"], name="n"),
                            [_value("x")], [_value("y", TensorProto.INT8)], [scale])
    assert check_network(model).ok


@pytest.mark.parametrize("options", [[], ["--fp16"], ["--weights", "int4", "--force"], ["--kv-cache-dtype", "fp16"]])
def test_dry_run_on_tiny_llama_passes_and_writes_nothing(tiny_llama_onnx, tmp_path, options):
    output = tmp_path / "engine.plan"
    result = CliRunner().invoke(main, ["compile", str(tiny_llama_onnx), "-o", str(output), "--backend", "tensorrt",
                                       "--dry-run", *options])
    assert result.exit_code == 0, result.output
    assert "plugins llmc::paged_attention ×4" in result.stdout and "ok:" in result.stdout
    assert "profile input_ids, position_ids: min [1, 1] opt [1, 64] max [1, 2048]" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_dry_run_exits_2_naming_each_node_at_fault(tiny_llama_onnx, tmp_path):
    result = CliRunner().invoke(main, ["compile", str(tiny_llama_onnx), "-o", str(tmp_path / "e.plan"),
                                       "--backend", "tensorrt", "--dry-run", "--int8-dynamic", "--force"])
    assert result.exit_code == 2
    faults = [line for line in result.stderr.splitlines() if line.startswith("  unsupported: node ")]
    assert faults and all("computed at run time" in line for line in faults)
    assert f"llmc: error: {len(faults)} node(s)" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_dry_run_manifest_holds_the_check_and_profile(tiny_llama_onnx, tmp_path):
    manifest = compile_model(tiny_llama_onnx, tmp_path / "e.plan", backend="tensorrt",
                             tensorrt=TensorRTOptions(dry_run=True, max_num_tokens=512))
    check = manifest["tensorrt_check"]
    assert check["unsupported"] == [] and check["plugins"] == {"llmc::paged_attention": 4}
    assert check["profile"]["input_ids"] == [[1, 1], [1, 64], [1, 512]]
    assert json.loads(json.dumps(check)) == check and check["sources"]


@pytest.mark.parametrize("argv, message", [
    (["--dry-run"], "--dry-run: only for --backend tensorrt"),
    (["--backend", "tensorrt"], "TensorRT is not installed"),
    (["--backend", "tensorrt", "--no-paged"], "--no-paged"),
    (["--backend", "tensorrt", "--dry-run", "--builder-optimization-level", "7"], "--builder-optimization-level"),
])
def test_bad_tensorrt_options_get_one_line_and_exit_2(tiny_llama_onnx, tmp_path, argv, message):
    result = CliRunner().invoke(main, ["compile", str(tiny_llama_onnx), "-o", str(tmp_path / "e.plan"), *argv])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("llmc: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("op, inputs", [("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma", "bias"]),
                                        ("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"]),
                                        ("SkipLayerNormalization", ["x", "skip", "gamma", "beta", "bias"]),
                                        ("SimplifiedLayerNormalization", ["x", "gamma"])])
def test_onnxruntime_norms_become_standard_ops_computing_the_same(op, inputs):
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    values = {"x": rng.standard_normal((1, 3, 8)), "skip": rng.standard_normal((1, 3, 8)),
              "gamma": rng.standard_normal(8), "beta": rng.standard_normal(8), "bias": rng.standard_normal(8)}
    contrib = op.startswith("Skip")
    outputs = ["y", "", "", "sum"] if contrib else ["y"]
    node = helper.make_node(op, inputs, outputs, name="norm", domain="com.microsoft" if contrib else "",
                            epsilon=1e-5)
    graph = helper.make_graph(
        [node], "g", [_value(n, shape=values[n].shape) for n in inputs if n != "gamma"],
        [_value("y", shape=(1, 3, 8))] + ([_value("sum", shape=(1, 3, 8))] if contrib else []),
        [numpy_helper.from_array(values["gamma"].astype(np.float32), "gamma")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    feeds = {n: values[n].astype(np.float32) for n in inputs if n != "gamma"}

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)

    expected = run(model)
    assert standard_norms(model) == 1
    assert not any(n.domain for n in model.graph.node) and model.opset_import[0].version == 23
    assert check_network(model).ok, check_network(model).unsupported
    for got, want in zip(run(model), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
