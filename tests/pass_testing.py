"""Shared helpers for pass tests: export small torch modules, run a pass, compare outputs.

Import as `from pass_testing import ...` (tests/ is on sys.path via tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections import Counter

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

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


def assert_unchanged(pass_: Pass, model: onnx.ModelProto) -> PassResult:
    """The pass matches nothing and leaves every op in place (still a valid, equal graph)."""
    before = op_counts(model)
    result = run_pass(pass_, model)
    assert result.matches == 0 and op_counts(result.model) == before
    return result


def small_model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    """An opset-17 graph whose inputs and outputs are float [2] tensors (structural tests)."""
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [2])  # noqa: E731
    graph = helper.make_graph(nodes, "g", [value(n) for n in inputs], [value(n) for n in outputs],
                              initializer=[numpy_helper.from_array(np.asarray(v), n) for n, v in initializers])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def edges(model: onnx.ModelProto) -> list[tuple[str, list[str], list[str]]]:
    """(op type, inputs, outputs) of every node, in order."""
    return [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]


def llmc_rms_norm(width: int = 32) -> torch.nn.Module:
    """llmc's own RMSNorm with a non-trivial weight."""
    from llmc.models.decoder import RMSNorm

    norm = RMSNorm(width, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm
