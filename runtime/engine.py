"""The serving engine: `step()` is schedule → execute → postprocess.

Requests join and leave the running batch at every step (continuous batching). Execute packs the
scheduled chunks into one call of the paged engine, performs the block copies the block manager
asked for, and stores the step's new keys and values in the pool; postprocess samples for every
request whose prompt (or last token) is now fully computed, applies stop conditions and releases
finished requests' blocks.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llmc.errors import LlmcError
from llmc.plugins.paged_attention import PagedBatch
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.contiguous_generation import finish_reason
from llmc.runtime.sampler import sample
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk, Request, Scheduler, SchedulerConfig


@dataclass(frozen=True)
class RequestOutput:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    text: str  # the new text (held back while it ends inside a multi-byte character)
    finished: bool
    finish_reason: str | None


class Engine:
    """Continuous batching over a paged engine file.

    Args:
        llm: an `LLM` loaded from a paged engine.
        config: scheduling limits; defaults from the engine's max batch.
    """

    def __init__(self, llm, config: SchedulerConfig | None = None):
        paged = llm.manifest.get("paged")
        if not paged:
            raise LlmcError(f"{llm.path}: not a paged engine (compiled with --no-paged or not "
                            "expressible paged); Engine needs one")
        self.llm, self.decoder = llm, llm.paged_decoder
        self.config = config or SchedulerConfig(max_num_seqs=paged["max_batch"])
        # A sliding window on every layer lets blocks behind it be freed (engines built before
        # sliding windows have no "window": none).
        self.blocks = BlockManager(paged["num_blocks"], paged["block_size"], paged.get("window"))
        self.scheduler = Scheduler(self.config, self.blocks)
        self.decoder.warm_up(min(self.config.max_num_batched_tokens,
                                 self.config.max_prefill_tokens or self.config.max_num_batched_tokens),
                             self.config.max_num_seqs)
        self._ids = itertools.count()
        self._utilization: list[float] = []

    @classmethod
    def from_file(cls, path: str | os.PathLike, config: SchedulerConfig | None = None,
                  threads: int | None = None) -> "Engine":
        from llmc.llm import LLM

        return cls(LLM(path, threads), config)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    priority: int = 0, request_id: str | None = None) -> str:
        """Queue a request; raises LlmcError if it could never run on this engine."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        ids = self.llm.encode(prompt, request_id) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise LlmcError(f"request {request_id}: empty prompt")
        longest = min(len(ids) + params.max_new_tokens, self.decoder.max_seq_len)
        if len(ids) >= self.decoder.max_seq_len:
            raise LlmcError(f"request {request_id}: {len(ids)} prompt tokens leave no room in the "
                            f"engine's {self.decoder.max_seq_len} positions")
        needed = -(-longest // self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            raise LlmcError(f"request {request_id}: needs {needed} KV blocks, the pool has "
                            f"{self.blocks.num_blocks} (KV pool too small)")
        self.scheduler.add(Request(request_id, ids, params, priority))
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request; returns whether it was still pending."""
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        logits = self._execute(chunks)
        return self._postprocess(chunks, logits)

    @property
    def stats(self) -> dict:
        block_stats = self.blocks.stats
        return {"kv_utilization": float(np.mean(self._utilization)) if self._utilization else 0.0,
                "prefix_hit_rate": block_stats.prefix_hit_rate,
                "preemptions": self.scheduler.preemptions}

    def _execute(self, chunks: list[Chunk]) -> np.ndarray:
        for pool in self.decoder.pools.values():
            for src, dst in self.scheduler.copies:
                pool[dst] = pool[src]
        tables = [self.blocks.block_table(c.request.request_id) for c in chunks]
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(chunks), width), np.int64)
        for row, table in enumerate(tables):
            # Blocks released behind the window are None: the op never reads their entries.
            block_tables[row, :len(table)] = [0 if block is None else block for block in table]
        counts = [c.count for c in chunks]
        batch = PagedBatch(block_tables, np.array([c.start for c in chunks], np.int64),
                           np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
        tokens = np.concatenate([c.request.token_ids[c.start:c.start + c.count] for c in chunks])
        positions = np.concatenate([np.arange(c.start, c.start + c.count) for c in chunks])
        self._utilization.append(self.blocks.stats.utilization)
        return self.decoder.step(tokens.astype(np.int64), positions.astype(np.int64), batch)

    def _postprocess(self, chunks: list[Chunk], logits: np.ndarray) -> list[RequestOutput]:
        outputs = []
        for row, chunk in enumerate(chunks):
            request = chunk.request
            request.num_computed += chunk.count
            self.blocks.mark_computed(request.request_id, request.num_computed)
            if request.num_computed < len(request.token_ids):
                continue  # a prefill chunk short of the prompt's end: no token yet
            token = sample(logits[row], request.params, request.rng, request.prompt_ids, request.output_ids)
            request.output_ids.append(token)
            outputs.append(self._emit(request, token))
        return outputs

    def _emit(self, request: Request, token: int) -> RequestOutput:
        params = request.params
        budget = min(params.max_new_tokens, self.decoder.max_seq_len - len(request.prompt_ids))
        reason = finish_reason(token, len(request.output_ids), budget, params, self.llm.tokenizer.eos_ids)
        text = self.llm.tokenizer.decode(request.output_ids)
        for stop in params.stop:
            at = text.find(stop)
            if at >= 0:
                text, reason = text[:at], "stop"
        if reason is None and text.endswith("\ufffd"):
            delta = ""  # hold back a partial multi-byte character
        else:
            delta = text[len(request.text):]
            request.text = text
        if reason is not None:
            self.scheduler.finish(request, reason)
        return RequestOutput(request.request_id, [token], delta, reason is not None, reason)
