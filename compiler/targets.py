"""Compile targets: what each `--backend` of `llmc compile` builds, one object per backend.

compiler/build.py runs the stages every engine shares (load, recognize, optimize, precision,
paged lowering, engine file) and asks the target for what differs: the int8 form of the layers
whose activations carry token outliers, whether the paged lowering also writes the
single-sequence graph, how the accuracy gate computes weight products, the weight-only rewrite
the backend runs, and the engine file's payload. A new backend is one `CompileTarget` subclass
and one entry in `TARGETS`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import onnx

from llmc.compiler.paged_engine import PagedOptions
from llmc.compiler.pipeline import refresh_shapes
from llmc.compiler.segments import dense_attention_sections, segment_sections
from llmc.compiler.tensorrt_network import (TensorRTOptions, check_network, map_plugin_nodes, optimization_profile,
                                            standard_norms)
from llmc.errors import LlmcError
from llmc.formats.manifest import Geometry
from llmc.formats.onnx_io import engine_weights
from llmc.passes.graph import attr
from llmc.plugins.paged_attention import DEFAULT_BLOCK_SIZE as KV_BLOCK_SIZE
from llmc.plugins.paged_attention import OP_TYPE as PAGED_ATTENTION
from llmc.plugins.paged_attention import OPENVINO_BLOCK_SIZE
from llmc.precision.dequantize_linear import matmulnbits_as_dequantize
from llmc.precision.int8 import lower_per_token_for_onnxruntime
from llmc.precision.weight_only import DEFAULT_BLOCK_SIZE

SINGLE_SEQUENCE_SECTION = "single_sequence.onnx"
Progress = Callable[[str], None]


@dataclass(frozen=True)
class CompileTarget:
    """One backend's side of a build.

    Args:
        name: the `--backend` value and the manifest's "backend".
        outliers: the form of the int8 layers whose activations carry token outliers
            (precision/int8.py `OUTLIER_FORMS`): the one this backend runs.
        single_sequence: the paged lowering also writes the single-sequence graph
            (passes/lower_single_sequence.py) for the runtime's one-sequence steps.
        float_weight_products: the backend multiplies dequantized weights in float, so the
            accuracy gate computes weight products that way too (precision/gate.py).
        weights_block_size: weights per scale for weight-only layers when the options leave it open.
        reads_tensorrt_options: whether `TensorRTOptions` mean anything to this backend.
        block_size: tokens per KV block when the options leave it open.
        skipped_passes: passes of the named levels (`--level`) left out for this backend, whose
            own compiler runs the graph faster without them; an explicit `--passes` runs as given.
        computes_bf16: whether the backend can compute in bf16 (`--bf16`).
    """

    name: str
    outliers: str
    single_sequence: bool
    float_weight_products: bool
    weights_block_size: int
    reads_tensorrt_options: bool = False
    block_size: int = KV_BLOCK_SIZE
    skipped_passes: frozenset[str] = frozenset()
    computes_bf16: bool = False

    def check(self, paged: PagedOptions | None, tensorrt: TensorRTOptions) -> None:
        """Refuse, before any work, options this backend would ignore or cannot build."""
        if not self.reads_tensorrt_options and tensorrt != TensorRTOptions():
            changed = next(f.name for f in dataclasses.fields(tensorrt)
                           if getattr(tensorrt, f.name) != getattr(TensorRTOptions(), f.name))
            raise LlmcError(f"{TENSORRT_FLAGS[changed]}: only for --backend tensorrt")

    def lower_precision(self, model: onnx.ModelProto, progress: Progress) -> dict[str, Any]:
        """Rewrite the quantized layers into forms this backend runs and refresh the graph's
        shapes (the paged lowering reads ranks); returns what it adds to the precision entry."""
        refresh_shapes(model)
        return {}

    def network(self, model: onnx.ModelProto, source: Path, paged: dict[str, Any] | None, not_paged: str,
                options: TensorRTOptions) -> dict[str, Any] | None:
        """The check of the network the backend's builder would parse, or None where it parses none."""
        return None

    def payload(self, model: onnx.ModelProto, single: onnx.ModelProto | None, paged: dict[str, Any] | None,
                geometry: Geometry, network: dict[str, Any] | None, manifest: dict[str, Any],
                options: TensorRTOptions, progress: Progress) -> dict[str, Any]:
        """The engine file's sections other than the tokenizer, in file order; completes `paged`
        and `manifest` with what the build decided."""
        raise NotImplementedError


@dataclass(frozen=True)
class OnnxRuntimeTarget(CompileTarget):
    """onnxruntime on the CPU: the graph cut into segments at the paged attention (or whole,
    when contiguous), with the weights streamed into the file from where they are."""

    def lower_precision(self, model, progress):
        entry = {"per_token_as_matmulnbits": lower_per_token_for_onnxruntime(model)}
        refresh_shapes(model)
        return entry

    def payload(self, model, single, paged, geometry, network, manifest, options, progress):
        weights = engine_weights(model, *([single] if single is not None else []))
        if paged is None:
            return {"model.onnx": model.SerializeToString(), "model.onnx.data": weights}
        paged["single_sequence"] = single and SINGLE_SEQUENCE_SECTION
        paged["segments"], payload = segment_sections(model)
        if single is not None:
            payload[SINGLE_SEQUENCE_SECTION] = single.SerializeToString()
        payload.update(dense_attention_sections(paged["segments"], geometry, paged["block_size"], paged["kv_dtype"]))
        return {**payload, "model.onnx.data": weights}


@dataclass(frozen=True)
class OpenVinoTarget(OnnxRuntimeTarget):
    """OpenVINO on the CPU (runtime/backends/openvino.py): the segments of an onnxruntime engine,
    joined at load into one OpenVINO model with its own paged attention, which keeps blocks of 32
    tokens in the compute precision chosen at load (bf16 under --bf16 where the CPU has it), or in
    float16 with --kv-cache-dtype fp16."""

    def check(self, paged, tensorrt):
        super().check(paged, tensorrt)
        if paged is None:
            raise LlmcError("--no-paged and --backend openvino: OpenVINO engines are paged (its paged attention)")
        if paged.block_size not in (None, self.block_size):
            raise LlmcError(f"--block-size {paged.block_size}: --backend openvino keeps blocks of {self.block_size} "
                            "tokens (OpenVINO's CPU paged attention)")

    def network(self, model, source, paged, not_paged, options):
        """Refuse, before anything is written, a graph OpenVINO's paged attention cannot run."""
        if paged is None:
            raise LlmcError(f"{source}: an OpenVINO engine needs the paged lowering, which this model cannot take "
                            f"({not_paged})")
        for node in model.graph.node:
            softcap = attr(node, "softcap", 0.0) if node.op_type == PAGED_ATTENTION else 0.0
            if softcap:
                raise LlmcError(f"--backend openvino: attention soft-capping ({softcap}, {node.name}) has no "
                                "OpenVINO paged attention; use --backend onnxruntime")
        return None

    def payload(self, model, single, paged, geometry, network, manifest, options, progress):
        # onnxruntime's sections (no single-sequence graph: one OpenVINO model runs every step)
        return super().payload(model, None, paged, geometry, network, manifest, options, progress)


@dataclass(frozen=True)
class TensorRTTarget(CompileTarget):
    """TensorRT on an NVIDIA GPU: one engine for the whole paged graph, its attention the
    llmc::paged_attention plugin."""

    def check(self, paged, tensorrt):
        if paged is None:
            raise LlmcError("--no-paged and --backend tensorrt: TensorRT engines are paged (the llmc::paged_attention "
                            "plugin)")

    def lower_precision(self, model, progress):
        refresh_shapes(model)
        return {"weight_only_as_dequantize_linear": matmulnbits_as_dequantize(model, progress)}

    def network(self, model, source, paged, not_paged, options):
        """Map the plugin nodes for TensorRT's parser, derive the profile and check every node."""
        if paged is None:
            raise LlmcError(f"{source}: a TensorRT engine needs the paged lowering, which this model cannot take "
                            f"({not_paged})")
        map_plugin_nodes(model)
        standard_norms(model)
        profile = optimization_profile(model, max_batch=paged["max_batch"], max_seq_len=paged["max_seq_len"],
                                       block_size=paged["block_size"], num_blocks=paged["num_blocks"],
                                       max_num_tokens=options.max_num_tokens)
        return {**check_network(model).to_dict(),
                "profile": {name: [list(s) for s in shapes] for name, shapes in profile.items()},
                "options": dataclasses.asdict(options)}

    def payload(self, model, single, paged, geometry, network, manifest, options, progress):
        from llmc.compiler.tensorrt_build import build_engine

        paged["segments"], paged["single_sequence"] = [], None  # one TensorRT engine runs every step
        engine, manifest["tensorrt"] = build_engine(model, network["profile"], options, progress)
        return {"engine.trt": engine}


# TensorRTOptions' fields as `llmc compile` spells them.
TENSORRT_FLAGS = {"max_num_tokens": "--max-num-tokens", "optimization_level": "--builder-optimization-level",
                  "timing_cache": "--timing-cache", "workspace_mb": "--workspace-mb",
                  "hardware_compatible": "--hardware-compatible", "version_compatible": "--version-compatible",
                  "dry_run": "--dry-run"}


def _registry(*targets: CompileTarget) -> dict[str, CompileTarget]:
    names = [t.name for t in targets]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"compile targets registered twice: {', '.join(duplicates)}")
    return {t.name: t for t in targets}


TARGETS = _registry(
    OnnxRuntimeTarget("onnxruntime", outliers="per-token", single_sequence=True, float_weight_products=False,
                      weights_block_size=DEFAULT_BLOCK_SIZE),
    OpenVinoTarget("openvino", outliers="per-token", single_sequence=False, float_weight_products=False,
                   weights_block_size=DEFAULT_BLOCK_SIZE, block_size=OPENVINO_BLOCK_SIZE,
                   # Merged Q/K/V and gate/up products reach OpenVINO as one product and a split,
                   # which keeps its CPU plugin from fusing SiLU into the gate's product: ~5% of a
                   # 128-token prompt's step (SmolLM2-135M, bf16).
                   skipped_passes=frozenset({"merge-sibling-matmuls"}), computes_bf16=True),
    # TensorRT has no run-time int8 activation scales: its int8 engines keep those layers'
    # activations in float. Its int4 blocks hold 64 or 128 weights (precision/dequantize_linear.py
    # INT4_BLOCK_SIZES); 64 also divides common hidden sizes (SmolLM2's 576, which 128 does not).
    TensorRTTarget("tensorrt", outliers="int8-weights", single_sequence=False, float_weight_products=True,
                   weights_block_size=64, reads_tensorrt_options=True),
)
BACKENDS = tuple(TARGETS)


def find_target(backend: str) -> CompileTarget:
    """The target named `backend`, or one line listing the valid names."""
    if backend not in TARGETS:
        raise LlmcError(f"--backend: unknown backend '{backend}' (choose from {', '.join(TARGETS)})")
    return TARGETS[backend]
