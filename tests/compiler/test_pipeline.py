"""The pipeline runner, `llmc optimize` and `llmc inspect` on ONNX files."""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from llmc.cli import main
from llmc.compiler import pipeline
from llmc.formats import onnx_io
from llmc.compiler.compare import compare_models
from llmc.errors import LlmcError
from llmc.passes.base import Pass, PassResult
from llmc.passes.registry import PASSES
from llmc.formats.onnx_io import tensor_array


def test_every_named_level_lists_only_registered_passes():
    for names in pipeline.PIPELINES.values():
        assert all(name in PASSES for name in names)
    assert pipeline.PIPELINES["0"] == []


def test_unknown_level_and_pass_are_named():
    with pytest.raises(LlmcError, match=r"--level: unknown level '7' \(valid: 0, 1, 2, 3\)"):
        pipeline.resolve(level=7)
    with pytest.raises(LlmcError, match="--passes: unknown pass 'fuse-everything'"):
        pipeline.resolve(passes=["fold-constants", "fuse-everything"])


def test_report_has_an_entry_per_pass(tiny_llama_onnx, tmp_path):
    report_path = tmp_path / "report.json"
    entries = pipeline.optimize_file(tiny_llama_onnx, tmp_path / "o.onnx", level=2, verify=True,
                                     report=report_path)
    report = json.loads(report_path.read_text())
    assert [e["pass"] for e in report["passes"]] == pipeline.PIPELINES["2"] == [e["pass"] for e in entries]
    by_pass = {e["pass"]: e for e in reversed(report["passes"])}
    assert by_pass["fuse-attention"]["matches"] == 4 and by_pass["fuse-rms-norm"]["matches"] == 9
    assert all({"matches", "nodes_before", "nodes_after", "seconds", "verify"} <= set(e) for e in entries)
    assert all(e["verify"]["max_abs"] <= 1e-4 for e in entries)
    assert any("Attention-23" in note for e in entries for note in e["notes"])
    assert compare_models(onnx.load(tiny_llama_onnx), onnx.load(tmp_path / "o.onnx")).max_abs <= 1e-4


class BreaksOutputs(Pass):
    """Scales every initializer: a pass that changes results, for --verify to catch."""

    name = "break-outputs"

    def run(self, model):
        for tensor in model.graph.initializer:
            value = tensor_array(tensor)
            if value.dtype == np.float32 and value.size > 1:
                tensor.CopyFrom(onnx.numpy_helper.from_array(value * 1.5, tensor.name))
        return PassResult(model, 1)


def test_verify_stops_at_the_pass_that_changes_outputs(tiny_llama_onnx, tmp_path, monkeypatch):
    monkeypatch.setitem(PASSES, "break-outputs", BreaksOutputs)
    with pytest.raises(LlmcError, match="pass 'break-outputs' changed the outputs beyond tolerance"):
        pipeline.optimize_file(tiny_llama_onnx, tmp_path / "o.onnx", passes=["fold-constants", "break-outputs"],
                               verify=True)
    assert not (tmp_path / "o.onnx").exists()


def test_large_graph_keeps_external_data_through_optimize(tiny_llama_onnx, tmp_path, monkeypatch):
    # Pretend the 2 GB limit is small: every stage must take the external-data path.
    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_THRESHOLD", 10_000)
    pipeline.optimize_file(tiny_llama_onnx, tmp_path / "o.onnx", level=2, verify=True)
    assert (tmp_path / "o.onnx.data").stat().st_size > 10_000_000
    optimized = onnx.load(tmp_path / "o.onnx")
    assert compare_models(onnx.load(tiny_llama_onnx), optimized).max_abs <= 1e-4


def test_cli_optimize_and_inspect(tiny_llama_onnx, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["optimize", str(tiny_llama_onnx), "-o", str(tmp_path / "o.onnx"),
                                  "--passes", "fuse-rms-norm,eliminate-dead-code"])
    assert result.exit_code == 0, result.output
    assert "fuse-rms-norm: 9 matched" in result.stderr
    summary = json.loads(runner.invoke(main, ["inspect", str(tmp_path / "o.onnx"), "--json"]).stdout)
    assert summary["ops"]["RMSNormalization"] == 9 and "Pow" not in summary["ops"]
    assert summary["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]}
    assert summary["parameters"] > 3_000_000
    text = runner.invoke(main, ["inspect", str(tmp_path / "o.onnx")]).stdout
    assert "RMSNormalization" in text and "input         input_ids" in text


def test_cli_optimize_bad_input(tmp_path):
    runner = CliRunner()
    (tmp_path / "junk.onnx").write_text("not onnx")
    for args, message in [
        (["optimize", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "o.onnx")], "missing.onnx: no such file"),
        (["optimize", str(tmp_path / "junk.onnx"), "-o", str(tmp_path / "o.onnx")], "not a readable ONNX model"),
        (["optimize", str(tmp_path / "junk.onnx"), "-o", str(tmp_path / "o.onnx"), "--level", "9"], "--level"),
    ]:
        result = runner.invoke(main, args)
        assert result.exit_code == 2 and message in result.stderr, result.output
    assert not (tmp_path / "o.onnx").exists()


def test_compile_records_the_pipeline(tiny_llama_engine):
    from llmc.formats.engine_file import read_manifest

    manifest = read_manifest(tiny_llama_engine)
    assert manifest["build_options"]["level"] == "2"
    assert manifest["build_options"]["passes"] == pipeline.PIPELINES["2"]
    attention = [e for e in manifest["optimization"] if e["pass"] == "fuse-attention"]
    assert attention == [{"pass": "fuse-attention", "matches": 4, "nodes_after": attention[0]["nodes_after"]}]


def relu_model(path, *, broken=False):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    node = onnx.helper.make_node("Relu", ["x" if not broken else "nowhere"], ["y"])
    onnx.save(onnx.helper.make_model(onnx.helper.make_graph([node], "g", [x], [y])), path)
    return path


def test_passes_that_do_not_apply_leave_the_graph_and_say_why(tmp_path):
    entries = pipeline.optimize_file(relu_model(tmp_path / "relu.onnx"), tmp_path / "o.onnx", level=2)
    notes = {e["pass"]: e["notes"] for e in entries}
    assert notes["fuse-attention"] == ["no match: no Softmax nodes"]
    assert notes["fuse-rms-norm"] == ["no match: no ReduceMean nodes"]
    assert [n.op_type for n in onnx.load(tmp_path / "o.onnx").graph.node] == ["Relu"]


def test_malformed_graph_is_refused_before_any_pass(tmp_path):
    result = CliRunner().invoke(main, ["optimize", str(relu_model(tmp_path / "bad.onnx", broken=True)),
                                       "-o", str(tmp_path / "o.onnx")])
    assert result.exit_code == 2 and "bad.onnx: invalid ONNX graph" in result.stderr
    assert not (tmp_path / "o.onnx").exists()
