"""``llmc::paged_attention`` on the CPU: an in-place kernel for decode tokens, matrix products
for prefill chunks.

onnxruntime has no paged-attention kernel and its pip wheel ships no headers to build a custom
op against, so the CPU backend runs this between graph segments (runtime/backends/cpu.py). A
step's sequences go one of two ways:

- few new tokens (decodes): a Numba kernel, compiled once and cached on disk, reads each
  sequence's keys and values straight from its pool blocks. Its work items are (sequence, kv
  head, tile of up to `QUERY_TILE` tokens); an item loads each key and value once and uses it for
  every query row it holds. A step costs what its sequences' own contexts cost, however unequal.
- a prefill chunk (at least `DENSE_MIN_TOKENS` new tokens): the dense form of
  plugins/paged_attention_onnx.py in onnxruntime. It copies the sequence's blocks, which is cheap
  next to its score matrix, and its matrix products beat the kernel's dot products there.

The pool is float32 or float16 (--kv-cache-dtype); the kernel widens float16 elements as it reads
them, the dense form casts the blocks it gathers. Under a sliding window both read only the blocks
from the step's first new token's window on (a decode at any context reads about window / block
blocks), and soft-capping (Gemma-2) caps each row's visible scores.

Start-up: importing Numba costs 0.23 s, loading the cached kernels little (20-80 ms), and
initializing Numba's CPU target (its typing and lowering registries, which import SciPy's BLAS)
0.4-1.6 s on a loaded 2-core machine. `CpuPagedAttention` does all three in a thread started with
it (the kernels live in plugins/paged_attention_kernels.py, imported there), while the caller
builds its onnxruntime sessions; nothing waits for it before the first step that has decode
tokens: a prompt's first chunk takes the dense form, and the store falls back to NumPy. It asks
for the kernel by its exact signature with a literal block size: calling the dispatcher instead
first types the call with a plain int, runs Numba's untyped passes until `numba.literally`
rejects it, and only then looks in the cache (measured 3.0 s instead of 1.5 s before the first
step, on the tiny test model).

Measured on the serving benchmark's geometry (8 heads, 4 kv heads, head dim 64, block 16, 2
cores), one sequence at 400 past tokens, kernel vs dense form: 16 new tokens 0.18 vs 0.18 ms, 32
new 0.32 vs 0.21, 128 new 1.29 vs 0.53; bench/paged_attention_bench.py compares the two on
decodes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from llmc.errors import LlmcError
from llmc.formats.sessions import session_options
from llmc.plugins.paged_attention import PagedBatch, plan_step

# Pool element types the kernel reads, and the NumPy type it sees each as (Numba has no float16).
POOL_TYPES = {np.dtype(np.float32): np.float32, np.dtype(np.float16): np.uint16}
# New tokens per kernel work item: enough rows to reuse each loaded key, few enough that a step
# still splits into at least as many items as there are cores.
QUERY_TILE = 16
# Sequences with this many new tokens or more in a step take the dense form. Measured per layer
# (one sequence; kernel vs dense): 16 new at 3,000 past 1.9 vs 1.0 ms, 63 at 1,200 2.6 vs 0.8,
# 16 at 300 0.19 vs 0.13, 4 × 100 with no past 0.78 vs 0.59.
DENSE_MIN_TOKENS = QUERY_TILE
# Steps whose kernel reads at most this many (key, kv head) rows run it on the calling thread:
# starting a parallel region costs more than they save.
SERIAL_MAX_KEYS = 4096


@dataclass(frozen=True)
class StepLayout:
    """How one step's sequences are split between the kernel and the dense form (same for every
    layer, so computed once per step)."""

    batch: PagedBatch
    items: np.ndarray                        # the kernel's work: [items, 4] (seq, first, end, kv head)
    serial: bool                             # too little kernel work for a parallel region
    # By attention window (0: full), per dense sequence: its packed rows and the dense form's
    # plan inputs (a window changes the mask and which blocks are gathered).
    dense: dict[int, list[tuple[slice, dict[str, np.ndarray]]]]


class CpuPagedAttention:
    """The op for one geometry; `layout()` once per step, then call once per layer.

    Args:
        num_heads, num_kv_heads, head_dim, block_size: the op's geometry.
        threads: threads for both paths; None uses every core.
        kv_dtype: the pool's element type, "float32" or "float16".
        dense_models: the dense form's serialized model by (scale, softcap), as an engine stores
            them; one not given is built when first needed.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 threads: int | None = None, kv_dtype: str = "float32",
                 dense_models: dict[tuple[float, float], bytes] | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.threads = block_size, threads
        self.kv_dtype = np.dtype(kv_dtype)
        if self.kv_dtype not in POOL_TYPES:
            raise LlmcError(f"paged attention (CPU): a {self.kv_dtype} KV pool is not supported (float32, float16)")
        self._dense: dict[tuple[float, float], ort.InferenceSession] = {}  # by scale and softcap
        self._dense_models = dense_models or {}
        self._kernels = {False: None, True: None}  # _attend's and _attend_serial's entry points, once loaded
        self._module = None  # plugins/paged_attention_kernels, once loaded
        self._counted_threads: set[int] = set()  # threads whose Numba thread count is set
        self._loaded: BaseException | None = None
        self._loader = threading.Thread(target=self._load, name="llmc-kernel-load", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        try:
            from llmc.plugins import paged_attention_kernels

            paged_attention_kernels.load_kernels(POOL_TYPES[self.kv_dtype], self.block_size)
        except BaseException as error:  # raised by the caller's first kernel call
            self._loaded = error

    @property
    def loaded(self) -> bool:
        """Whether the kernels are ready (a step need not wait for them)."""
        return self._module is not None or not self._loader.is_alive()

    def wait_until_loaded(self):
        """Block until the kernels are loaded (or compiled, the first time); returns their module,
        raises what the loading raised. Every kernel call comes through here: Numba's thread
        count belongs to the calling thread, and the engine may load on one thread and step on
        another (a server)."""
        if self._module is None:
            self._loader.join()
            if self._loaded is not None:
                raise self._loaded
            from llmc.plugins import paged_attention_kernels

            self._module = paged_attention_kernels
        if self.threads and threading.get_ident() not in self._counted_threads:
            numba = self._module.numba
            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
            self._counted_threads.add(threading.get_ident())
        return self._module

    def store(self, pool: np.ndarray, new: np.ndarray, blocks: np.ndarray, offsets: np.ndarray) -> None:
        """pool[blocks[t], :, offsets[t]] = new[t] for every packed token t: the kernel once it is
        loaded (NumPy's fancy-index assignment took 2 ms a step on the serving benchmark), NumPy
        until then."""
        bits = POOL_TYPES[pool.dtype]  # Numba has no float16: it stores the bits
        if self.loaded:
            self.wait_until_loaded().store(pool.view(bits), new.view(bits), blocks, offsets)
        else:
            pool[blocks, :, offsets] = new

    def layout(self, batch: PagedBatch, windows: tuple[int, ...] = (0,)) -> StepLayout:
        """Split the step's sequences between the two paths.

        Args:
            batch: the step's block tables, past lengths and packed offsets.
            windows: every attention window the layers use (0: full attention).
        """
        starts = batch.query_start_loc.astype(np.int64)
        counts = np.diff(starts)
        dense = np.flatnonzero(counts >= DENSE_MIN_TOKENS)
        items = work_items(starts, self.num_kv_heads, np.flatnonzero(counts < DENSE_MIN_TOKENS))
        # One dense call per sequence: packed together, each would score the others' keys too.
        plans = {window: [(slice(starts[s], starts[s + 1]),
                           plan_step(PagedBatch(batch.block_tables[s:s + 1], batch.context_lens[s:s + 1],
                                                np.array([0, counts[s]])), self.block_size, window=window).feeds())
                          for s in dense]
                 for window in set(windows)}
        kernel_keys = int(np.sum((batch.context_lens + counts)[counts < DENSE_MIN_TOKENS])) * self.num_kv_heads
        return StepLayout(PagedBatch(np.ascontiguousarray(batch.block_tables, np.int64),
                                     np.ascontiguousarray(batch.context_lens, np.int64), starts),
                          items, kernel_keys <= SERIAL_MAX_KEYS, plans)

    def __call__(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, key_cache: np.ndarray,
                 value_cache: np.ndarray, layout: StepLayout, scale: float | None = None,
                 window: int = 0, softcap: float = 0.0) -> np.ndarray:
        """[tokens, heads, head_dim] float32 attention of the packed tokens (inputs as in the op's
        contract, already checked; the pool in `kv_dtype`; `window` one that `layout` was given)."""
        scale = self.head_dim ** -0.5 if scale is None else float(scale)
        query, key, value = (np.ascontiguousarray(a, np.float32) for a in (query, key, value))
        key_cache, value_cache = (np.ascontiguousarray(a, self.kv_dtype) for a in (key_cache, value_cache))
        output = np.empty(query.shape, np.float32)
        if len(layout.items):
            b = layout.batch
            pool_type = POOL_TYPES[self.kv_dtype]  # the kernel reads float16 as its bits (uint16)
            args = (query, key, value, key_cache.view(pool_type), value_cache.view(pool_type), b.block_tables,
                    b.context_lens, b.query_start_loc, layout.items, np.float32(scale), np.int64(window),
                    np.float32(softcap), output, self.block_size)
            serial = layout.serial
            kernels = self.wait_until_loaded()
            if self._kernels[serial] is None:
                kernel = kernels._attend_serial if serial else kernels._attend
                try:
                    self._kernels[serial] = kernels.compiled_entry_point(kernel, args)
                except LookupError:  # arguments of other types than load_kernels's (a read-only array)
                    kernel(*args)
                    self._kernels[serial] = kernels.compiled_entry_point(kernel, args)
                else:
                    self._kernels[serial](*args)
            else:
                self._kernels[serial](*args)
        for rows, feeds in layout.dense[window]:
            (output[rows],) = self._dense_session(scale, float(softcap)).run(None, {
                "query": query[rows], "key": key[rows], "value": value[rows],
                "key_cache": key_cache, "value_cache": value_cache, **feeds})
        return output

    def _dense_session(self, scale: float, softcap: float) -> ort.InferenceSession:
        if (scale, softcap) not in self._dense:
            model = self._dense_models.get((scale, softcap))
            if model is None:  # the op used outside an engine (a test, a benchmark): built here (imports onnx)
                from onnx import helper

                from llmc.plugins.paged_attention_onnx import standalone_model

                model = standalone_model(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                         head_dim=self.head_dim, block_size=self.block_size, scale=scale,
                                         cache_dtype=helper.np_dtype_to_tensor_dtype(self.kv_dtype),
                                         softcap=softcap).SerializeToString()
            self._dense[scale, softcap] = ort.InferenceSession(bytes(model), session_options(self.threads),
                                                               providers=["CPUExecutionProvider"])
        return self._dense[scale, softcap]


def work_items(query_start_loc: np.ndarray, kv_heads: int, sequences: np.ndarray) -> np.ndarray:
    """[items, 4] int64 rows (sequence, first token, end token, kv head) for the given sequences."""
    rows = []
    for s in sequences:
        for first in range(int(query_start_loc[s]), int(query_start_loc[s + 1]), QUERY_TILE):
            end = min(first + QUERY_TILE, int(query_start_loc[s + 1]))
            rows += [(s, first, end, h) for h in range(kv_heads)]
    return np.array(rows, np.int64).reshape(-1, 4)
