"""The Numba kernels of ``llmc::paged_attention`` on the CPU (plugins/paged_attention_cpu.py
runs them): attention of decode tokens reading the pool in place, and the store of a step's new
keys and values into it.

Kept apart so that importing the runtime does not import Numba (0.23 s): `CpuPagedAttention`
imports this module in the thread that loads the kernels while the sessions build.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic


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
