"""Generation through a paged engine: the KV cache lives in fixed-size blocks of one pool.

Each step packs the new tokens of every running sequence (all prompts at the first step, one
token per sequence after), runs the lowered graph, stores the step's new keys and values into
the pool slots the sequences own (one vectorized scatter per layer), and samples. Blocks are
handed out from a free list as sequences grow; the full block manager (prefix sharing,
eviction, preemption) arrives with the serving runtime.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import onnxruntime as ort

from llmc.compiler.decoder_interface import Geometry
from llmc.errors import LlmcError
from llmc.plugins.paged_attention import PagedBatch
from llmc.plugins.paged_attention_onnx import plan_step
from llmc.runtime.contiguous_generation import TokenEvent, finish_reason
from llmc.runtime.sampler import sample
from llmc.runtime.sampling_params import SamplingParams


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
        shape = (num_blocks, geometry.num_kv_heads, block_size, geometry.head_dim)
        self.pools = {f"{part}_cache.{i}": np.zeros(shape, np.float32)
                      for i in range(geometry.num_layers) for part in ("key", "value")}
        self.free_blocks = list(range(num_blocks))

    def step(self, tokens: np.ndarray, positions: np.ndarray, batch: PagedBatch) -> np.ndarray:
        """Run one packed step; stores its keys and values; returns each sequence's last logits."""
        plan = plan_step(batch, self.block_size)
        logits_rows = batch.query_start_loc[1:] - 1
        outputs = self.session.run(None, {"input_ids": tokens[None], "position_ids": positions[None],
                                          **self.pools, **plan.feeds(), "logits_rows": logits_rows})
        names = [o.name for o in self.session.get_outputs()]
        new = dict(zip(names, outputs))
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

    def allocate(self, table: list[int], length: int) -> None:
        """Grow a sequence's block table to hold `length` tokens."""
        while len(table) * self.block_size < length:
            if not self.free_blocks:
                raise LlmcError(f"KV pool of {len(self.pools['key_cache.0'])} blocks is full")
            table.append(self.free_blocks.pop(0))


def generate_paged(decoder: PagedDecoder, prompts: Sequence[Sequence[int]],
                   params: Sequence[SamplingParams], eos_id: int | None) -> Iterator[TokenEvent]:
    """Generate for tokenized prompts through the paged decoder, yielding tokens as produced."""
    count = len(prompts)
    tables: list[list[int]] = [[] for _ in prompts]
    past = [0] * count
    pending = [list(p) for p in prompts]  # tokens each sequence feeds at the next step
    rngs = [np.random.default_rng(p.seed) for p in params]
    budgets = [min(p.max_new_tokens, decoder.max_seq_len - len(prompt))
               for p, prompt in zip(params, prompts)]
    generated = [0] * count
    outputs: list[list[int]] = [[] for _ in prompts]
    running = list(range(count))
    while running:
        for s in running:
            decoder.allocate(tables[s], past[s] + len(pending[s]))
        width = max(len(tables[s]) for s in running)
        block_tables = np.zeros((len(running), max(width, 1)), np.int64)
        for row, s in enumerate(running):
            block_tables[row, : len(tables[s])] = tables[s]
        lens = [len(pending[s]) for s in running]
        batch = PagedBatch(block_tables, np.array([past[s] for s in running], np.int64),
                           np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
        tokens = np.concatenate([pending[s] for s in running]).astype(np.int64)
        positions = np.concatenate([np.arange(past[s], past[s] + len(pending[s])) for s in running])
        logits = decoder.step(tokens, positions.astype(np.int64), batch)
        still = []
        for row, s in enumerate(running):
            past[s] += len(pending[s])
            token = sample(logits[row], params[s], rngs[s], prompts[s], outputs[s])
            outputs[s].append(token)
            generated[s] += 1
            reason = finish_reason(token, generated[s], budgets[s], params[s], eos_id)
            yield TokenEvent(s, token, reason)
            if reason is None:
                pending[s] = [token]
                still.append(s)
            else:
                decoder.free_blocks.extend(tables[s])
                tables[s] = []
        running = still
