"""The TensorRT backend: a paged TensorRT engine's steps on an NVIDIA GPU (the contract:
runtime/backends/base.py): packed tokens in, the asked rows' logits out, the step's new keys and
values stored into the pool afterwards.

The engine (compiler/tensorrt_build.py) runs the whole graph, the ``llmc::paged_attention``
plugin inside it reading the pool in place. The engine's KV cache (runtime/kv_cache.py) holds the
pool, one torch tensor on the GPU that this object allocates for it and binds each layer's key and
value view of once; this object owns one execution context and runs everything
on torch's current CUDA stream. Inputs and outputs are bound by address (`set_tensor_address`), so nothing is copied
but the step's few index arrays in and the logits rows out; the pool is bound once. The new
keys and values come out of the graph and are scattered into the pool's slots by one indexed
store per layer on the same stream, as the CPU backend does; copy-on-write copies pool blocks
on the device.

Loading checks the engine's build against this machine first: a serialized TensorRT engine
runs only on the exact TensorRT release that built it (TensorRT's developer guide, "Version
Compatibility": a version-compatible engine, BuilderFlag.VERSION_COMPATIBLE, runs on later
releases of the same major version) and on the GPU's compute capability unless it was built
hardware-compatible; TensorRT's own refusal deep in deserialization names neither side.

The engine's one optimization profile bounds every step, and TensorRT refuses shapes outside it
(`set_input_shape` returns False): the pool is capped at the profile's block count, and a step
larger than the profile's tokens, sequences or logits rows (`Engine.logits` over a long text,
a scheduler budget above the compiled `--max-num-tokens`) runs as consecutive sub-steps, each
storing its keys and values before the next reads them.

Made with a timeline (`BackendOptions.timeline`, `llmc profile`), the backend records each engine
call on the "tensorrt" track and attaches TensorRT's layer profiler (`IProfiler`) to its context,
with `enqueue_emits_profile` off so that the engine's launch stays asynchronous, as trtexec's
--dumpProfile does: the call asks for the layer times (`report_to_profiler`) once the step's
stream is done, and records each layer inside the call. TensorRT reports a layer's duration, not
when it ran: the layers are laid end to end from the launch, in the order reported. Their names
are TensorRT's layers (the ONNX nodes' names, joined where it fused them: the engine is built
with detailed profiling verbosity). Without a timeline nothing is attached.

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
from llmc.runtime.backends.base import BackendOptions, PoolPlacement
from llmc.runtime.kv_cache import KvCache
from llmc.runtime.step_plan import StepPaths, StepPlan
from llmc.runtime.timeline import TENSORRT

SECTION = "engine.trt"


def check_compatible(build: TensorRTBuild, installed: str, gpu: dict[str, str], where: str) -> None:
    """Raise one line naming both sides when this TensorRT or GPU cannot run the engine.

    Args:
        build: the engine's manifest entry.
        installed: this machine's TensorRT version.
        gpu: this machine's GPU ("name", "compute_capability").
        where: the engine file, for the message.
    """
    built, here = _version(build.version), _version(installed)
    if built != here and not (build.version_compatible and built[0] == here[0] and here > built):
        raise LlmcError(f"{where}: built with TensorRT {build.version}, this machine has {installed}; recompile "
                        f"it here (or build it with --version-compatible)")
    if gpu["compute_capability"] != build.compute_capability:
        newer_ampere = float(gpu["compute_capability"]) >= 8.0
        if not (build.hardware_compatible and newer_ampere):
            raise LlmcError(f"{where}: built for {build.gpu} (compute capability {build.compute_capability}), this "
                            f"machine has {gpu['name']} ({gpu['compute_capability']}); recompile it here (or build "
                            f"it with --hardware-compatible)")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def require_tensorrt_runtime():
    """tensorrt and torch (the device memory), or one line saying what to install."""
    try:
        import tensorrt as trt
        import torch
    except ImportError as exc:
        raise LlmcError(f"this engine is a TensorRT engine: running it needs TensorRT and PyTorch with CUDA "
                        f"(pip install 'llmc[tensorrt]' on a machine with an NVIDIA GPU): {exc}") from None
    return trt, torch


# The step's index inputs, in the graph's INT64 (passes/lower_paged_attention.py).
STEP_INPUTS = ("input_ids", "position_ids", "block_tables", "context_lens", "query_start_loc", "logits_rows")


class TensorRTBackend:
    """The execution context and the step; the pool on the GPU, sized by the GPU's free memory and
    capped at the engine profile's blocks.

    Args:
        engine: a TensorRT engine file (backend "tensorrt").
        options: its timeline (the CPU threads and paths are the CPU backend's).
        device: "cuda" (the GPU that runs the engine), or "cpu" for tests with a stand-in for
            TensorRT's core.
    """

    paths = StepPaths()  # every step packed

    def __init__(self, engine: EngineFile, options: BackendOptions = BackendOptions(), device: str = "cuda"):
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
        self.timeline = options.timeline
        self._layer_times = None
        if self.timeline.enabled:
            self._layer_times = layer_profiler(trt)
            self._context.profiler = self._layer_times
            self._context.enqueue_emits_profile = False  # the launch stays asynchronous; see `_record_layers`
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        inputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if n not in inputs]
        self._profile = {name: [tuple(shape) for shape in self._engine.get_tensor_profile_shape(name, 0)]
                         for name in inputs}
        self._check_input_types(inputs, paged.kv_dtype, str(engine.path))
        highest = {name: shapes[2] for name, shapes in self._profile.items()}
        # The step's limits, from the profile TensorRT enforces (compiler/tensorrt_network.py).
        self.max_tokens, self.max_seqs = highest["input_ids"][1], highest["context_lens"][0]
        free = torch.cuda.mem_get_info()[0] if device == "cuda" else None
        self.placement = PoolPlacement(
            lambda shape, dtype: torch.zeros(shape, dtype=getattr(torch, dtype), device=device), free,
            highest["key_cache.0"][0])

    def attach(self, kv: KvCache) -> None:
        self.pools = kv.layer_pools()
        for name, pool in self.pools.items():  # bound once: the pool never moves
            self._set_shape(name, tuple(pool.shape))
            self._context.set_tensor_address(name, pool.data_ptr())

    def run(self, plan: StepPlan) -> np.ndarray:
        """Run one packed step; stores its keys and values; returns the logits of the plan's
        rows, [rows, vocab] float32 on the host."""
        tokens, positions, batch = plan.tokens, plan.positions, plan.batch
        rows = np.asarray(plan.rows, np.int64)
        pieces = split_step(np.asarray(batch.query_start_loc, np.int64), self.max_tokens, self.max_seqs)
        if len(pieces) == 1 and len(rows):
            return self._run(tokens, positions, batch, rows)
        logits = np.zeros((len(rows), self.geometry.vocab_size), np.float32)
        for piece in pieces:
            seqs = [sequence for sequence, _, _ in piece]
            index = np.concatenate([np.arange(start, end) for _, start, end in piece])
            stored = np.array([start - batch.query_start_loc[s] for s, start, _ in piece], np.int64)
            lengths = np.array([end - start for _, start, end in piece], np.int64)
            sub = PagedBatch(np.asarray(batch.block_tables)[seqs], np.asarray(batch.context_lens)[seqs] + stored,
                             np.concatenate([[0], np.cumsum(lengths)]))
            inside = np.isin(rows, index)
            local = np.searchsorted(index, rows[inside])
            # A piece whose tokens need no logits still asks for one row: the profile's least.
            out = self._run(tokens[index], positions[index], sub, local if len(local) else np.zeros(1, np.int64))
            logits[inside] = out[:len(local)]
        return logits

    def _run(self, tokens: np.ndarray, positions: np.ndarray, batch: PagedBatch, rows: np.ndarray) -> np.ndarray:
        """One engine call within the profile: binds the step, runs it, stores its keys and values."""
        with self.timeline.span("engine call", TENSORRT, tokens=len(tokens), seqs=len(batch.context_lens),
                                rows=len(rows)):
            return self._call(tokens, positions, batch, rows)

    def _call(self, tokens: np.ndarray, positions: np.ndarray, batch: PagedBatch, rows: np.ndarray) -> np.ndarray:
        torch = self.torch
        feeds = {"input_ids": tokens[None], "position_ids": positions[None], "block_tables": batch.block_tables,
                 "context_lens": batch.context_lens, "query_start_loc": batch.query_start_loc, "logits_rows": rows}
        bound = {}
        for name, array in feeds.items():
            tensor = torch.from_numpy(np.ascontiguousarray(array, np.int64)).to(self.device, non_blocking=True)
            self._set_shape(name, tuple(tensor.shape))
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
        launched = self.timeline.now()
        if not self._context.execute_async_v3(stream):
            raise LlmcError("TensorRT: the engine's step failed (its log above says why)")
        blocks, offsets = batch.slots(self.block_size)
        index_blocks = torch.from_numpy(blocks).to(self.device)
        index_offsets = torch.from_numpy(offsets).to(self.device)
        for layer in range(self.geometry.num_layers):
            for part in ("key", "value"):
                pool = self.pools[f"{part}_cache.{layer}"]
                pool[index_blocks, :, index_offsets] = outputs[f"new_{part}.{layer}"].to(pool.dtype)
        logits = outputs["logits"][0].float().cpu().numpy()  # the copy to the host waits for the stream
        if self._layer_times is not None:
            self._record_layers(launched)
        return logits

    def _record_layers(self, launched: int) -> None:
        """TensorRT's layer times of the launch just done, as spans laid end to end from it.

        Asked for after the stream is done (TensorRT times the layers with CUDA events it records
        in the stream), as trtexec and TensorRT-LLM ask with enqueue_emits_profile off."""
        if not self._context.report_to_profiler():
            raise LlmcError("TensorRT: the layer profiler reported nothing for the engine call (its log above says "
                            "why)")
        start = launched
        for name, ms in self._layer_times.take():
            end = start + round(ms * 1e6)
            self.timeline.add(name, TENSORRT, start, end, kind="layer", placed="end to end from the launch")
            start = end

    def _set_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """Set an input's shape; one line naming it and the profile's range when TensorRT refuses."""
        if not self._context.set_input_shape(name, shape):
            low, _, high = self._profile[name]
            raise LlmcError(f"TensorRT: input {name} of shape {list(shape)} is outside the engine's profile "
                            f"(min {list(low)}, max {list(high)})")

    def _check_input_types(self, inputs: list[str], kv_dtype: str, where: str) -> None:
        """The engine's inputs are what this object binds: the step's INT64 arrays and pools of the
        manifest's kv dtype (TensorRT reads a bound address as its own type, unchecked)."""
        expected = {name: self.trt.int64 for name in STEP_INPUTS}
        expected.update({name: self._trt_type(kv_dtype) for name in inputs if name not in STEP_INPUTS})
        for name in inputs:
            if name not in expected or self._engine.get_tensor_dtype(name) != expected[name]:
                raise LlmcError(f"{where}: the engine's input {name} is {self._engine.get_tensor_dtype(name)}; this "
                                f"runtime binds {expected.get(name, 'no such input')} (recompile the engine)")

    def warm_up(self) -> None:
        """One throw-away decode step, so the first real one does not pay for lazy CUDA set-up.
        It writes only into block 0 before any request owns it."""
        batch = PagedBatch(np.zeros((1, 1), np.int64), np.zeros(1, np.int64), np.array([0, 1], np.int64))
        self.run(StepPlan("packed", np.zeros(1, np.int64), np.zeros(1, np.int64), batch, np.zeros(1, np.int64)))

    def steps_round_alike(self) -> bool:
        return False  # not checked on a GPU: guessing stays the user's choice

    def _trt_type(self, dtype: str) -> Any:
        return {"float32": self.trt.float32, "float16": self.trt.float16, "bfloat16": self.trt.bfloat16}[dtype]

    def _torch_type(self, data_type: Any):
        trt, torch = self.trt, self.torch
        types = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                 trt.int64: torch.int64, trt.int32: torch.int32}
        if data_type not in types:
            raise LlmcError(f"TensorRT engine output of type {data_type}: not one llmc reads")
        return types[data_type]


def layer_profiler(trt):
    """A TensorRT `IProfiler` that keeps the (layer name, milliseconds) it is given until `take()`."""

    class LayerTimes(trt.IProfiler):
        def __init__(self):
            trt.IProfiler.__init__(self)  # pybind refuses a subclass that skips it
            self._times: list[tuple[str, float]] = []

        def report_layer_time(self, layer_name: str, ms: float) -> None:
            # TensorRT's bindings catch and print what this raises, and go on: keep it to an append.
            self._times.append((layer_name, ms))

        def take(self) -> list[tuple[str, float]]:
            times, self._times = self._times, []
            return times

    return LayerTimes()


def deploy_checks(manifest, record) -> None:
    """A GPU, and the engine built for this machine's TensorRT release and GPU (`check_compatible`);
    the registry's requirements (tensorrt, torch importable) were checked first."""
    import tensorrt

    from llmc.plugins import cuda_device  # looked up when called: tests stand in for the GPU

    try:
        gpu = cuda_device.current_gpu()
    except LlmcError as error:
        record("GPU", False, str(error))
        return
    record("GPU", True, f"{gpu['name']} (compute capability {gpu['compute_capability']})")
    try:
        check_compatible(manifest.tensorrt, tensorrt.__version__, gpu, "engine")
        record("built for this TensorRT and GPU", True, f"TensorRT {manifest.tensorrt.version} on {manifest.tensorrt.gpu}")
    except LlmcError as error:
        record("built for this TensorRT and GPU", False, str(error))


def split_step(query_start_loc: np.ndarray, max_tokens: int, max_seqs: int) -> list[list[tuple[int, int, int]]]:
    """A packed step cut into consecutive pieces of at most `max_tokens` tokens and `max_seqs`
    sequences: each piece a list of (sequence, first packed token, end). A sequence's tokens may
    span pieces, in order, so each piece's attention finds the earlier ones stored."""
    pieces, current, used = [], [], 0
    for sequence in range(len(query_start_loc) - 1):
        start, end = int(query_start_loc[sequence]), int(query_start_loc[sequence + 1])
        while start < end:
            if used == max_tokens or len(current) == max_seqs:
                pieces.append(current)
                current, used = [], 0
            take = min(end - start, max_tokens - used)
            current.append((sequence, start, start + take))
            used, start = used + take, start + take
    return pieces + [current] if current else pieces


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
