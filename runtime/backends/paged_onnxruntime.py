"""One step of a paged engine on the CPU: packed tokens in, last-token logits out, new K/V into
the pool.

The engine holds its graph cut at each ``llmc::PagedAttention`` node into segments
(compiler/segments.py), which onnxruntime cannot run whole; the runtime runs segment (an
onnxruntime session), attention (plugins/paged_attention_cpu.py, reading the pool in place),
segment, … and carries the values that cross a cut. The step's new keys and values are stored at
the slots the sequences own afterwards — one vectorized scatter per layer per step, never a copy
of the pool.
"""

from __future__ import annotations

import numpy as np

from llmc.errors import LlmcError
from llmc.formats.engine_file import EngineFile
from llmc.formats.onnx_io import FileRange
from llmc.formats.sessions import open_session
from llmc.plugins.paged_attention import PagedBatch
from llmc.plugins.paged_attention_cpu import POOL_TYPES, CpuPagedAttention, session_options, store


class PagedDecoder:
    """The segments' sessions, the attention kernel and the KV pools they read and write.

    Args:
        engine: a paged engine file.
        threads: CPU threads; None uses every core.
    """

    def __init__(self, engine: EngineFile, threads: int | None = None):
        manifest, paged = engine.manifest, engine.manifest.paged
        if paged is None:
            raise LlmcError(f"{engine.path}: not a paged engine ({manifest.not_paged})")
        geometry = self.geometry = manifest.geometry
        self.block_size, self.max_seq_len = paged.block_size, paged.max_seq_len
        self.segments = paged.segments
        self.windows = tuple(s.attention.window for s in self.segments if s.attention is not None)
        options = session_options(threads)
        # Past 2 GB the segments reference their weights in the engine's data section, unread.
        weights = engine.offsets.get("model.onnx.data")
        self._sessions = [segment.section and open_session(
            {"model.onnx": engine.sections[segment.section],
             **({"model.onnx.data": FileRange(engine.path, weights)} if weights is not None else {})}, options)
            for segment in self.segments]
        self.attention = CpuPagedAttention(geometry.num_heads, geometry.num_kv_heads, geometry.head_dim,
                                           paged.block_size, threads, paged.kv_dtype)
        shape = (paged.num_blocks, geometry.num_kv_heads, paged.block_size, geometry.head_dim)
        # Filled, not just allocated: np.zeros maps pages lazily, and the kernel zeroing them on
        # first write cost up to 70 ms in the step that first used fresh blocks.
        self.pools = {f"{part}_cache.{i}": np.full(shape, 0, paged.kv_dtype)
                      for i in range(geometry.num_layers) for part in ("key", "value")}

    def step(self, tokens: np.ndarray, positions: np.ndarray, batch: PagedBatch,
             rows: np.ndarray | None = None) -> np.ndarray:
        """Run one packed step; stores its keys and values; returns the logits of the packed
        `rows` (default: each sequence's last token)."""
        layout = self.attention.layout(batch, self.windows)
        rows = batch.query_start_loc[1:] - 1 if rows is None else rows
        values = {"input_ids": tokens[None], "position_ids": positions[None],
                  "logits_rows": np.asarray(rows, np.int64), **self.pools}
        stores = []
        for segment, session in zip(self.segments, self._sessions):
            if session is not None:
                outputs = session.run(segment.outputs, {name: values[name] for name in segment.inputs})
                values.update(zip(segment.outputs, outputs))
            call = segment.attention
            if call is not None:
                query, key, value, key_cache, value_cache = (values[name] for name in call.inputs[:5])
                # In the pool's type before attention reads them: a step sees its own keys and
                # values as every later step will, so outputs do not depend on how prompts are chunked.
                key, value = (np.ascontiguousarray(a, key_cache.dtype) for a in (key, value))
                attended = self.attention(query, key, value, key_cache, value_cache, layout, call.scale,
                                          call.window, call.softcap)
                values[call.output] = attended.astype(query.dtype, copy=False)  # the kernel computes in fp32
                stores += [(key_cache, key), (value_cache, value)]
        blocks, offsets = self._slots(batch)
        for pool, new in stores:
            bits = POOL_TYPES[pool.dtype]  # Numba has no float16: it stores the bits
            store(pool.view(bits), new.view(bits), blocks, offsets)
        return values["logits"][0]

    def warm_up(self, tokens: int, seqs: int) -> None:
        """Run one throw-away step of `tokens` tokens (one prompt, the rest decodes of `seqs`
        sequences), so the first real steps don't pay for onnxruntime's first allocations and
        kernel choices (measured: 95 ms instead of 25 on the serving benchmark's first mixed step).
        It writes only into pool blocks no request owns yet; nothing reads them before a
        request's own keys and values overwrite them."""
        blocks = len(next(iter(self.pools.values())))
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

    def _slots(self, batch: PagedBatch) -> tuple[np.ndarray, np.ndarray]:
        """Pool block and offset of every packed token's slot (past length + its index)."""
        starts = np.asarray(batch.query_start_loc, np.int64)
        sequence = np.repeat(np.arange(batch.num_seqs), np.diff(starts))  # of each packed token
        slots = np.asarray(batch.context_lens, np.int64)[sequence] + np.arange(starts[-1]) - starts[sequence]
        blocks = np.asarray(batch.block_tables, np.int64)[sequence, slots // self.block_size]
        return blocks, slots % self.block_size
