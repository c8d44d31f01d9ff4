"""`llmc compile --backend tensorrt`: the graph TensorRT's parser would read, checked without TensorRT.

Plugin-node mapping, the optimization profile and the dry-run's node check, on hand-made graphs
(each fault named) and on tiny-llama compiled through the CLI at every precision the TensorRT
path takes. The build itself needs TensorRT: here only its refusal is checked.
"""

from __future__ import annotations

import json
from pathlib import Path

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
from llmc.precision.plan import PrecisionOptions


PLUGIN_INPUTS = ["q", "k", "v", "key_cache.0", "value_cache.0", "block_tables", "context_lens", "query_start_loc"]


def _paged_node(types=(TensorProto.FLOAT,) * 5 + (TensorProto.INT64,) * 3, **attrs) -> onnx.ModelProto:
    node = helper.make_node("PagedAttention", PLUGIN_INPUTS, ["out"], name="paged.0", domain="llmc", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, None) for n, t in zip(PLUGIN_INPUTS, types)],
                              [helper.make_tensor_value_info("out", types[0], None)])
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
                          ("query_start_loc", ["seqs_plus_1"]), ("key_cache.0", ["blocks", 2, 16, 64]),
                          ("logits_rows", ["rows"]))
    profile = optimization_profile(model, max_batch=8, max_seq_len=100, block_size=16, num_blocks=50,
                                   max_num_tokens=256)
    assert profile == {"input_ids": ((1, 1), (1, 8), (1, 256)),
                       "block_tables": ((1, 1), (8, 7), (8, 7)),  # ceil(100 / 16) blocks per sequence
                       "query_start_loc": ((2,), (9,), (9,)),
                       "key_cache.0": ((1, 2, 16, 64), (50, 2, 16, 64), (50, 2, 16, 64)),
                       "logits_rows": ((1,), (8,), (256,))}  # up to every token: not the sequences' range


def test_the_paged_interface_names_logits_rows_apart_from_the_sequences(tiny_llama_onnx, tmp_path):
    """TensorRT holds equally named input dimensions equal at run time (sampleNamedDimensions):
    `llmc check` and speculative steps ask for more logits rows than there are sequences."""
    manifest = compile_model(tiny_llama_onnx, tmp_path / "e.plan", backend="tensorrt",
                             tensorrt=TensorRTOptions(dry_run=True, max_num_tokens=512))
    profile = manifest["tensorrt_check"]["profile"]
    assert profile["logits_rows"] == [[1], [64], [512]] and profile["context_lens"] == [[1], [64], [64]]


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
                                             [_value("x")], [_value("y", TensorProto.INT8)], [scale, uint8_zero]),
                             "zero point is UINT8; TensorRT takes a zero point of the quantized type (INT8)"),
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


def _weight(name, element, shape):
    return helper.make_tensor(name, element, list(shape), np.zeros(int(np.prod(shape)), np.int64).tolist())


def _scale(name, shape, value=0.5):
    return numpy_helper.from_array(np.full(shape, value, np.float32), name)


def _dq(weight, scale, **attrs):
    return _one_node_model(helper.make_node("DequantizeLinear", [weight.name, scale.name], ["y"], name="n", **attrs),
                           [], [_value("y", shape=list(weight.dims))], [weight, scale])


# TensorRT's Q/DQ forms (compiler/tensorrt_support.py cites NvInfer.h and the developer guide).
def _qdq_faults():
    int8_zero = numpy_helper.from_array(np.array(0, np.int8), "zero")
    return {
        "int8 blocks": (_dq(_weight("w", TensorProto.INT8, (64, 4)), _scale("s", (2, 4)), axis=0, block_size=32),
                        "INT8 in blocks of 32"),
        "int4 blocks of 32": (_dq(_weight("w", TensorProto.INT4, (64, 4)), _scale("s", (2, 4)), axis=0, block_size=32),
                              "INT4 in blocks of 32; TensorRT takes INT4 blocks of 64 or 128"),
        "fp8 blocks": (_dq(_weight("w", TensorProto.FLOAT8E4M3FN, (128, 4)), _scale("s", (2, 4)), axis=0,
                           block_size=64), "FLOAT8E4M3FN in blocks of 64"),
        "blocks along the first of three axes": (
            _dq(_weight("w", TensorProto.INT4, (128, 4, 2)), _scale("s", (2, 4, 2)), axis=0, block_size=64),
            "blocks along axis 0"),
        "int4 activation": (_one_node_model(helper.make_node("DequantizeLinear", ["x", "s"], ["y"], name="n", axis=0,
                                                             block_size=64),
                                            [_value("x", TensorProto.INT4, (128, 4))], [_value("y", shape=(128, 4))],
                                            [_scale("s", (2, 4))]), "activation in INT4 blocks"),
        "per-channel activation": (_one_node_model(helper.make_node("QuantizeLinear", ["x", "s"], ["y"], name="n", axis=1),
                                                   [_value("x")], [_value("y", TensorProto.INT8)], [_scale("s", (4,))]),
                                   "x is an activation quantized per channel"),
        "negative scale": (_one_node_model(helper.make_node("QuantizeLinear", ["x", "s"], ["y"], name="n"),
                                           [_value("x")], [_value("y", TensorProto.INT8)], [_scale("s", (), -0.5)]),
                           "strictly positive"),
        "non-zero zero point": (_one_node_model(helper.make_node("QuantizeLinear", ["x", "s", "zero"], ["y"], name="n"),
                                                [_value("x")], [_value("y", TensorProto.INT8)],
                                                [_scale("s", ()), numpy_helper.from_array(np.array(3, np.int8), "zero")]),
                                "symmetrically"),
        "integer input": (_one_node_model(helper.make_node("QuantizeLinear", ["x", "s", "zero"], ["y"], name="n"),
                                          [_value("x", TensorProto.INT32)], [_value("y", TensorProto.INT8)],
                                          [_scale("s", ()), int8_zero]), "quantizes FLOAT, FLOAT16 or BFLOAT16 only"),
    }


@pytest.mark.parametrize("fault", list(_qdq_faults()))
def test_quantize_forms_tensorrt_lacks_are_named(fault):
    model, reason = _qdq_faults()[fault]
    report = check_network(model)
    assert len(report.unsupported) == 1 and reason in report.unsupported[0], report.unsupported
    assert report.unsupported[0].startswith("node n (")


def _static_activation_pair():
    """An activation's Q/DQ pair as precision/int8.py writes it: per tensor, an INT8 zero point of 0."""
    zero = numpy_helper.from_array(np.array(0, np.int8), "zero")
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zero"], ["q"], name="q"),
             helper.make_node("DequantizeLinear", ["q", "s", "zero"], ["y"], name="dq")]
    graph = helper.make_graph(nodes, "g", [_value("x")], [_value("y")], [_scale("s", ()), zero],
                              value_info=[_value("q", TensorProto.INT8)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


@pytest.mark.parametrize("model", [
    _static_activation_pair(),
    _dq(_weight("w", TensorProto.INT8, (64, 4)), _scale("s", (4,)), axis=1),  # int8 weights per channel
    _dq(_weight("w", TensorProto.INT4, (128, 4)), _scale("s", (2, 4)), axis=0, block_size=64),
    _dq(_weight("w", TensorProto.INT4, (256, 4)), _scale("s", (2, 4)), axis=0, block_size=128),
], ids=["static activation with an int8 zero point", "int8 per channel", "int4 blocks of 64", "int4 blocks of 128"])
def test_quantize_forms_tensorrt_takes_pass(model):
    report = check_network(model)
    assert report.ok, report.unsupported


def test_int8_calibrated_trained_model_passes_the_dry_run(trained_onnx, tmp_path):
    """The static activation QuantizeLinear's INT8 zero point is its own (TensorRT takes an
    all-zero one), not a quantized tensor it computes with."""
    calib = Path(__file__).resolve().parents[2] / "data" / "pystdlib-text" / "calib"
    manifest = compile_model(trained_onnx, tmp_path / "e.plan", backend="tensorrt",
                             precision=PrecisionOptions(int8_calib=str(calib)),
                             tensorrt=TensorRTOptions(dry_run=True))
    check = manifest["tensorrt_check"]
    assert check["unsupported"] == [], check["unsupported"]
    assert check["ops"]["QuantizeLinear"] > 0 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("options", [[], ["--fp16"], ["--weights", "int4", "--weights-block-size", "64", "--force"],
                                     ["--weights", "int8", "--force"], ["--kv-cache-dtype", "fp16"],
                                     ["--fp16", "--kv-cache-dtype", "fp16"]])
def test_dry_run_on_tiny_llama_passes_and_writes_nothing(tiny_llama_onnx, tmp_path, options):
    output = tmp_path / "engine.plan"
    result = CliRunner().invoke(main, ["compile", str(tiny_llama_onnx), "-o", str(output), "--backend", "tensorrt",
                                       "--dry-run", *options])
    assert result.exit_code == 0, result.output
    assert "plugins llmc::paged_attention ×4" in result.stdout and "ok:" in result.stdout
    assert "profile input_ids, position_ids: min [1, 1] opt [1, 64] max [1, 2048]" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_run_time_activation_scales_are_named_as_having_no_tensorrt_form(tiny_llama_onnx, tmp_path, monkeypatch):
    """Per-token scales: compile refuses --int8-dynamic with TensorRT before any work; past that
    refusal the dry run still names every Q/DQ pair on them, and the line says what is true."""
    from llmc.compiler import build
    from llmc.errors import LlmcError
    from llmc.precision import plan

    options = PrecisionOptions(int8_dynamic=True, force=True)
    with pytest.raises(LlmcError, match="--int8-dynamic"):
        compile_model(tiny_llama_onnx, tmp_path / "e.plan", backend="tensorrt", precision=options,
                      tensorrt=TensorRTOptions(dry_run=True))
    monkeypatch.setattr(build, "check_options", lambda precision, backend: plan.check_options(precision))
    manifest = compile_model(tiny_llama_onnx, tmp_path / "e.plan", backend="tensorrt", precision=options,
                             tensorrt=TensorRTOptions(dry_run=True))
    faults = manifest["tensorrt_check"]["unsupported"]
    assert faults and all("computed at run time" in line and "CPU backend only" in line for line in faults)
    assert not any("--int8-calib" in line for line in faults)  # not an option to try, which may be given
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("types, reason", [
    ((TensorProto.FLOAT, TensorProto.FLOAT16) + (TensorProto.FLOAT,) * 3 + (TensorProto.INT64,) * 3,
     "key is float16, query float32"),
    ((TensorProto.FLOAT,) * 5 + (TensorProto.INT64, TensorProto.FLOAT, TensorProto.INT64),
     "context_lens is float32, not int32 or int64"),
    ((TensorProto.INT32,) * 5 + (TensorProto.INT64,) * 3, "query is int32; the kernel takes"),
])
def test_plugin_input_types_the_plugin_refuses_are_named(types, reason):
    """The plugin's own rule, on the ONNX types (test_tensorrt_plugin_types.py runs both on a grid)."""
    model = _paged_node(types, scale=0.125)
    map_plugin_nodes(model)
    report = check_network(model)
    assert len(report.unsupported) == 1 and reason in report.unsupported[0], report.unsupported
    assert report.unsupported[0].startswith("node paged.0 (paged_attention): the plugin refuses its input types")


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
