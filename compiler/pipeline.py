"""Named pass pipelines and the runner that reports (and optionally verifies) every pass.

Pipelines are explicit ordered lists of pass names; each ordering dependency is commented where
it occurs. `optimize` runs one, refreshing shape information after every pass; under `verify`
it also checks the graph and compares its outputs with the unoptimized graph's, and stops at
the first pass whose error exceeds the tolerance, naming it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable

import onnx

from llmc.compiler.compare import compare_outputs, run_onnx, seeded_feeds
from llmc.formats.onnx_io import (check_model, infer_value_info, load_onnx, save_onnx, validate,
                                   write_text_atomic)
from llmc.errors import LlmcError, first_line
from llmc.passes.base import Pass
from llmc.passes.registry import PASSES

CLEANUP = [
    "fold-constants",
    # Needs the constants folded first (shape inference sees more); its constants then let the
    # arithmetic after it fold.
    "fold-static-dims",
    "fold-constants",
    # Again: a Slice whose bounds only just folded now has a known shape, whose dims fold in
    # turn (TorchScript/Optimum exports of partial rotary: Phi-3, GPT-NeoX).
    "fold-static-dims",
    "fold-constants",
    # After folding: folded constants become identical initializers that CSE can merge.
    "eliminate-common-subexpressions",
    "eliminate-dead-code",
]

# Standard ONNX ops only (opset 23): what onnxruntime and TensorRT's parser both run.
PORTABLE_FUSIONS = [
    # Not a fusion: positions an export computes from its past length (Optimum's Gemma) get the
    # name the paged lowering replaces with its own positions input. After folding (constants).
    "name-cache-positions",
    "fuse-layer-norm",
    "fuse-rms-norm",
    "fuse-gelu",
    # Before attention: the rotary Add feeds Q·Kᵀ, and the attention pattern expects Q and K
    # as they reach the MatMul.
    "fuse-rotary",
    # onnxruntime-genai's GroupQueryAttention → the same Attention-23 form fuse-attention makes.
    "canonicalize-gqa",
    "fuse-attention",
    # Needs the fused Attention and RotaryEmbedding nodes to re-layout.
    "attention-3d-layout",
    "merge-sibling-matmuls",
]

# onnxruntime contrib ops. fuse-skip-norm is in no pipeline: its fused op measured slower than
# Add + norm alone on onnxruntime CPU; the single-sequence graph runs it (passes/fuse_skip_norm.py).
ONNXRUNTIME_FUSIONS = [
    "fuse-silu",
]

PIPELINES: dict[str, list[str]] = {
    "0": [],
    "1": CLEANUP,
    # Clean up again after fusing: fusions leave per-layer copies of shared subgraphs (mask,
    # rotary table slices) for CSE to merge, and dead producers behind.
    "2": CLEANUP + PORTABLE_FUSIONS + CLEANUP[-2:],
    "3": CLEANUP + PORTABLE_FUSIONS + ONNXRUNTIME_FUSIONS + CLEANUP[-2:],
}
DEFAULT_LEVEL = "2"


def resolve(level: str | int | None = None, passes: Iterable[str] | None = None) -> list[Pass]:
    """The passes to run: an explicit list of names, or a named level.

    Args:
        level: a key of PIPELINES.
        passes: pass names; overrides `level`.
    """
    if passes is not None:
        names = list(passes)
        unknown = [n for n in names if n not in PASSES]
        if unknown:
            raise LlmcError(f"--passes: unknown pass '{unknown[0]}' (valid: {', '.join(sorted(PASSES))})")
    else:
        level = str(DEFAULT_LEVEL if level is None else level)
        if level not in PIPELINES:
            raise LlmcError(f"--level: unknown level '{level}' (valid: {', '.join(PIPELINES)})")
        names = PIPELINES[level]
    return [PASSES[name]() for name in names]


def optimize(model: onnx.ModelProto, *, level: str | int | None = None,
             passes: Iterable[str] | None = None, verify: bool = False, tolerance: float = 1e-4,
             progress: Callable[[str], None] = lambda message: None) -> tuple[onnx.ModelProto, list[dict]]:
    """Run a pipeline over `model` (modified in place and returned) and report each pass.

    Args:
        model: the graph, weights loaded.
        level: a named pipeline (see PIPELINES); ignored when `passes` is given.
        passes: explicit pass names, in order.
        verify: after every pass, check the graph and compare outputs with the original graph on
            seeded inputs; stop with the pass's name when max abs error exceeds `tolerance`.
        tolerance: allowed max abs error under `verify`.
        progress: called with one short line per pass.
    """
    pipeline = resolve(level, passes)
    refresh_shapes(model)
    if verify:
        feeds = seeded_feeds(model)
        try:
            reference = run_onnx(model, feeds)
        except Exception as exc:  # onnxruntime raises its own types
            raise LlmcError("--verify: onnxruntime cannot run the input graph on seeded inputs: "
                            f"{first_line(exc)}") from None
    report = []
    for pass_ in pipeline:
        nodes_before = len(model.graph.node)
        start = time.perf_counter()
        result = pass_.run(model)
        model = result.model
        problem = structural_problem(model.graph)
        if problem:
            raise LlmcError(f"pass '{pass_.name}' left an invalid graph: {problem}")
        try:
            refresh_shapes(model)
        except Exception as exc:  # shape inference raises several types; all mean a broken graph
            raise LlmcError(f"pass '{pass_.name}' left a graph whose shapes cannot be inferred: "
                            f"{first_line(exc)}") from None
        entry = {"pass": pass_.name, "matches": result.matches, "nodes_before": nodes_before,
                 "nodes_after": len(model.graph.node),
                 "seconds": round(time.perf_counter() - start, 4), "notes": result.notes}
        if verify:
            _check_valid(model, pass_.name)
            try:
                outputs = run_onnx(model, feeds)
            except Exception as exc:  # onnxruntime raises its own types for graphs it cannot run
                raise LlmcError(f"pass '{pass_.name}' left a graph onnxruntime cannot run: "
                                f"{first_line(exc)}") from None
            comparison = compare_outputs(reference, outputs)
            entry["verify"] = comparison.to_dict()
            if not comparison.max_abs <= tolerance:
                raise LlmcError(f"pass '{pass_.name}' changed the outputs beyond tolerance: max abs "
                                f"error {comparison.max_abs:.3g} > {tolerance:g} on "
                                f"'{comparison.worst_output}'")
        report.append(entry)
        if result.matches:
            progress(f"{pass_.name}: {result.matches} matched, {nodes_before} → {entry['nodes_after']} nodes")
    return model, report


def refresh_shapes(model: onnx.ModelProto) -> None:
    """Recompute value_info so passes see current shapes (stale entries are dropped first)."""
    del model.graph.value_info[:]
    model.graph.value_info.extend(infer_value_info(model, data_prop=True))


def structural_problem(graph: onnx.GraphProto) -> str | None:
    """What makes `graph` unrunnable by construction, or None: a node reading a value nothing
    defines before it (a dangling input, a cycle or a bad order) or a value defined twice.

    Cheap enough to run after every pass, unlike the checker, which serializes the model.
    """
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    return _first_problem(graph, defined)


_GRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _first_problem(graph: onnx.GraphProto, defined: set[str]) -> str | None:
    for node in graph.node:
        for name in node.input:
            if name not in defined:
                return f"node '{node.name or node.op_type}' reads '{name}', which no earlier node defines"
        for attribute in node.attribute:  # If/Loop bodies may read values of the enclosing graph
            for body in [attribute.g, *attribute.graphs] if attribute.type in _GRAPH_ATTRIBUTES else []:
                problem = _first_problem(body, defined | {i.name for i in body.input}
                                         | {t.name for t in body.initializer})
                if problem:
                    return problem
        for name in node.output:
            if name and name in defined:
                return f"node '{node.name or node.op_type}' defines '{name}' a second time"
            defined.add(name)
    missing = [o.name for o in graph.output if o.name not in defined]
    return f"graph output '{missing[0]}' is not computed" if missing else None


def _check_valid(model: onnx.ModelProto, pass_name: str) -> None:
    try:
        check_model(model)
        infer_value_info(model, strict_mode=True)
    except Exception as exc:  # checker and inference raise several types
        raise LlmcError(f"pass '{pass_name}' left an invalid graph: "
                        f"{first_line(exc)}") from None


def optimize_file(source: str | os.PathLike, output: str | os.PathLike, *, level: str | int | None = None,
                  passes: Iterable[str] | None = None, verify: bool = False,
                  report: str | os.PathLike | None = None,
                  progress: Callable[[str], None] = lambda message: None) -> list[dict]:
    """`llmc optimize`: load an ONNX file, run a pipeline, save the result (and the report).

    Args:
        source: the ONNX file (external data beside it is loaded).
        output: where to write the optimized graph (atomically; external data past 2 GB).
        level, passes, verify, progress: as for `optimize`.
        report: optional JSON file for the per-pass report.
    """
    resolve(level, passes)  # a bad option fails before the model is read
    model = load_onnx(source)
    validate(model, Path(source))
    model, entries = optimize(model, level=level, passes=passes, verify=verify, progress=progress)
    save_onnx(model, output)
    if report is not None:
        write_text_atomic(report, json.dumps({"source": str(source), "passes": entries}, indent=2))
    return entries
