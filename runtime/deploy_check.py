"""Whether an engine file runs on this machine (`llmc inspect ENGINE --json`'s "deploy"): the
checks a CI job or a container entrypoint runs before serving, each with what it found.

- the file: its format version and every section's checksum;
- its backend (runtime/backends/registry.py): one this build runs, the libraries it imports
  importable, then the backend's own checks (the CPU's execution provider; TensorRT: a GPU, and the
  engine built for this machine's TensorRT release and GPU).
"""

from __future__ import annotations

import importlib
import platform
from typing import Any

from llmc.errors import LlmcError
from llmc.formats.engine_file import read_engine
from llmc.runtime.backends.registry import BACKENDS


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
    entry = BACKENDS.get(manifest.backend)
    if entry is None:
        record("backend", False, f"'{manifest.backend}': not one this llmc runs")
        return checks
    found = [(module, why, _version(module)) for module, why in entry.requirements]
    for module, why, version in found:
        record(module, version is not None, f"{version} ({why})" if version else f"not importable ({why})")
    if all(version is not None for _, _, version in found) and entry.machine_checks() is not None:
        entry.machine_checks()(manifest, record)
    return checks


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:  # an ImportError, or a library that fails as it loads (libnvinfer)
        return None
