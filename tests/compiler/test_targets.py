"""Compile targets (compiler/targets.py) and the library side of `llmc compile` and `llmc inspect`."""

import dataclasses
import hashlib
import json

import pytest
from click.testing import CliRunner

import llmc
from llmc.cli import main
from llmc.compiler import targets
from llmc.compiler.tensorrt_network import TensorRTOptions
from llmc.errors import LlmcError
from llmc.precision.plan import PrecisionOptions


def test_an_unknown_backend_lists_the_registered_ones():
    with pytest.raises(LlmcError, match=r"^--backend: unknown backend 'cuda' \(choose from onnxruntime, openvino, tensorrt\)$"):
        targets.find_target("cuda")


def test_a_target_registered_twice_is_refused():
    twice = dataclasses.replace(targets.TARGETS["onnxruntime"])
    with pytest.raises(ValueError, match="registered twice: onnxruntime"):
        targets._registry(targets.TARGETS["onnxruntime"], twice)


@pytest.mark.parametrize("options, flag", [(TensorRTOptions(dry_run=True), "--dry-run"),
                                           (TensorRTOptions(optimization_level=5), "--builder-optimization-level")])
def test_tensorrt_options_for_the_cpu_are_refused_before_the_model_is_read(tiny_llama_onnx, tmp_path, options, flag):
    with pytest.raises(LlmcError, match=f"^{flag}: only for --backend tensorrt$"):
        llmc.compile(tiny_llama_onnx, tmp_path / "e.plan", tensorrt=options)
    assert list(tmp_path.iterdir()) == []


def test_a_contiguous_tensorrt_engine_is_refused_naming_both(tiny_llama_onnx, tmp_path):
    with pytest.raises(LlmcError, match="^--no-paged and --backend tensorrt: TensorRT engines are paged"):
        llmc.compile(tiny_llama_onnx, tmp_path / "e.plan", backend="tensorrt", paged=None)


def test_weight_blocks_default_to_the_targets_size(tiny_llama_onnx, tmp_path):
    """int4 on TensorRT without a block size gets TensorRT's 64 from Python as from the command line."""
    result = llmc.compile(tiny_llama_onnx, tmp_path / "e.plan", backend="tensorrt",
                          precision=PrecisionOptions(weights="int4", force=True), tensorrt=TensorRTOptions(dry_run=True))
    assert result.engine is None and result["precision"]["weights_block_size"] == 64
    assert result.tensorrt_check is result["tensorrt_check"]
    cpu = llmc.compile(tiny_llama_onnx, tmp_path / "e.plan", precision=PrecisionOptions(weights="int4", force=True))
    assert cpu["precision"]["weights_block_size"] == 32 and "tensorrt_check" not in cpu


def test_the_result_is_the_engines_manifest_and_its_summary_hashes_the_file(tiny_llama_onnx, tmp_path):
    result = llmc.compile(tiny_llama_onnx, tmp_path / "e.plan")
    written = llmc.inspect(tmp_path / "e.plan").manifest
    for key in ("backend", "dtype", "geometry", "source", "build_options", "optimization", "precision", "created"):
        assert written[key] == result[key], key
    assert written["paged"]["num_blocks"] == result.manifest["paged"]["num_blocks"]
    summary = result.summary()
    assert summary["sha256"] == hashlib.sha256((tmp_path / "e.plan").read_bytes()).hexdigest()
    assert summary["bytes"] == (tmp_path / "e.plan").stat().st_size and summary["engine"] == str(tmp_path / "e.plan")


def test_inspect_from_python_is_what_the_command_prints(tiny_llama_engine, tiny_llama_onnx):
    report = llmc.inspect(tiny_llama_engine, deploy=True)
    assert report.runs_here is True
    cli = CliRunner().invoke(main, ["inspect", str(tiny_llama_engine), "--json"])
    assert json.loads(cli.stdout) == json.loads(json.dumps(report.to_dict()))
    assert CliRunner().invoke(main, ["inspect", str(tiny_llama_engine)]).stdout == report.text() + "\n"
    model = llmc.inspect(tiny_llama_onnx)
    assert model.to_dict()["nodes"] > 0 and model.text().startswith(f"model         {tiny_llama_onnx}")
