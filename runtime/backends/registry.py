"""The backends this build of llmc runs, by the engine file's `backend` name: one explicit table.

An entry names its module and class rather than importing them, so that reading an engine file,
or checking whether it can run here (runtime/deploy_check.py), imports no backend's libraries
(TensorRT's import needs a GPU's driver).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from llmc.errors import LlmcError
from llmc.formats.engine_file import EngineFile
from llmc.runtime.backends.base import Backend, BackendOptions, missing_members
from llmc.runtime.kv_cache import KvCache


@dataclass(frozen=True)
class BackendEntry:
    """One backend.

    Args:
        name: the engine file's `backend`.
        target: "module:Class" of its `Backend`, imported when an engine of its kind loads; or the
            class itself (a backend registered at run time).
        requirements: (module, why) of each library it imports: the deploy check imports them.
        deploy_checks: "module:function" of its further deploy checks, called with the manifest
            and a `record(check, ok, detail) -> ok` function; None: none.
    """

    name: str
    target: str | type
    requirements: tuple[tuple[str, str], ...] = ()
    deploy_checks: str | None = None

    def load(self) -> type[Backend]:
        return _resolve(self.target)

    def machine_checks(self) -> Callable | None:
        return None if self.deploy_checks is None else _resolve(self.deploy_checks)


BACKENDS: dict[str, BackendEntry] = {}


def register(entry: BackendEntry) -> None:
    """Add a backend; a name already taken is refused."""
    if entry.name in BACKENDS:
        raise LlmcError(f"backend '{entry.name}' is registered already")
    BACKENDS[entry.name] = entry


def unregister(name: str) -> None:
    BACKENDS.pop(name, None)


def entry_for(engine: EngineFile) -> BackendEntry:
    """The entry that runs `engine`, or an LlmcError naming the file."""
    entry = BACKENDS.get(engine.manifest.backend)
    if entry is None:
        raise LlmcError(f"{engine.path}: backend '{engine.manifest.backend}' cannot run here; this build of llmc "
                        f"runs {', '.join(sorted(BACKENDS))} engines")
    return entry


def open_backend(engine: EngineFile, options: BackendOptions = BackendOptions(),
                 kv_pool_mb: float | None = None) -> tuple[Backend, KvCache]:
    """The backend of `engine`, loaded, and the KV cache it runs on (the caller owns both)."""
    backend = entry_for(engine).load()(engine, options)
    missing = missing_members(backend)
    if missing:
        raise LlmcError(f"backend '{engine.manifest.backend}': {type(backend).__name__} lacks {', '.join(missing)} "
                        "(runtime/backends/base.py, Backend)")
    return backend, attach_cache(backend, engine, kv_pool_mb)


def attach_cache(backend: Backend, engine: EngineFile, kv_pool_mb: float | None = None) -> KvCache:
    """A KV cache where `backend` places it, sized now (its weights loaded), attached to it."""
    placement = backend.placement
    kv = KvCache(engine.manifest, kv_pool_mb, allocate=placement.allocate, available=placement.available,
                 max_blocks=placement.max_blocks, dtype=placement.dtype, block_shapes=placement.block_shapes)
    backend.attach(kv)
    return kv


def _resolve(target: str | Callable):
    if not isinstance(target, str):
        return target
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


for _entry in (
    BackendEntry("onnxruntime", "llmc.runtime.backends.cpu:CpuBackend",
                 (("onnxruntime", "runs the graphs"), ("numba", "the CPU attention kernel")),
                 "llmc.runtime.backends.cpu:deploy_checks"),
    BackendEntry("openvino", "llmc.runtime.backends.openvino:OpenVinoBackend",
                 (("openvino", "runs the engine: pip install 'llmc[openvino]'"),),
                 "llmc.runtime.backends.openvino:deploy_checks"),
    BackendEntry("tensorrt", "llmc.runtime.backends.tensorrt:TensorRTBackend",
                 (("tensorrt", "builds and runs the engine; pip install 'llmc[tensorrt]' on a machine with an "
                               "NVIDIA GPU"), ("torch", "the KV pool")),
                 "llmc.runtime.backends.tensorrt:deploy_checks"),
):
    register(_entry)
