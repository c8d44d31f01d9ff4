"""Checks on the graph `llmc compile` is about to write: no invalid engine, ever.

The pipeline checks each pass's graph structurally as it goes (compiler/pipeline.py). Before the
engine is written, the optimized graph must also run in onnxruntime and, when no precision option
changed the numerics, give the source graph's outputs on seeded inputs; when it does not, the
pipeline is run again under `--verify` to name the pass at fault. The final graph (after the paged
lowering) must pass onnx's checker and strict shape inference.
"""

from __future__ import annotations

import re
from concurrent.futures import Executor
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx

from llmc.compiler.compare import compare_outputs, run_onnx, run_onnx_file, seeded_feeds
from llmc.formats.onnx_io import check_model, infer_value_info, is_large, load_onnx
from llmc.compiler.pipeline import optimize
from llmc.errors import LlmcError, first_line
from llmc.plugins.paged_attention_onnx import register

# Relative to the largest reference output magnitude: fused ops reorder float sums, nothing more.
TOLERANCE = 1e-4
_PAST_KEY = re.compile(r"past_key_values\.(\d+)\.key$")


class SourceOutputs:
    """The source graph's outputs on the check's seeded inputs, computed on `background` from the
    start of a compile: onnxruntime releases the GIL while it loads and runs the file, so on a
    second core the reference costs the passes nothing (SmolLM2-135M: ~1.5 s of its compile)."""

    def __init__(self, model: onnx.ModelProto, source: Path, background: Executor):
        self.source = source
        self.feeds = _check_feeds(model, frozenset(n.op_type for n in model.graph.node))
        self._outputs = background.submit(run_onnx_file, source, self.feeds)

    def for_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The source's outputs on `feeds`: the early run's when its inputs were these (the passes
        kept the graph's interface), else a run now."""
        same = feeds.keys() == self.feeds.keys() and all(np.array_equal(v, self.feeds[k]) for k, v in feeds.items())
        return self._outputs.result() if same else run_onnx_file(self.source, feeds)


def _check_feeds(model: onnx.ModelProto, source_ops: frozenset[str]) -> dict[str, np.ndarray]:
    # onnxruntime's GroupQueryAttention (genai's graphs) runs a prompt over a past for one sequence only.
    return seeded_feeds(model, **({"batch": 1} if "GroupQueryAttention" in source_ops else {}))


def check_against_source(model: onnx.ModelProto, source: Path, *, exact: bool,
                         level: str | int | None, passes: Iterable[str] | None,
                         source_ops: frozenset[str] | None = None,
                         source_outputs: SourceOutputs | None = None,
                         progress: Callable[[str], None] = lambda message: None) -> None:
    """Run the optimized `model` and the `source` file on the same seeded inputs.

    Args:
        model: the graph after passes (and precision), weights loaded.
        source: the ONNX file it was compiled from.
        exact: compare outputs (no precision option was applied); otherwise only require that the
            graph runs and its outputs are finite.
        level, passes: the pipeline that made `model`, rerun under --verify to name a faulty pass.
        source_ops: the source graph's op types, when the caller has them (else the file is read).
        source_outputs: the source's outputs, started early by the caller (else run here).
        progress: called with a short line.
    """
    if is_large(model):
        progress("onnxruntime check of the optimized graph skipped: past 2 GB it would hold the "
                 "weights twice more (the checker and shape inference still run)")
        return
    progress("checking the optimized graph against the source in onnxruntime")
    if source_ops is None:
        source_ops = frozenset(n.op_type for n in onnx.load(str(source), load_external_data=False).graph.node)
    feeds = _check_feeds(model, source_ops)
    try:
        got = run_onnx(model, feeds)
    except Exception as exc:  # onnxruntime raises its own types for graphs it cannot load or run
        _locate_pass(source, level, passes)
        raise LlmcError(f"{source}: the optimized graph does not run in onnxruntime: {first_line(exc)}") from None
    if not exact:
        bad = [name for name, value in got.items() if not np.isfinite(value).all()]
        if bad:
            raise LlmcError(f"{source}: the compiled graph's '{bad[0]}' has non-finite values on seeded inputs")
        return
    want = source_outputs.for_feeds(feeds) if source_outputs is not None else run_onnx_file(source, feeds)
    comparison = compare_outputs(want, got)
    scale = max(1.0, max(float(np.abs(v).max(initial=0.0)) for v in want.values()))
    if not comparison.max_abs <= TOLERANCE * scale:
        _locate_pass(source, level, passes)
        raise LlmcError(f"{source}: the optimized graph's '{comparison.worst_output}' differs from the source "
                        f"by {comparison.max_abs:.3g} on seeded inputs")


def unfused_attention(model: onnx.ModelProto, num_layers: int, report: list[dict]) -> str | None:
    """Why the graph cannot be paged because some layers' attention was not recognized, or None.

    A layer is fused when an Attention node reads its past keys (fuse-attention folds the past
    into the node).
    """
    fused = {int(m[1]) for node in model.graph.node if node.op_type == "Attention"
             for name in node.input[4:5] if (m := _PAST_KEY.match(name))}
    missing = [layer for layer in range(num_layers) if layer not in fused]
    if not missing:
        return None
    notes = [note for entry in report if entry["pass"] == "fuse-attention" for note in entry["notes"]
             if not note.startswith(("target:", "opset"))]
    why = f" ({notes[-1]})" if notes else ""
    layers = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
    return (f"attention not recognized in {len(missing)} of {num_layers} layers (layers {layers}){why}; "
            "the engine keeps their unfused attention with the contiguous past/present cache")


def check_engine_graph(model: onnx.ModelProto, output: Path) -> None:
    """onnx's checker and strict shape inference on the final graph (llmc's ops registered)."""
    register()
    try:
        check_model(model)
        infer_value_info(model, check_type=True, strict_mode=True)
    except Exception as exc:  # checker and inference raise several types; all mean a broken graph
        raise LlmcError(f"{output}: the engine's graph is invalid, nothing written "
                        f"(a bug in llmc's lowering or precision passes): {first_line(exc)}") from None


def _locate_pass(source: Path, level, passes) -> None:
    """Rerun the pipeline on a fresh copy under --verify; it raises naming the first bad pass."""
    optimize(load_onnx(source), level=level, passes=passes, verify=True)


