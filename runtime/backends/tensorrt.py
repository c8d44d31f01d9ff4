"""One step of a paged TensorRT engine on an NVIDIA GPU: the same contract as the CPU backend
(runtime/backends/paged_onnxruntime.py): packed tokens in, the asked rows' logits out, the step's
new keys and values stored into the pool afterwards.

The engine (compiler/tensorrt_build.py) runs the whole graph, the ``llmc::paged_attention``
plugin inside it reading the pool in place. This object owns the device side: the KV pool (one
key and one value tensor per layer, torch on the GPU), one execution context, and runs everything
on torch's current CUDA stream. Inputs and outputs are bound by address (`set_tensor_address`), so nothing is copied
but the step's few index arrays in and the logits rows out; the pool is bound once. The new
keys and values come out of the graph and are scattered into the pool's slots by one indexed
store per layer on the same stream, as the CPU backend does; copy-on-write copies pool blocks
on the device.

Loading checks the engine's build against this machine first: a serialized TensorRT engine
runs only on the TensorRT release and GPU that built it, unless it was built version- or
hardware-compatible, and TensorRT's own refusal deep in deserialization names neither side.

Nothing here has run: no machine this project is built on has TensorRT (README, "TensorRT").
Its names are checked against TensorRT 11.4's bindings in the test suite, and its bookkeeping
runs there on the CPU with a stand-in for TensorRT's core.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import LlmcError
from llmc.formats.engine_file import EngineFile
from llmc.formats.manifest import TensorRTBuild
from llmc.plugins.cuda_device import current_gpu
from llmc.plugins.paged_attention import PagedBatch
from llmc.runtime.backends.paged_onnxruntime import pool_blocks

SECTION = "engine.trt"


def check_compatible(build: TensorRTBuild, installed: str, gpu: dict[str, str], where: str) -> None:
    """Raise one line naming both sides when this TensorRT or GPU cannot run the engine.

    Args:
        build: the engine's manifest entry.
        installed: this machine's TensorRT version.
        gpu: this machine's GPU ("name", "compute_capability").
        where: the engine file, for the message.
    """
    built, here = (tuple(int(part) for part in v.split(".")[:2]) for v in (build.version, installed))
    if built != here and not (build.version_compatible and built[0] == here[0] and here > built):
        raise LlmcError(f"{where}: built with TensorRT {build.version}, this machine has {installed}; recompile "
                        f"it here (or build it with --version-compatible)")
    if gpu["compute_capability"] != build.compute_capability:
        newer_ampere = float(gpu["compute_capability"]) >= 8.0
        if not (build.hardware_compatible and newer_ampere):
            raise LlmcError(f"{where}: built for {build.gpu} (compute capability {build.compute_capability}), this "
                            f"machine has {gpu['name']} ({gpu['compute_capability']}); recompile it here (or build "
                            f"it with --hardware-compatible)")


def require_tensorrt_runtime():
    """tensorrt and torch (the device memory), or one line saying what to install."""
    try:
        import tensorrt as trt
        import torch
    except ImportError as exc:
        raise LlmcError(f"this engine is a TensorRT engine: running it needs TensorRT and PyTorch with CUDA "
                        f"(pip install 'llmc[tensorrt]' on a machine with an NVIDIA GPU): {exc}") from None
    return trt, torch


class TensorRTDecoder:
    """The execution context, the KV pool on the GPU and the step.

    Args:
        engine: a TensorRT engine file (backend "tensorrt").
        threads: unused (CPU threads); kept for the backends' common signature.
        kv_pool_mb: the KV pool's size in MiB; None: the compiled size, or the default rule
            (`pool_blocks`) over the GPU's free memory.
        device: "cuda" (the GPU that runs the engine), or "cpu" for tests with a stand-in for
            TensorRT's core.
    """

    def __init__(self, engine: EngineFile, threads: int | None = None, kv_pool_mb: float | None = None,
                 device: str = "cuda"):
        trt, torch = require_tensorrt_runtime()
        manifest, paged = engine.manifest, engine.manifest.paged
        if manifest.tensorrt is None or paged is None:
            raise LlmcError(f"{engine.path}: not a paged TensorRT engine (backend {manifest.backend})")
        if device == "cuda" and not torch.cuda.is_available():
            raise LlmcError(f"{engine.path}: a TensorRT engine needs an NVIDIA GPU; torch sees none")
        check_compatible(manifest.tensorrt, trt.__version__, current_gpu() if device == "cuda" else
                         {"name": manifest.tensorrt.gpu, "compute_capability": manifest.tensorrt.compute_capability},
                         str(engine.path))
        self.torch, self.trt, self.device = torch, trt, device
        self.geometry, self.block_size, self.max_seq_len = manifest.geometry, paged.block_size, paged.max_seq_len
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        if manifest.tensorrt.version_compatible:
            self._runtime.engine_host_code_allowed = True  # the lean runtime stored in the engine
        self._engine = self._runtime.deserialize_cuda_engine(bytes(engine.sections[SECTION]))
        if self._engine is None:
            raise LlmcError(f"{engine.path}: TensorRT could not load the engine (its log above says why: a plugin "
                            f"missing from this TensorRT, or a corrupted section)")
        self._context = self._engine.create_execution_context()
        free = torch.cuda.mem_get_info()[0] if device == "cuda" else None
        self.num_blocks = pool_blocks(paged, self.geometry, kv_pool_mb, available=free)
        shape = (self.num_blocks, self.geometry.num_kv_heads, paged.block_size, self.geometry.head_dim)
        pool_type = getattr(torch, paged.kv_dtype)
        self.pools = {f"{part}_cache.{i}": torch.zeros(shape, dtype=pool_type, device=device)
                      for i in range(self.geometry.num_layers) for part in ("key", "value")}
        for name, pool in self.pools.items():  # bound once: the pool never moves
            self._context.set_input_shape(name, tuple(pool.shape))
            self._context.set_tensor_address(name, pool.data_ptr())
        self._outputs = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)
                         if self._engine.get_tensor_mode(self._engine.get_tensor_name(i)) == trt.TensorIOMode.OUTPUT]

    def keep(self, sequence: int, length: int) -> None:
        """Speculative tokens not kept: the step wrote them into the pool, where nothing reads
        them (see `PagedDecoder.keep`); nothing to undo."""

    def step(self, tokens: np.ndarray, positions: np.ndarray, batch: PagedBatch,
             rows: np.ndarray | None = None, exact: bool = False) -> np.ndarray:
        """Run one packed step; stores its keys and values; returns the logits of the packed
        `rows` (default: each sequence's last token), [rows, vocab] float32 on the host.
        `exact` is the CPU decoder's (its whole graph's padding row); nothing here pads."""
        torch = self.torch
        rows = batch.query_start_loc[1:] - 1 if rows is None else rows
        feeds = {"input_ids": tokens[None], "position_ids": positions[None], "block_tables": batch.block_tables,
                 "context_lens": batch.context_lens, "query_start_loc": batch.query_start_loc,
                 "logits_rows": np.asarray(rows, np.int64)}
        bound = {}
        for name, array in feeds.items():
            tensor = torch.from_numpy(np.ascontiguousarray(array, np.int64)).to(self.device, non_blocking=True)
            self._context.set_input_shape(name, tuple(tensor.shape))
            self._context.set_tensor_address(name, tensor.data_ptr())
            bound[name] = tensor  # alive until the step is done
        outputs = {}
        for name in self._outputs:
            shape = tuple(self._context.get_tensor_shape(name))
            outputs[name] = torch.empty(shape, dtype=self._torch_type(self._engine.get_tensor_dtype(name)),
                                        device=self.device)
            self._context.set_tensor_address(name, outputs[name].data_ptr())
        # torch's current stream for everything: the input copies before the engine, the stores
        # and block copies after it are then ordered without events.
        stream = torch.cuda.current_stream().cuda_stream if self.device == "cuda" else 0
        if not self._context.execute_async_v3(stream):
            raise LlmcError("TensorRT: the engine's step failed (its log above says why)")
        blocks, offsets = batch.slots(self.block_size)
        index_blocks = torch.from_numpy(blocks).to(self.device)
        index_offsets = torch.from_numpy(offsets).to(self.device)
        for layer in range(self.geometry.num_layers):
            for part in ("key", "value"):
                pool = self.pools[f"{part}_cache.{layer}"]
                pool[index_blocks, :, index_offsets] = outputs[f"new_{part}.{layer}"].to(pool.dtype)
        return outputs["logits"][0].float().cpu().numpy()  # the copy to the host waits for the stream

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: pool block `src` into `dst` for each pair, in every pool, on the device."""
        if not pairs:
            return
        src = self.torch.tensor([s for s, _ in pairs], device=self.device)
        dst = self.torch.tensor([d for _, d in pairs], device=self.device)
        for pool in self.pools.values():
            pool[dst] = pool[src]

    def warm_up(self) -> None:
        """One throw-away decode step, so the first real one does not pay for lazy CUDA set-up.
        It writes only into block 0 before any request owns it."""
        batch = PagedBatch(np.zeros((1, 1), np.int64), np.zeros(1, np.int64), np.array([0, 1], np.int64))
        self.step(np.zeros(1, np.int64), np.zeros(1, np.int64), batch)

    def _torch_type(self, data_type: Any):
        trt, torch = self.trt, self.torch
        types = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                 trt.int64: torch.int64, trt.int32: torch.int32}
        if data_type not in types:
            raise LlmcError(f"TensorRT engine output of type {data_type}: not one llmc reads")
        return types[data_type]


def layer_information(engine: EngineFile) -> str:
    """TensorRT's engine inspector's per-layer description (one line a layer), or why not."""
    try:
        trt, _ = require_tensorrt_runtime()
    except LlmcError:
        return "per-layer information needs TensorRT on a GPU (not installed here)"
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    deserialized = runtime.deserialize_cuda_engine(bytes(engine.sections[SECTION]))
    if deserialized is None:
        return "per-layer information: TensorRT could not load this engine here"
    inspector = deserialized.create_engine_inspector()
    return str(inspector.get_engine_information(trt.LayerInformationFormat.ONELINE))
