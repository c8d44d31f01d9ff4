"""--fp16 islands, mixed-precision files, and the trained model's accuracy within the benchmark's
bounds (int8 ≤ 1.5 %, int4 weight-only ≤ 5 % perplexity increase)."""

import copy
import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from llmc.compiler.build import compile_model
from llmc.formats.onnx_io import infer_shapes
from llmc.compiler.pipeline import optimize
from llmc.errors import LlmcError
from llmc.llm import LLM
from llmc.precision.check import ReferenceModel, check
from llmc.precision.fp16 import convert_to_fp16, residual_adds
from llmc.precision.plan import PrecisionOptions, apply_precision, check_options, read_config
from llmc.precision.weight_only import DEFAULT_BLOCK_SIZE, LM_HEAD_MIN_BLOCK_SIZE

DATA = Path(__file__).resolve().parents[2] / "data"


def _types(model):
    typed = infer_shapes(model)
    return {v.name: v.type.tensor_type.elem_type for v in [*typed.graph.input, *typed.graph.value_info,
                                                           *typed.graph.output]}


def test_fp16_keeps_norms_attention_and_residual_sums_in_fp32(tiny_llama_onnx):
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    residual = residual_adds(model)
    assert len(residual) == 2 * 4  # before each layer's second norm and the next layer's first / final
    half = copy.deepcopy(model)
    assert convert_to_fp16(half) > 0
    onnx.checker.check_model(half)
    types = _types(half)
    for node in half.graph.node:
        if node.op_type in ("RMSNormalization", "Attention") or (node.name or node.output[0]) in residual:
            assert all(types.get(i) == TensorProto.FLOAT for i in node.input[:1]), node.name
        if node.op_type == "MatMul" and node.name != "node_linear_28":  # lm_head writes the output
            assert types.get(node.input[0]) == TensorProto.FLOAT16, node.name
    # The interface is unchanged.
    assert [(i.name, i.type.tensor_type.elem_type) for i in half.graph.input] == \
        [(i.name, i.type.tensor_type.elem_type) for i in model.graph.input]
    assert all(o.type.tensor_type.elem_type == TensorProto.FLOAT for o in half.graph.output)


def test_mixed_precision_file_assigns_layers_and_refuses_unknown_names(tiny_llama_onnx, tmp_path):
    config = tmp_path / "mix.json"
    config.write_text(json.dumps({"default": "int4", "rules": {"lm_head": "fp32", "layers.1.*": "int8-weights"}}))
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    options = PrecisionOptions(config=str(config), force=True)  # no data: the accuracy check is skipped
    entry = apply_precision(model, options, check_options(options), [])
    assert entry["linears"]["lm_head"] == "fp32" and entry["linears"]["layers.0.qkv"] == "int4"
    assert entry["linears"]["layers.1.mlp.down"] == "int8-weights"
    kinds = [next((a.i for a in n.attribute if a.name == "bits"), None) for n in model.graph.node
             if n.op_type in ("MatMul", "MatMulNBits")]
    assert sorted(k for k in kinds if k) == [4] * 12 + [8] * 4 and kinds.count(None) == 1

    config.write_text(json.dumps({"rules": {"layers.7.o": "int8"}}))
    with pytest.raises(LlmcError, match=r"mix.json: 'layers.7.o' names no layer or op type"):
        apply_precision(copy.deepcopy(model), options, read_config(str(config)), [])
    config.write_text(json.dumps({"rules": {"lm_head": "int3"}}))
    with pytest.raises(LlmcError, match=r"lm_head: 'int3' is not a precision"):
        read_config(str(config))
    config.write_text("{not json")
    with pytest.raises(LlmcError, match=r"mix.json: not JSON"):
        read_config(str(config))


def test_lm_head_rules_and_calibrated_int4(tiny_llama_onnx):
    import numpy as np

    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    windows = [np.random.default_rng(0).integers(3, 258, 64) for _ in range(2)]
    for options, lm_head in ((PrecisionOptions(weights="int4", force=True), "int8-weights"),
                             (PrecisionOptions(int8_dynamic=True, force=True), "int8-weights")):
        entry = apply_precision(copy.deepcopy(model), options, None, windows)
        assert entry["linears"]["lm_head"] == lm_head
        assert set(entry["linears"].values()) == {lm_head, "int4" if options.weights else "int8-dynamic"}
    assert apply_precision(copy.deepcopy(model), PrecisionOptions(weights="int4", force=True), None, windows)[
        "int4_activation_aware"]
    # lm_head at 8 bits takes blocks of at least LM_HEAD_MIN_BLOCK_SIZE; the other layers the asked size.
    for asked, int4_block, lm_head_block in ((None, DEFAULT_BLOCK_SIZE, LM_HEAD_MIN_BLOCK_SIZE), (128, 128, 128)):
        quantized = copy.deepcopy(model)
        entry = apply_precision(quantized, PrecisionOptions(weights="int4", weights_block_size=asked, force=True),
                                None, [])
        blocks = {(a["bits"], a["block_size"]) for n in quantized.graph.node if n.op_type == "MatMulNBits"
                  for a in [{x.name: helper.get_attribute_value(x) for x in n.attribute}]}
        assert blocks == {(4, int4_block), (8, lm_head_block)}
        assert entry["weights_block_size"] == int4_block and entry["lm_head_block_size"] == lm_head_block
    assert not apply_precision(copy.deepcopy(model), PrecisionOptions(weights="int4", force=True), None, [])[
        "int4_activation_aware"]


def test_symmetric_weights_with_an_int4_lm_head_as_onnxruntime_genai_builds_them(tiny_llama_onnx, tmp_path):
    config = tmp_path / "lm_head.json"
    config.write_text(json.dumps({"rules": {"lm_head": "int4"}}))
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    for symmetric, inputs in ((True, 3), (False, 4)):  # zero points are MatMulNBits' fourth input
        options = PrecisionOptions(weights="int4", weights_symmetric=symmetric, config=str(config), force=True)
        quantized = copy.deepcopy(model)
        entry = apply_precision(quantized, options, check_options(options), [])
        assert entry["weights_symmetric"] is symmetric and set(entry["linears"].values()) == {"int4"}
        nodes = [n for n in quantized.graph.node if n.op_type == "MatMulNBits"]
        assert len(nodes) == len(entry["linears"]) and {len(n.input) for n in nodes} == {inputs}


def test_conflicting_and_bad_options_are_refused(tiny_llama_onnx, tmp_path):
    with pytest.raises(LlmcError, match="--int8-calib, --int8-dynamic and --weights each set every linear layer"):
        check_options(PrecisionOptions(int8_calib="x", weights="int4"))
    with pytest.raises(LlmcError, match="--int8-calib, --int8-dynamic and --weights"):
        check_options(PrecisionOptions(int8_dynamic=True, weights="int8"))
    with pytest.raises(LlmcError, match=r"--smoothquant: alpha must be in \[0, 1\)"):
        check_options(PrecisionOptions(smoothquant=1.5))
    with pytest.raises(LlmcError, match="--int8-calib already names the data"):
        check_options(PrecisionOptions(int8_calib="x", calib="y"))
    config = tmp_path / "mix.json"
    config.write_text(json.dumps({"default": "int8"}))
    with pytest.raises(LlmcError, match="int8 layers need calibration data"):
        apply_precision(onnx.load(tiny_llama_onnx), PrecisionOptions(config=str(config)), read_config(str(config)), [])


@pytest.mark.parametrize("name, options, bound", [
    ("int8-percentile", PrecisionOptions(int8_calib=str(DATA / "pystdlib-text" / "calib"), calibrator="percentile",
                                         calib_tokens=1024), 1.5),
    ("int4-weights", PrecisionOptions(weights="int4", calib=str(DATA / "pystdlib-text" / "calib"),
                                      calib_tokens=1024), 5.0),
])
def test_trained_model_perplexity_increase_within_the_benchmark_bound(trained_onnx, tmp_path, name, options, bound):
    engine = tmp_path / f"{name}.plan"
    compile_model(trained_onnx, engine, precision=options)
    report = check(LLM(engine), ReferenceModel(trained_onnx), DATA / "pystdlib-text" / "heldout", max_tokens=1024)
    assert report.reference_ppl < 200  # the model learned something: a uniform guess is 2,048
    assert 0.0 < report.mean_kl and report.top1_agreement < 1.0  # quantization did change it
    assert report.ppl_increase_pct <= bound


def test_compile_refuses_bad_calibration_input_and_leaves_no_engine(tiny_llama_onnx, tmp_path):
    import subprocess

    engine = tmp_path / "engine.plan"
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "a.txt").write_bytes(b"caf\xe9 " * 100)
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "a.txt").write_text("x = 1\n")
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"rules": {"layers.12.o": "int4"}}))
    cases = [(["--int8-calib", str(tmp_path / "missing")], "is not a folder"),
             (["--int8-calib", str(tmp_path / "latin1")], "a.txt: cannot be read"),
             (["--int8-calib", str(tmp_path / "short")], "the accuracy check holds back every 4th window"),
             (["--int8-calib", str(tmp_path / "short"), "--calibrator", "entropy", "--force"], "needs at least 512"),
             (["--weights", "int4"], "quantizing needs data to check the engine's accuracy on"),
             (["--weights", "int4", "--force", "--precision-config", str(mix)], "'layers.12.o' names no layer")]
    for extra, message in cases:
        done = subprocess.run(["llmc", "compile", str(tiny_llama_onnx), "-o", str(engine), *extra],
                              capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr, (extra, done.stderr)
        assert not engine.exists() and not list(tmp_path.glob("engine.plan*"))
