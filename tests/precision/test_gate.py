"""The accuracy gate of `llmc compile`: a quantized engine past --max-ppl-increase is refused with
one line naming layers, --force writes it with the figures recorded, the figures agree with
`llmc check` on the same held-back windows, values that overflow fp16 are named, and calibration
narrower than general text is warned of."""

import subprocess
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from llmc.compiler.build import find_tokenizer
from llmc.formats.engine_file import read_manifest
from llmc.llm import LLM
from llmc.precision.check import ReferenceModel, check
from llmc.precision.data import read_documents, windows
from llmc.precision.gate import HOLD_BACK
from llmc.formats.onnx_io import tensor_array

CALIB = Path(__file__).resolve().parents[2] / "data" / "pystdlib-text" / "calib"


def _compile(onnx_file, engine, *extra, tokens=1024):
    return subprocess.run(["llmc", "compile", str(onnx_file), "-o", str(engine), "--calib-tokens", str(tokens), *extra],
                          capture_output=True, text=True)


def _outlier_model(trained_onnx, path, factor=300.0):
    """The trained model with one input channel of layer 0's attention projections scaled up by
    `factor` in the norm and down in the weights: the same float function, and an activation
    outlier that static per-tensor int8 without smoothing cannot represent."""
    model = onnx.load(trained_onnx)
    weights = {t.name: t for t in model.graph.initializer}
    norm = next(n for n in model.graph.node if n.op_type == "Mul" and "layers.0.input_layernorm.weight" in n.input[0])
    gamma = tensor_array(weights[norm.input[0]]).copy()
    gamma[5] *= factor
    model.graph.initializer.append(numpy_helper.from_array(gamma, "outlier_gamma"))
    norm.input[0] = "outlier_gamma"
    projections = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[0] == norm.output[0]]
    assert len(projections) == 3  # q, k, v
    for node in projections:
        w = tensor_array(weights[node.input[1]]).copy()
        w[5] /= factor
        weights[node.input[1]].CopyFrom(numpy_helper.from_array(w, node.input[1]))
    onnx.save(model, path)
    return path


def test_past_the_limit_is_refused_and_force_writes_what_check_confirms(trained_onnx, tmp_path):
    source = _outlier_model(trained_onnx, tmp_path / "outlier.onnx")
    engine = tmp_path / "int8.plan"
    lossy = ("--int8-calib", str(CALIB), "--smoothquant", "0")
    refused = _compile(source, engine, *lossy)
    assert refused.returncode == 2, refused.stderr
    error = refused.stderr.strip().splitlines()[-1]
    assert "exceeds --max-ppl-increase 3%" in error and "layers adding the most error: layers.0.qkv" in error
    assert not list(tmp_path.glob("int8.plan*"))

    forced = _compile(source, engine, *lossy, "--force")
    assert forced.returncode == 0, forced.stderr
    accuracy = read_manifest(engine)["precision"]["accuracy"]
    assert accuracy["forced"] and not accuracy["passed"] and accuracy["ppl_increase_pct"] > 3

    # The same held-back windows through `llmc check` (the paged engine against the source graph).
    pieces = windows(read_documents(CALIB, find_tokenizer(onnx.load(source), source, None), 2048), 256, 1024)
    held = tmp_path / "held"
    held.mkdir()
    np.save(held / "held.npy", np.stack(pieces[HOLD_BACK - 1::HOLD_BACK]))
    report = check(LLM(engine), ReferenceModel(source), held, window=256)
    assert report.tokens == accuracy["tokens"]
    assert abs(report.ppl_increase_pct - accuracy["ppl_increase_pct"]) < 0.05
    assert abs(report.top1_agreement - accuracy["top1_agreement"]) < 0.01


def test_smoothing_brings_the_same_model_within_the_limit(trained_onnx, tmp_path):
    engine = tmp_path / "int8.plan"
    done = _compile(_outlier_model(trained_onnx, tmp_path / "outlier.onnx"), engine, "--int8-calib", str(CALIB))
    assert done.returncode == 0, done.stderr
    accuracy = read_manifest(engine)["precision"]["accuracy"]
    assert accuracy["passed"] and not accuracy["forced"] and accuracy["tokens"] >= 255
    assert "accuracy on" in done.stderr and "held-back tokens" in done.stderr


def test_fp16_overflow_is_named(trained_onnx, tmp_path):
    model = onnx.load(trained_onnx)
    down = next(t for t in model.graph.initializer if list(t.dims) == [704, 256])  # layer 0's MLP output (hidden 256)
    down.CopyFrom(numpy_helper.from_array(tensor_array(down) * 1e5, down.name))  # layer 0's MLP output
    source = tmp_path / "overflow.onnx"
    onnx.save(model, source)
    engine = tmp_path / "fp16.plan"
    done = _compile(source, engine, "--fp16", "--calib", str(CALIB))
    # onnxruntime's CPU kernels compute this MatMul in fp32, so the engine holds here: a warning,
    # for the GPU where it would overflow.
    warning = next(line for line in done.stderr.splitlines() if "warning" in line)
    assert "activations overflow fp16" in warning and "reaches" in warning and "compile without --fp16" in warning
    assert "3.4e+38" not in warning  # attention masks' fill values saturate; they are not named


def test_calibration_narrower_than_general_text_is_warned(trained_onnx, tmp_path):
    narrow = tmp_path / "numbers"
    narrow.mkdir()
    (narrow / "n.txt").write_text(" ".join(str(i % 100) for i in range(3000)))
    engine = tmp_path / "int8.plan"
    done = _compile(_outlier_model(trained_onnx, tmp_path / "outlier.onnx"), engine, "--int8-calib", str(narrow),
                    "--smoothquant", "0", "--max-ppl-increase", "10", tokens=2048)
    assert done.returncode == 0, done.stderr
    accuracy = read_manifest(engine)["precision"]["accuracy"]
    assert accuracy["passed"] and accuracy["general_text_ppl_increase_pct"] > 10 > accuracy["ppl_increase_pct"]
    warning = next(line for line in done.stderr.splitlines() if "warning" in line)
    assert "on llmc's general text" in warning and "narrower than your traffic" in warning
