"""`llmc.inspect`: what is inside an engine file or an ONNX model, as a value to print or dump.

    report = llmc.inspect("engine.plan", deploy=True)
    print(report.text()); report.runs_here

An engine's view is its manifest (read and checked against the schema, sections not hashed)
and, when asked, whether it runs on this machine (runtime/deploy_check.py); an ONNX model's is
its summary (compiler/onnx_summary.py: interface, op histogram, parameters, size).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from llmc.errors import LlmcError
from llmc.formats.engine_file import MAGIC, read_manifest
from llmc.formats.manifest import build_options_summary, kv_cache_summary


@dataclass(frozen=True)
class EngineInspection:
    """An engine file's manifest, and its deploy checks when they were asked for.

    Args:
        path: the engine file.
        manifest: its manifest, as written.
        deploy: [{"check", "ok", "detail"}] (runtime/deploy_check.py), or None when not asked.
    """

    path: str
    manifest: dict[str, Any]
    deploy: list[dict[str, Any]] | None = None

    @property
    def runs_here(self) -> bool | None:
        """Whether every deploy check passed; None when they were not run."""
        return None if self.deploy is None else all(c["ok"] for c in self.deploy)

    def to_dict(self) -> dict[str, Any]:
        """The manifest, with "deploy" when the checks were run."""
        if self.deploy is None:
            return dict(self.manifest)
        return {**self.manifest, "deploy": {"runs_here": self.runs_here, "checks": self.deploy}}

    def text(self) -> str:
        """The manifest for people, one field a line (a TensorRT engine's layers need TensorRT)."""
        manifest, g = self.manifest, self.manifest["geometry"]  # read_manifest checked every field
        lines = [f"engine        {self.path} (format {manifest['format_version']}, llmc {manifest['llmc_version']})",
                 f"backend       {manifest['backend']}   dtype {manifest['dtype']}",
                 f"geometry      {g['num_layers']} layers, {g['num_heads']} heads, "
                 f"{g['num_kv_heads']} kv heads, head dim {g['head_dim']}, "
                 f"vocab {g['vocab_size']}, {g['max_positions']} positions",
                 f"source        {manifest['source']['file']} ({manifest['source']['nodes']} nodes, "
                 f"sha256 {manifest['source']['sha256'][:16]}…)",
                 f"build options {build_options_summary(manifest['build_options'])}",
                 f"kv cache      {kv_cache_summary(manifest)}"]
        if manifest["backend"] == "openvino":  # the precision this machine gives it, picked at load
            from llmc.formats.manifest import parse_manifest
            from llmc.runtime.backends.openvino import compute_precision, decode_model, f32_width, weight_only

            parsed = parse_manifest(manifest, str(self.path))
            precision, why = compute_precision(parsed)
            lines.append(f"compute       {why}")
            decode = decode_model(precision, weight_only(parsed), f32_width=f32_width(parsed))[1]
            lines.append(f"decode        {decode}")
        if manifest["backend"] != "tensorrt":  # a CPU engine's weights live on malloc's heap
            from llmc.runtime.huge_pages import summary

            lines.append(f"memory pages  {summary()}")
        if manifest.get("tensorrt"):
            t = manifest["tensorrt"]
            portable = [kind for kind in ("hardware", "version") if t[f"{kind}_compatible"]]
            lines.append(f"tensorrt      {t['version']}, built on {t['gpu']} (compute capability "
                         f"{t['compute_capability']}{'; ' + ' and '.join(portable) + ' compatible' if portable else ''}"
                         f"), builder level {t['optimization_level']}, plugins "
                         f"{', '.join(f'{k} v{v}' for k, v in t['plugins'].items())}")
        lines += [f"section       {s['name']}: {s['length']:,} bytes" for s in manifest["sections"]]
        if manifest.get("tensorrt"):
            from llmc.formats.engine_file import read_engine
            from llmc.runtime.backends.tensorrt import layer_information

            lines.append(f"layers        {layer_information(read_engine(self.path))}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ModelInspection:
    """An ONNX model's summary (compiler/onnx_summary.py `summarize`)."""

    path: str
    summary: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.summary)

    def text(self) -> str:
        summary = self.summary
        lines = [f"model         {self.path} (opset {summary['opsets']}, {summary['nodes']} nodes, "
                 f"{summary['parameters']:,} parameters, {summary['bytes']:,} bytes)"]
        lines += [f"input         {v['name']}: {v['dtype']} {v['shape']}" for v in summary["inputs"]]
        lines += [f"output        {v['name']}: {v['dtype']} {v['shape']}" for v in summary["outputs"]]
        lines += [f"op            {count:5d}  {op}" for op, count in summary["ops"].items()]
        return "\n".join(lines)


def is_engine_file(path: str | os.PathLike) -> bool:
    """Whether `path` starts as an engine file does (else it is taken for an ONNX model)."""
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def inspect(path: str | os.PathLike, *, deploy: bool = False) -> EngineInspection | ModelInspection:
    """What is inside an engine file or an ONNX model.

    Args:
        path: an engine file (`llmc compile`'s) or an ONNX model.
        deploy: for an engine, also check whether it runs on this machine (its sections hashed,
            its backend's libraries and device present).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LlmcError(f"{path}: no such file")
    if not is_engine_file(path):
        from llmc.compiler import onnx_summary

        return ModelInspection(path, onnx_summary.summarize(path))
    manifest = read_manifest(path)
    if not deploy:
        return EngineInspection(path, manifest)
    from llmc.runtime.deploy_check import deploy_checks

    return EngineInspection(path, manifest, deploy_checks(path))
