"""A paged engine's steps that hold one sequence, as one onnxruntime call.

The segmented path (runtime/backends/paged_onnxruntime.py) pays per layer for a session run, an
attention kernel call and the Python between them: measured on the 25M Llama at batch 1, 1.3 ms
of a 5.9 ms decode step, and the larger part of an int4 one. A chat user, a single API call or
an agent loop mostly runs one sequence, so such a step runs the engine's single-sequence graph
(passes/lower_single_sequence.py) instead: the whole model in one session, attention by
onnxruntime's GroupQueryAttention over a contiguous buffer per layer that the session appends to
in place (bound as both its past and its present).

The pool stays the one record of every sequence's keys and values: each step also stores what it
appended into the sequence's pool blocks (a few KiB a token), so a step of several sequences, a
prefix-cache hit or a copy-on-write reads the same values whichever path made them. The buffer
caches the last sequence run here: the next single-sequence step reuses it when it continues that
sequence (same leading blocks, no positions missing); otherwise the buffer is refilled from the
pool first. Any step that writes the pool some other way makes the buffer stale (`invalidate`).

Memory: the buffer holds max_seq_len positions but, like the pool, is mapped on first write, so it
grows with the longest sequence it has held. The session holds its own prepacked weights: with
the segments' sessions built as well (the first step of several sequences builds them), resident
memory holds the weights twice.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from llmc.plugins.paged_attention import PagedBatch


class SingleSequence:
    """The single-sequence session and its key/value buffers.

    Args:
        session: the engine's single-sequence graph, opened.
        layers, kv_heads, head_dim, capacity: the buffers' shape (capacity: max_seq_len).
        block_size: the pool's.
        dtype: the buffers' element type (the pool's).
        allocate: makes a zeroed array whose pages are mapped on first write.
    """

    def __init__(self, session: ort.InferenceSession, layers: int, kv_heads: int, head_dim: int, capacity: int,
                 block_size: int, dtype: str, allocate):
        self.session, self.block_size = session, block_size
        self._binding = session.io_binding()
        self._binding.bind_output("logits")  # first: get_outputs()[0]
        # A decode's inputs and logits live in arrays bound once and rewritten in place: binding
        # fresh ones and collecting every output cost 10-20% of a small model's decode step.
        vocab = session.get_outputs()[0].shape[-1]  # fixed: the lowering declares it
        self._decode = {"input_ids": np.zeros((1, 1), np.int64), "position_ids": np.zeros((1, 1), np.int64),
                        "seqlens_k": np.zeros(1, np.int32), "total_sequence_length": np.zeros((), np.int32),
                        "logits_rows": np.zeros(1, np.int64), "logits": np.zeros((1, 1, vocab), np.float32)}
        self._decode_values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in self._decode.items()}
        self.buffers = {}
        self._values = []  # the binding's views of the buffers
        for layer in range(layers):
            for part in ("key", "value"):
                buffer = allocate((1, kv_heads, capacity, head_dim), dtype)
                value = ort.OrtValue.ortvalue_from_numpy(buffer)  # shares the array's memory
                self._values.append(value)
                self._binding.bind_ortvalue_input(f"past_key_values.{layer}.{part}", value)
                self._binding.bind_ortvalue_output(f"present.{layer}.{part}", value)
                self.buffers[f"{part}_cache.{layer}"] = buffer  # by the pool it mirrors
        self._table: np.ndarray | None = None  # the held sequence's block table
        self._held = 0  # positions of it in the buffers

    def invalidate(self) -> None:
        """The pool changed outside this path: the buffers hold nothing reusable."""
        self._table, self._held = None, 0

    def step(self, tokens: np.ndarray, positions: np.ndarray, batch: PagedBatch, rows: np.ndarray,
             pools: dict[str, np.ndarray]) -> np.ndarray:
        """Run one step of one sequence (`batch` holds one row); stores its keys and values in
        `pools` too; returns the logits of `rows`."""
        table, past = batch.block_tables[0], int(batch.context_lens[0])
        if not self._holds(table, past):
            self._load(table, past, pools)
        total = past + len(tokens)
        binding = self._binding
        if len(tokens) == 1 and len(rows) == 1:
            logits = self._run_decode(tokens, positions, total, rows)
        else:
            binding.bind_cpu_input("input_ids", tokens[None])
            binding.bind_cpu_input("position_ids", positions[None])
            binding.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
            binding.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
            binding.bind_cpu_input("logits_rows", np.asarray(rows, np.int64))
            binding.bind_output("logits")  # again: a bound output keeps the last run's shape
            self.session.run_with_iobinding(binding)
            logits = binding.get_outputs()[0].numpy()
        self._table, self._held = np.array(table), total
        # Block by block: a buffer's [kv_heads, positions, head_dim] run is a block's slice as it is.
        first = past
        while first < total:
            block, offset = int(table[first // self.block_size]), first % self.block_size
            end = min(total, first - offset + self.block_size)
            for name, pool in pools.items():
                pool[block, :, offset:offset + end - first] = self.buffers[name][0, :, first:end]
            first = end
        return logits[0]

    def _run_decode(self, tokens: np.ndarray, positions: np.ndarray, total: int, rows: np.ndarray) -> np.ndarray:
        """One new token, one logits row, through the arrays bound for decodes."""
        arrays = self._decode
        arrays["input_ids"][0, 0], arrays["position_ids"][0, 0] = tokens[0], positions[0]
        arrays["seqlens_k"][0], arrays["total_sequence_length"][()] = total - 1, total
        arrays["logits_rows"][0] = rows[0]
        for name, value in self._decode_values.items():
            if name == "logits":
                self._binding.bind_ortvalue_output(name, value)
            else:
                self._binding.bind_ortvalue_input(name, value)
        self.session.run_with_iobinding(self._binding)
        return arrays["logits"].copy()  # the array is the next decode's too

    def _holds(self, table: np.ndarray, past: int) -> bool:
        """Whether the buffers hold this sequence's first `past` positions: the held sequence had
        at least that many, in the same blocks (a block's contents are the same in the pool and
        here, whichever sequence owns it now)."""
        if self._table is None or self._held < past:
            return False
        needed = -(-past // self.block_size)
        return needed <= len(self._table) and np.array_equal(self._table[:needed], table[:needed])

    def _load(self, table: np.ndarray, past: int, pools: dict[str, np.ndarray]) -> None:
        """Copy the sequence's first `past` positions from its pool blocks into the buffers."""
        if past:
            blocks = table[:-(-past // self.block_size)]
            for name, pool in pools.items():
                gathered = pool[blocks]  # [blocks, kv_heads, block_size, head_dim]
                kv_heads, head_dim = gathered.shape[1], gathered.shape[3]
                flat = gathered.transpose(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)
                self.buffers[name][0, :, :past] = flat[:, :past]
        self._table, self._held = np.array(table), past
