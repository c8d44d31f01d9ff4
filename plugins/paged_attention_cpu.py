"""``llmc::paged_attention`` on the CPU: an in-place kernel for decode tokens, matrix products
for prefill chunks.

onnxruntime has no paged-attention kernel and its pip wheel ships no headers to build a custom
op against, so the CPU backend runs this between graph segments (runtime/backends/
paged_onnxruntime.py). A step's sequences go one of two ways:

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

Start-up: loading the cached kernel costs little (20-80 ms); initializing Numba's CPU target
(its typing and lowering registries, which import SciPy's BLAS) costs 0.4-1.6 s on a loaded
2-core machine. `CpuPagedAttention` does both in a thread started with it, while the caller builds
its onnxruntime sessions, and asks for the kernel by its exact signature with a literal block
size: calling the dispatcher instead first types the call with a plain int, runs Numba's untyped
passes until `numba.literally` rejects it, and only then looks in the cache (measured 3.0 s
instead of 1.5 s before the first step, on the tiny test model).

Measured on the serving benchmark's model (8 heads, 4 kv heads, head dim 64, block 16, 2 cores;
bench/RESULTS.md): 16 decodes at 400 past tokens, kernel 0.55 ms vs dense form 2.8 ms (before the
session-3 kernel changes); one sequence at 400 past tokens, kernel vs dense form: 16 new tokens
0.18 vs 0.18 ms, 32 new 0.32 vs 0.21, 128 new 1.29 vs 0.53.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numba
import numpy as np
import onnxruntime as ort
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

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
        if threads:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        self._loaded: BaseException | None = None
        self._loader = threading.Thread(target=self._load, name="llmc-kernel-load", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        try:
            load_kernels(POOL_TYPES[self.kv_dtype], self.block_size)
        except BaseException as error:  # raised by the caller's first kernel call
            self._loaded = error

    def wait_until_loaded(self) -> None:
        """Block until the kernels are loaded (or compiled, the first time); raises what the
        loading raised."""
        self._loader.join()
        if self._loaded is not None:
            raise self._loaded

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
            if self._kernels[serial] is None:
                self.wait_until_loaded()
                kernel = _attend_serial if serial else _attend
                try:
                    self._kernels[serial] = compiled_entry_point(kernel, args)
                except LookupError:  # arguments of other types than load_kernels's (a read-only array)
                    kernel(*args)
                    self._kernels[serial] = compiled_entry_point(kernel, args)
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
            if model is None:  # not stored in the engine: built here, which imports onnx
                from onnx import helper

                from llmc.plugins.paged_attention_onnx import standalone_model

                model = standalone_model(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                         head_dim=self.head_dim, block_size=self.block_size, scale=scale,
                                         cache_dtype=helper.np_dtype_to_tensor_dtype(self.kv_dtype),
                                         softcap=softcap).SerializeToString()
            self._dense[scale, softcap] = ort.InferenceSession(bytes(model), session_options(self.threads),
                                                               providers=["CPUExecutionProvider"])
        return self._dense[scale, softcap]


def load_kernels(pool_type: type, block_size: int) -> None:
    """Load (or compile, the first time) `_attend` for a literal `block_size` and `store`, for a
    pool seen as `pool_type` (`POOL_TYPES`'s values), with the argument types the runtime passes."""
    f32, i64, pool = numba.float32, numba.int64, numba.from_dtype(np.dtype(pool_type))

    def array(dtype, ndim):
        return numba.types.Array(dtype, ndim, "C")

    for kernel in (_attend, _attend_serial):
        kernel.compile((array(f32, 3), array(f32, 3), array(f32, 3), array(pool, 4), array(pool, 4), array(i64, 2),
                        array(i64, 1), array(i64, 1), array(i64, 2), f32, i64, f32, array(f32, 3),
                        numba.types.IntegerLiteral(block_size)))
    store.compile((array(pool, 4), array(pool, 3), array(i64, 1), array(i64, 1)))


def compiled_entry_point(kernel, args: tuple):
    """The compiled `kernel` for these arguments, the last a literal block size, to call without
    Numba's dispatcher: for a literal argument, the dispatcher retypes every call (measured 95 ms a
    call). The entry point does no type checks: callers pass arguments of these types again."""
    *values, block_size = args
    types = tuple(numba.typeof(v) for v in values)
    for signature, compiled in kernel.overloads.items():
        if signature[:-1] == types and getattr(signature[-1], "literal_value", None) == block_size:
            return compiled.entry_point
    raise LookupError(f"no compiled {kernel.__name__} for {types} and block size {block_size}")


def work_items(query_start_loc: np.ndarray, kv_heads: int, sequences: np.ndarray) -> np.ndarray:
    """[items, 4] int64 rows (sequence, first token, end token, kv head) for the given sequences."""
    rows = []
    for s in sequences:
        for first in range(int(query_start_loc[s]), int(query_start_loc[s + 1]), QUERY_TILE):
            end = min(first + QUERY_TILE, int(query_start_loc[s + 1]))
            rows += [(s, first, end, h) for h in range(kv_heads)]
    return np.array(rows, np.int64).reshape(-1, 4)


@intrinsic
def prefetch(typingctx, array, offset):
    """Ask for the cache line holding element `offset` of a contiguous array (llvm.prefetch;
    Numba has no prefetch of its own)."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_pointer, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]), "llvm.prefetch.p0")
        # read (0), keep in every cache level (3), data (1)
        builder.call(function, [builder.bitcast(builder.gep(data, [args[1]]), byte_pointer), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return numba.types.none(array, numba.types.intp), codegen


@intrinsic
def widen(typingctx, element):
    """A pool element as float32: float32 as it is, uint16 as the bits of a float16 (LLVM's fpext,
    which vectorizes to the CPU's half-to-float conversion)."""
    if element == numba.types.float32:
        return numba.types.float32(element), lambda context, builder, signature, args: args[0]
    if element == numba.types.uint16:
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return numba.types.float32(element), codegen
    return None


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _attend(query, key, value, key_cache, value_cache, block_tables, context_lens, query_start_loc,
            items, scale, window, softcap, output, block_size):  # pragma: no cover — compiled; tested through paged_attention_cpu
    # A compile-time block size lets LLVM unroll the loops over a block's keys: the P·V update
    # then keeps a row's accumulator in registers for a whole block (measured 1.2-1.6x per call).
    block_size = numba.literally(block_size)
    for item in numba.prange(items.shape[0]):
        _attend_item(query, key, value, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                     items[item], scale, window, softcap, output, block_size)


@numba.njit(fastmath=True, cache=True, nogil=True)
def _attend_serial(query, key, value, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                   items, scale, window, softcap, output, block_size):  # pragma: no cover — compiled; tested through paged_attention_cpu
    """`_attend` on the calling thread alone, for steps too small to pay for a parallel region."""
    block_size = numba.literally(block_size)
    for item in range(items.shape[0]):
        _attend_item(query, key, value, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                     items[item], scale, window, softcap, output, block_size)


@numba.njit(fastmath=True, inline="always")
def _attend_item(query, key, value, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                 item, scale, window, softcap, output, block_size):  # pragma: no cover — compiled; tested through paged_attention_cpu
    """One work item: `item` = (sequence, first token, end token, kv head). Inlined into the
    callers, where `block_size` is a literal."""
    heads, head_dim = query.shape[1], query.shape[2]
    group = heads // key.shape[1]
    s, first, end, kv_head = item[0], item[1], item[2], item[3]
    past, start = context_lens[s], query_start_loc[s]
    full = past // block_size  # whole past blocks; the rest of the past is in block `full`
    # A window bounds the block loops: blocks wholly before the tile's first token's window
    # are skipped (never read: the runtime may have freed them), and score column c is key
    # position base + c. Rows of later tokens mask the few keys their windows drop.
    skipped = 0
    if window > 0:
        skipped = min(max(0, past + first - start - window + 1) // block_size, full)
    base = skipped * block_size
    rows = (end - first) * group
    keys = past + end - start - base  # score columns: keys up to the tile's last token
    q = np.empty((rows, head_dim), np.float32)
    for t in range(first, end):
        for g in range(group):
            for d in range(head_dim):
                q[(t - first) * group + g, d] = query[t, kv_head * group + g, d] * scale
    scores = np.empty((rows, keys), np.float32)
    # Past keys block by block, straight from the pool; then the step's own new keys.
    # Memory-bound at decode: each phase prefetches its next block while it works on one
    # (a block starts a new page, where the hardware prefetcher starts over). Measured 1.25x
    # per call when a sequence's blocks lie in random order; no loss when they are in order.
    per_line = 64 // key_cache.itemsize  # pool elements in a 64-byte cache line
    lines = block_size * head_dim // per_line
    for b in range(skipped, full):
        kb = key_cache[block_tables[s, b], kv_head]
        if (b + 1) * block_size < past:  # the next block holds past keys (the table may end here)
            ahead = key_cache[block_tables[s, b + 1], kv_head]
            for line in range(lines):
                prefetch(ahead, line * per_line)
        for o in range(block_size):
            # Rows in pairs: each key row loaded once for both (a decode's two query heads
            # when two share a kv head); measured 8% faster per call than row by row.
            for r in range(0, rows - 1, 2):
                acc0, acc1 = np.float32(0.0), np.float32(0.0)
                for d in range(head_dim):
                    acc0 += q[r, d] * widen(kb[o, d])
                    acc1 += q[r + 1, d] * widen(kb[o, d])
                scores[r, b * block_size + o - base] = acc0
                scores[r + 1, b * block_size + o - base] = acc1
            if rows % 2:
                acc = np.float32(0.0)
                for d in range(head_dim):
                    acc += q[rows - 1, d] * widen(kb[o, d])
                scores[rows - 1, b * block_size + o - base] = acc
    if full * block_size < past:
        kb = key_cache[block_tables[s, full], kv_head]
        for r in range(rows):
            for o in range(past - full * block_size):
                acc = np.float32(0.0)
                for d in range(head_dim):
                    acc += q[r, d] * widen(kb[o, d])
                scores[r, full * block_size + o - base] = acc
    for i in range(end - start):
        for r in range(rows):
            acc = np.float32(0.0)
            for d in range(head_dim):
                acc += q[r, d] * key[start + i, kv_head, d]
            scores[r, past + i - base] = acc
    # Softmax over each row's visible keys (its sequence's past and its new tokens up to
    # itself, within its window), left unnormalized: the output rows are divided by the sums
    # at the end.
    totals = np.empty(rows, np.float32)
    bits = np.empty(keys, np.int32)
    powers = bits.view(np.float32)
    for r in range(rows):
        visible = past + first + r // group - start + 1 - base  # columns up to the row's token
        lowest = 0  # its first column in the window
        if window > 0:
            lowest = max(0, visible - window)
        for j in range(lowest):
            scores[r, j] = 0.0
        if softcap > 0:  # Gemma-2: c·tanh(s / c) on the visible scores, before softmax
            for j in range(lowest, visible):
                scores[r, j] = softcap * np.tanh(scores[r, j] / softcap)
        top = scores[r, lowest]
        for j in range(lowest + 1, visible):
            if scores[r, j] > top:
                top = scores[r, j]
        # exp(x - top) = 2^y for y = (x - top)·log2(e): 2^floor(y) built from its exponent
        # bits, 2^(y - floor(y)) by a degree-5 polynomial (relative error 2e-7). Unlike
        # np.exp, this vectorizes.
        for j in range(lowest, visible):
            y = max((scores[r, j] - top) * np.float32(1.4426950408889634), np.float32(-126.0))
            whole = np.floor(y)
            f = y - whole
            scores[r, j] = ((((np.float32(0.0018951073) * f + np.float32(0.0089462148)) * f
                              + np.float32(0.0558632836)) * f + np.float32(0.2401407659)) * f
                            + np.float32(0.6931546330)) * f + np.float32(0.9999998808)
            bits[j] = (np.int32(whole) + 127) << 23
        total = np.float32(0.0)
        for j in range(lowest, visible):
            e = scores[r, j] * powers[j]
            scores[r, j] = e
            total += e
        totals[r] = total
        for j in range(visible, keys):
            scores[r, j] = 0.0
    attended = np.zeros((rows, head_dim), np.float32)
    if full > skipped:
        opening = value_cache[block_tables[s, skipped], kv_head]
        for line in range(lines):
            prefetch(opening, line * per_line)
    for b in range(skipped, full):
        vb = value_cache[block_tables[s, b], kv_head]
        if b + 1 < full:
            ahead = value_cache[block_tables[s, b + 1], kv_head]
            for line in range(lines):
                prefetch(ahead, line * per_line)
        for r in range(rows):
            for d in range(head_dim):
                acc = attended[r, d]
                for o in range(block_size):
                    acc += scores[r, b * block_size + o - base] * widen(vb[o, d])
                attended[r, d] = acc
    if full * block_size < past:
        vb = value_cache[block_tables[s, full], kv_head]
        for r in range(rows):
            for o in range(past - full * block_size):
                p = scores[r, full * block_size + o - base]
                for d in range(head_dim):
                    attended[r, d] += p * widen(vb[o, d])
    for i in range(end - start):
        for r in range(rows):
            p = scores[r, past + i - base]
            for d in range(head_dim):
                attended[r, d] += p * value[start + i, kv_head, d]
    for t in range(first, end):
        for g in range(group):
            r = (t - first) * group + g
            inv = np.float32(1.0) / totals[r]
            for d in range(head_dim):
                output[t, kv_head * group + g, d] = attended[r, d] * inv


@numba.njit(cache=True, nogil=True)
def store(pool, new, blocks, offsets):  # pragma: no cover — compiled; tested through the decoder
    """pool[blocks[t], :, offsets[t]] = new[t] for every token t. One thread: a step stores a few
    KiB per token, less than a parallel region costs to start (0.1 ms measured); NumPy's
    fancy-index assignment of the same took 2 ms a step on the serving benchmark."""
    for t in range(new.shape[0]):
        pool[blocks[t], :, offsets[t]] = new[t]
