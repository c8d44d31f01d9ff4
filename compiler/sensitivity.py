"""`llmc sensitivity`: the graph's side of ranking linear layers by quantization error.

Loads and checks the ONNX file, reads the calibration and evaluation folders with the model's
tokenizer, runs the default optimization pipeline (the ranking is of the layers a compile would
quantize), then hands over to precision/sensitivity.py's `analyze`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from llmc.compiler.build import find_tokenizer
from llmc.compiler.pipeline import optimize
from llmc.errors import LlmcError
from llmc.formats.decoder_interface import recognize_decoder
from llmc.formats.onnx_io import load_onnx, validate, write_text_atomic
from llmc.precision.calibration import check_calibrator
from llmc.precision.data import read_documents, windows
from llmc.precision.sensitivity import TARGETS, Sensitivity, analyze

WINDOW = 256  # tokens per window, at most the model's positions


def sensitivity(onnx_path: str | os.PathLike, calibration_data: str | os.PathLike, *,
                data: str | os.PathLike | None = None, target: str = "int8", calibrator: str = "minmax",
                tokens: int = 1024, budget_pct: float | None = None, exhaustive: bool = False,
                output: str | os.PathLike | None = None,
                progress: Callable[[str], None] = lambda message: None) -> Sensitivity:
    """Rank the linear layers of `onnx_path` by the error quantizing each to `target` causes.

    Args:
        onnx_path: the decoder graph.
        calibration_data: folder of .txt/.jsonl/.npy/.npz to calibrate on.
        data: folder to evaluate on (default: the calibration folder).
        target: int8, int8-dynamic, int8-weights or int4.
        calibrator: minmax, percentile or entropy.
        tokens: tokens of each folder used at most.
        budget_pct: largest perplexity increase; the most sensitive layers are kept in fp32 until it holds.
        exhaustive: rank by quantizing each layer alone instead of each layer's added error in one run.
        output: write the resulting mixed-precision file here.
    """
    if target not in TARGETS:
        raise LlmcError(f"--precision: '{target}' is not one of {', '.join(TARGETS)}")
    path = Path(onnx_path)
    if not path.is_file():
        raise LlmcError(f"{path}: no such file")
    model = load_onnx(path)
    validate(model, path)
    geometry = recognize_decoder(model, path).geometry
    tokenizer = find_tokenizer(model, path, None)
    length = min(WINDOW, geometry.max_positions)
    calibration = windows(read_documents(calibration_data, tokenizer, geometry.vocab_size, "--int8-calib"), length,
                          tokens)
    check_calibrator(calibrator, sum(len(w) for w in calibration))
    evaluation = calibration if data is None else windows(
        read_documents(data, tokenizer, geometry.vocab_size, "--data"), length, tokens)
    progress(f"optimizing {len(model.graph.node)} nodes")
    model, _ = optimize(model)
    result = analyze(model, target, calibration, evaluation, calibrator=calibrator, budget_pct=budget_pct,
                     exhaustive=exhaustive, progress=progress)
    if output is not None:
        write_text_atomic(output, json.dumps(result.config, indent=2) + "\n")
    return result
