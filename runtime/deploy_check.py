"""Whether an engine file runs on this machine (`llmc inspect ENGINE --json`'s "deploy"): the
checks a CI job or a container entrypoint runs before serving, each with what it found.

- the file: its format version and every section's checksum;
- onnxruntime engines: onnxruntime (and its CPU execution provider) and Numba importable;
- TensorRT engines: TensorRT and torch importable, an NVIDIA GPU, and the engine's TensorRT
  version and GPU compatible with this machine's (runtime/backends/tensorrt.py's rule).
"""

from __future__ import annotations

import importlib
import platform
from typing import Any

from llmc.errors import LlmcError
from llmc.formats.engine_file import read_engine


def deploy_checks(path: str) -> list[dict[str, Any]]:
    """[{"check", "ok", "detail"}] for the engine at `path`; the first failure of a chain stops it."""
    checks: list[dict[str, Any]] = []

    def record(name: str, ok: bool, detail: str) -> bool:
        checks.append({"check": name, "ok": ok, "detail": detail})
        return ok

    try:
        engine = read_engine(path, verify=True)
    except LlmcError as error:
        record("engine file", False, str(error))
        return checks
    manifest = engine.manifest
    record("engine file", True, f"format {manifest.format_version}, {len(manifest.sections)} sections, checksums match")
    record("machine", True, f"{platform.machine()}, {platform.system()}, Python {platform.python_version()}")
    if manifest.backend == "onnxruntime":
        for module, why in (("onnxruntime", "runs the graphs"), ("numba", "the CPU attention kernel")):
            found = _version(module)
            record(module, found is not None, f"{found} ({why})" if found else f"not importable ({why}): pip install llmc")
        if _version("onnxruntime"):
            import onnxruntime

            providers = onnxruntime.get_available_providers()
            record("CPU execution provider", "CPUExecutionProvider" in providers, ", ".join(providers))
    elif manifest.backend == "tensorrt":
        _tensorrt_checks(manifest, record)
    else:
        record("backend", False, f"'{manifest.backend}': not one this llmc runs")
    return checks


def _tensorrt_checks(manifest, record) -> None:
    from llmc.plugins.cuda_device import current_gpu
    from llmc.runtime.backends.tensorrt import check_compatible

    installed = _version("tensorrt")
    if not record("tensorrt", installed is not None,
                  installed or "not importable: pip install 'llmc[tensorrt]' on a machine with an NVIDIA GPU"):
        return
    if not record("torch", _version("torch") is not None, _version("torch") or "not importable (the KV pool)"):
        return
    try:
        gpu = current_gpu()
    except LlmcError as error:
        record("GPU", False, str(error))
        return
    record("GPU", True, f"{gpu['name']} (compute capability {gpu['compute_capability']})")
    try:
        check_compatible(manifest.tensorrt, installed, gpu, "engine")
        record("built for this TensorRT and GPU", True,
               f"TensorRT {manifest.tensorrt.version} on {manifest.tensorrt.gpu}")
    except LlmcError as error:
        record("built for this TensorRT and GPU", False, str(error))


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:  # an ImportError, or a library that fails as it loads (libnvinfer)
        return None
