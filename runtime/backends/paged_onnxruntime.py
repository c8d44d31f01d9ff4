"""One step of a paged engine on the CPU: packed tokens in, last-token logits out, new K/V into
the pool.

The engine holds its graph cut at each ``llmc::PagedAttention`` node into segments
(compiler/segments.py), which onnxruntime cannot run whole; the runtime runs segment (an
onnxruntime session), attention (plugins/paged_attention_cpu.py, reading the pool in place),
segment, … and carries the values that cross a cut. The step's new keys and values are stored at
the slots the sequences own afterwards — one vectorized scatter per layer per step, never a copy
of the pool.

The pool is sized here, at load, not at compile time: an engine file may run on machines with
more or less memory than the one that built it. The manifest's `num_blocks` is the most the
engine will ever use (what `llmc compile --kv-pool-mb` asked for, or by default room for
min(max batch, 16) sequences of max_seq_len tokens); a pool the user did not size (no
--kv-pool-mb at compile, no `kv_pool_mb` at load) is capped at `MEMORY_FRACTION` of the memory
available when the engine loads, and never below one sequence of max_seq_len tokens.

The pool is allocated, not filled: its pages are mapped on first write, so start-up and resident
memory pay only for blocks that requests have used (SmolLM2-135M's default 5.76 GB pool made
`llmc run` peak at 10 GB when it was zero-filled at load). A step that writes into blocks no
request used before pays their page faults, once per block for the pool's lifetime (measured on
SmolLM2-135M's 60 pools, 2 loaded cores: 16 decodes each starting a fresh block, 10-20 ms on top
of the step; a 2,048-token prompt, 140 ms). The block manager hands out blocks in id order until
each has been used once, so a pool that stays lightly used stays small.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from llmc.errors import LlmcError
from llmc.formats.engine_file import EngineFile, FileRange
from llmc.formats.manifest import blocks_in, kv_block_bytes
from llmc.formats.sessions import open_session, session_options
from llmc.runtime.backends.onnxruntime import drop_file_pages, release_model_bytes
from llmc.runtime.backends.whole_graph import WholeGraph
from llmc.plugins.paged_attention import PagedBatch
from llmc.plugins.paged_attention_cpu import DENSE_MIN_TOKENS, CpuPagedAttention

# The default pool's share of the memory available at load (weights and sessions already counted
# out): the rest is left to the process's other arrays, the page cache and other processes.
MEMORY_FRACTION = 0.5


def pool_blocks(paged, geometry, kv_pool_mb: float | None = None, available: int | None = None) -> int:
    """Blocks in the KV pool.

    Args:
        paged: the manifest's paged layout (its `num_blocks` is the ceiling).
        geometry: the model's geometry.
        kv_pool_mb: the pool asked for at load, in MiB; None keeps the compiled one when
            `llmc compile --kv-pool-mb` set it, or else sizes the default by `available`.
        available: bytes of memory available now; None reads it from the system.
    """
    if kv_pool_mb is not None:
        if not kv_pool_mb > 0:
            raise LlmcError(f"kv_pool_mb: must be > 0, got {kv_pool_mb}")
        return blocks_in(kv_pool_mb, geometry, paged.block_size, paged.kv_dtype, paged.max_seq_len, "kv_pool_mb")
    if paged.kv_pool_mb is not None:
        return paged.num_blocks
    available = available_memory() if available is None else available
    if available is None:
        return paged.num_blocks
    per_sequence = -(-paged.max_seq_len // paged.block_size)
    block_bytes = kv_block_bytes(geometry, paged.block_size, paged.kv_dtype)
    return max(per_sequence, min(paged.num_blocks, int(MEMORY_FRACTION * available // block_bytes)))


def allocate_pool(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A zeroed array whose pages are mapped on first write, in small pages.

    NumPy asks for transparent huge pages on arrays this large (madvise), and where the kernel
    compacts memory for madvised regions on fault (transparent_hugepage/defrag = madvise, a
    common default) a first write can stall for milliseconds a page: measured on a loaded 2-core
    machine, 960 fresh blocks of SmolLM2-135M's pools took 14 s to touch, against 10-20 ms in
    small pages (and zero-filling its 5.76 GB default pool at load took 110 s)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.zeros(shape, dtype)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mapping, dtype).reshape(shape)


def available_memory() -> int | None:
    """Bytes of memory the system can give without swapping (Linux's MemAvailable), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class PagedDecoder:
    """The KV pools, and the sessions and attention kernel that read and write them.

    A step of one sequence, or a decode of at most the engine's max batch, runs the engine's
    single-sequence graph when it has one (runtime/backends/whole_graph.py); any other step (a
    prompt chunk beside other sequences) runs the segments, onnxruntime sessions with the
    attention kernel between them. Each path's sessions are built when it first runs a step (the
    whole graph's at load): a process that never mixes a prompt with other sequences never
    builds the segments, nor loads the kernel, and holds its weights once.

    Args:
        engine: a paged engine file.
        threads: CPU threads; None uses every core.
        kv_pool_mb: the KV pool's size in MiB; None: the compiled size, or the default rule
            (see `pool_blocks`).
        single_sequence: run the steps it can take on the single-sequence graph, when the engine
            has one; False runs every step on the segments.
        segments_at_load: build the segments at load even when the single-sequence graph is
            there, and have the warm-up wait for the attention kernel (a server or benchmark that
            expects concurrent requests: no step of several sequences waits for either, and the
            weights are held twice from the start).
    """

    def __init__(self, engine: EngineFile, threads: int | None = None, kv_pool_mb: float | None = None,
                 single_sequence: bool = True, segments_at_load: bool = False):
        manifest, paged = engine.manifest, engine.manifest.paged
        if paged is None:
            raise LlmcError(f"{engine.path}: not a paged engine ({manifest.not_paged})")
        geometry = self.geometry = manifest.geometry
        self.block_size, self.max_seq_len = paged.block_size, paged.max_seq_len
        self.segments = paged.segments
        self.windows = tuple(s.attention.window for s in self.segments if s.attention is not None)
        self._engine, self._threads, self._kv_dtype = engine, threads, paged.kv_dtype
        self._options = session_options(threads)
        self._attention: CpuPagedAttention | None = None
        self._sessions: list | None = None
        single = None
        if single_sequence and paged.single_sequence:
            single = self._open(paged.single_sequence)
            drop_file_pages(engine)  # as after the segments' sessions (see `_segmented`)
        self._kernel_at_load = segments_at_load
        if single is None or segments_at_load:
            self._segmented()
        self.num_blocks = pool_blocks(paged, geometry, kv_pool_mb)  # after the sessions: they hold the weights
        # Every layer's keys and values in one array, [layer and part, block, kv head, slot, head dim]:
        # storing a step, or copying a block, is one NumPy operation instead of one a layer.
        self.pool = allocate_pool((2 * geometry.num_layers, self.num_blocks, geometry.num_kv_heads, paged.block_size,
                                   geometry.head_dim), paged.kv_dtype)
        self.pools = {f"{part}_cache.{layer}": self.pool[2 * layer + i]  # what the sessions and kernel read
                      for layer in range(geometry.num_layers) for i, part in enumerate(("key", "value"))}
        self.single = None if single is None else WholeGraph(
            single, self.pool, paged.max_seq_len, paged.block_size, paged.max_batch, allocate_pool, eager=any(self.windows))
        self._whole = False  # whether the last step ran on the whole graph

    def _open(self, section: str):
        """A session over one of the engine's graph sections, its weights mapped from the file."""
        engine = self._engine
        weights = engine.offsets.get("model.onnx.data")
        session = open_session({"model.onnx": engine.sections[section],
                                **({"model.onnx.data": FileRange(engine.path, weights)} if weights is not None else {})},
                               self._options)
        # Each as soon as it is built: freed together, the segments' bytes would leave the
        # heap fragmented (measured +400 MB resident for SmolLM2-135M's 30 segments).
        release_model_bytes(session)
        return session

    def _segmented(self) -> tuple[CpuPagedAttention, list]:
        """The attention kernel and the segments' sessions, built on first use."""
        if self._sessions is None:
            engine, geometry = self._engine, self.geometry
            # First: it loads the attention kernel in a thread while the sessions are built.
            dense_models = {(s.attention.scale, s.attention.softcap): engine.sections[s.attention.dense]
                            for s in self.segments if s.attention is not None and s.attention.dense}
            self._attention = CpuPagedAttention(geometry.num_heads, geometry.num_kv_heads, geometry.head_dim,
                                                self.block_size, self._threads, self._kv_dtype, dense_models)
            self._sessions = [segment.section and self._open(segment.section) for segment in self.segments]
            # The sessions hold their weights now: the file's pages that building them read go
            # from this process's resident set (they stay in the page cache).
            drop_file_pages(engine)
        return self._attention, self._sessions

    def step(self, tokens: np.ndarray, positions: np.ndarray, batch: PagedBatch,
             rows: np.ndarray | None = None, exact: bool = False) -> np.ndarray:
        """Run one packed step; stores its keys and values; returns the logits of the packed
        `rows` (default: each sequence's last token). `exact`: the sequence's logits must not
        depend on how its tokens are cut into steps (a request that guesses, `WholeGraph.step`)."""
        rows = batch.query_start_loc[1:] - 1 if rows is None else rows
        self._whole = self.single is not None and self.single.runs(batch, len(tokens))
        if self._whole:
            return self.single.step(tokens, positions, batch, rows, exact)
        if self.single is not None:
            self.single.flush()  # the segments read the pool
        attention, sessions = self._segmented()
        layout = attention.layout(batch, self.windows)
        values = {"input_ids": tokens[None], "position_ids": positions[None],
                  "logits_rows": np.asarray(rows, np.int64), **self.pools}
        stores = []
        for segment, session in zip(self.segments, sessions):
            if session is not None:
                outputs = session.run(segment.outputs, {name: values[name] for name in segment.inputs})
                values.update(zip(segment.outputs, outputs))
            call = segment.attention
            if call is not None:
                query, key, value, key_cache, value_cache = (values[name] for name in call.inputs[:5])
                # In the pool's type before attention reads them: a step sees its own keys and
                # values as every later step will, so outputs do not depend on how prompts are chunked.
                key, value = (np.ascontiguousarray(a, key_cache.dtype) for a in (key, value))
                attended = attention(query, key, value, key_cache, value_cache, layout, call.scale,
                                     call.window, call.softcap)
                values[call.output] = attended.astype(query.dtype, copy=False)  # the kernel computes in fp32
                stores += [(key_cache, key), (value_cache, value)]
        blocks, offsets = batch.slots(self.block_size)
        if self.single is not None:
            self.single.written(blocks)
        for pool, new in stores:
            attention.store(pool, new, blocks, offsets)
        return values["logits"][0]

    def keep(self, sequence: int, length: int) -> None:
        """Of the last step's `sequence` (its index in the batch), only the first `length`
        positions are the sequence's: the rest were speculative tokens the sampler did not keep,
        and their blocks may go to other sequences. The segments wrote them into the pool during
        the step, where they are never read; the whole graph must not write them back later."""
        if self._whole:
            self.single.keep(sequence, length)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: pool block `src` into `dst` for each pair, in every pool."""
        if pairs and self.single is not None:
            self.single.flush()
            self.single.written(np.array([dst for _, dst in pairs]))
        for src, dst in pairs:
            self.pool[:, dst] = self.pool[:, src]

    def warm_up(self, tokens: int = DENSE_MIN_TOKENS + 1, seqs: int = 2) -> None:
        """Run one throw-away step of `tokens` tokens (one prompt, the rest decodes of `seqs`
        sequences) on each path built so far, so the first real steps don't pay for first calls:
        onnxruntime's first allocations, and on the segments the attention kernel's threads and
        the dense form's session. The default, one prompt chunk (dense form) and one decode
        (kernel), is what start-up pays for: measured on SmolLM2-135M, 0.10 s, while a step of the
        scheduler's largest size (128 tokens, 63 of them decodes) took 0.5 s at load and saved the
        first real step of that size about 0.07 s. The decodes are left out while the kernel is
        still loading, except for concurrent traffic (`segments_at_load`), where the first mixed
        step would wait for it instead (Numba's start, 0.4-1.6 s): a single request's start-up
        does not. It writes only into pool blocks no request owns yet; nothing reads them before
        a request's own keys and values overwrite them."""
        blocks = self.num_blocks
        if self.single is not None:
            prompt = max(1, min(tokens, blocks * self.block_size))
            width = -(-prompt // self.block_size)
            batch = PagedBatch(np.arange(width)[None], np.zeros(1, np.int64), np.array([0, prompt]))
            self.step(np.zeros(prompt, np.int64), np.arange(prompt), batch)
            self.single.invalidate()
        if self._sessions is None:
            return
        if self._kernel_at_load:
            self._attention.wait_until_loaded()
        elif not self._attention.loaded:
            seqs = 1
        decodes = max(0, min(seqs - 1, tokens - 1, blocks - 1))
        prompt = max(1, min(tokens - decodes, (blocks - decodes) * self.block_size))
        width = -(-prompt // self.block_size)
        tables = np.zeros((decodes + 1, width), np.int64)
        tables[0] = np.arange(width)
        tables[1:, 0] = width + np.arange(decodes)
        starts = np.concatenate([[0], prompt + np.arange(decodes + 1)])
        batch = PagedBatch(tables, np.array([0] + [1] * decodes), starts)
        positions = np.concatenate([np.arange(prompt), np.ones(decodes, np.int64)])
        self.step(np.zeros(prompt + decodes, np.int64), positions, batch)
