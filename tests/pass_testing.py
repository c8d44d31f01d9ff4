"""Shared helpers for pass tests: export small torch modules, run a pass, compare outputs.

Import as `from pass_testing import ...` (tests/ is on sys.path via tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections import Counter

import onnx
import torch

from llmc.compiler.compare import compare_models
from llmc.passes.base import Pass, PassResult


def export_module(module: torch.nn.Module, args: tuple, *, dynamo: bool = True,
                  opset: int | None = None, dynamic_batch: bool = True) -> onnx.ModelProto:
    """Export a small module to ONNX with either exporter (weights inline)."""
    module = module.eval()
    names = [f"x{i}" for i in range(len(args))]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if dynamo:
            shapes = tuple({0: torch.export.Dim.DYNAMIC} if dynamic_batch else None for _ in args)
            program = torch.onnx.export(module, args, dynamo=True, input_names=names,
                                        dynamic_shapes=shapes, opset_version=opset,
                                        external_data=False)
            return program.model_proto
        buffer = io.BytesIO()
        axes = {name: {0: "batch"} for name in names} if dynamic_batch else None
        torch.onnx.export(module, args, buffer, dynamo=False, input_names=names,
                          dynamic_axes=axes, opset_version=opset or 17)
        return onnx.load_from_string(buffer.getvalue())


def op_counts(model: onnx.ModelProto) -> Counter:
    """Histogram of (domain-qualified) op types."""
    return Counter(f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                   for n in model.graph.node)


def run_pass(pass_: Pass, model: onnx.ModelProto, *, tolerance: float = 1e-4) -> PassResult:
    """Run a pass on a copy; check the result is valid and computes the same outputs."""
    before = copy.deepcopy(model)
    result = pass_.run(copy.deepcopy(model))
    onnx.checker.check_model(result.model)
    onnx.shape_inference.infer_shapes(result.model, strict_mode=True)
    comparison = compare_models(before, result.model)
    assert comparison.max_abs <= tolerance, (pass_.name, comparison)
    return result
