"""One step of a paged engine: packed tokens in, last-token logits out, new K/V into the pool.

The runtime's engine (runtime/engine.py) decides what runs; this runs it: the lowered graph
reads the pools through the block tables, and its new keys and values are stored at the slots
the sequences own — one vectorized scatter per layer per step, never a copy of the pool.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from llmc.compiler.decoder_interface import Geometry
from llmc.plugins.paged_attention import PagedBatch
from llmc.plugins.paged_attention_onnx import plan_step


class PagedDecoder:
    """A session over a lowered (paged) graph and the pools it reads.

    Args:
        session: onnxruntime session over the output of the lower-paged-attention pass.
        geometry: the model's geometry.
        block_size: tokens per block (the value the graph was lowered with).
        num_blocks: blocks in the pool, shared by all sequences.
        max_seq_len: longest sequence the engine was sized for; default the model's positions.
    """

    def __init__(self, session: ort.InferenceSession, geometry: Geometry, block_size: int, num_blocks: int,
                 max_seq_len: int | None = None):
        self.session, self.geometry, self.block_size = session, geometry, block_size
        self.max_seq_len = max_seq_len or geometry.max_positions
        self._output_names = [o.name for o in session.get_outputs()]
        shape = (num_blocks, geometry.num_kv_heads, block_size, geometry.head_dim)
        self.pools = {f"{part}_cache.{i}": np.zeros(shape, np.float32)
                      for i in range(geometry.num_layers) for part in ("key", "value")}

    def step(self, tokens: np.ndarray, positions: np.ndarray, batch: PagedBatch) -> np.ndarray:
        """Run one packed step; stores its keys and values; returns each sequence's last logits."""
        plan = plan_step(batch, self.block_size)
        logits_rows = batch.query_start_loc[1:] - 1
        outputs = self.session.run(None, {"input_ids": tokens[None], "position_ids": positions[None],
                                          **self.pools, **plan.feeds(), "logits_rows": logits_rows})
        new = dict(zip(self._output_names, outputs))
        blocks, offsets = self._slots(batch)
        for i in range(self.geometry.num_layers):
            self.pools[f"key_cache.{i}"][blocks, :, offsets] = new[f"new_key.{i}"]
            self.pools[f"value_cache.{i}"][blocks, :, offsets] = new[f"new_value.{i}"]
        return new["logits"][0]

    def _slots(self, batch: PagedBatch) -> tuple[np.ndarray, np.ndarray]:
        """Pool block and offset of every packed token's slot (past length + its index)."""
        blocks, offsets = [], []
        for s in range(batch.num_seqs):
            count = int(batch.query_start_loc[s + 1] - batch.query_start_loc[s])
            slots = int(batch.context_lens[s]) + np.arange(count)
            blocks.append(batch.block_tables[s, slots // self.block_size])
            offsets.append(slots % self.block_size)
        return np.concatenate(blocks), np.concatenate(offsets)
