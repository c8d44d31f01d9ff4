"""How a step runs, decided once per step as a value: which path, which tokens, guesses and padding.

The scheduler picks the step's chunks (runtime/scheduler.py); `StepPlanner.plan` adds the greedy
requests' guesses (runtime/prompt_lookup.py), packs the chunks' tokens, chooses the path the
backend runs them on, and returns a `StepPlan` that the engine logs at debug level and hands to
its backend (runtime/backends/base.py). A backend says what it can run in `StepPaths`; nothing
here asks which backend it is.

Paths:
- ``packed``: every backend's general step: the packed tokens of any mix of prompts and decodes
  (the CPU's segments with the attention kernel between them; a TensorRT engine).
- ``whole-graph``: the CPU's single-sequence graph, one session call, for a step of one sequence
  or of one new token for each of at most `StepPaths.whole_graph_rows` sequences (a step without
  the Python between layers: measured on the 25M Llama at batch 1, 1.3 ms of a 5.9 ms decode).
  GroupQueryAttention takes several new tokens with a past for one sequence only, so a decode in
  which several sequences carry guesses runs packed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from llmc.plugins.paged_attention import PagedBatch
from llmc.runtime.prompt_lookup import PromptLookup
from llmc.runtime.scheduler import Chunk, Request, Scheduler

PACKED = "packed"
WHOLE_GRAPH = "whole-graph"


@dataclass(frozen=True)
class StepPaths:
    """What a backend can run, for the planner to choose from.

    Args:
        whole_graph_rows: the most sequences of a decode step its whole graph runs; 0: it has none.
        padding_row: its whole graph can give a lone token a padding row, so that a sequence's
            logits do not depend on how its tokens are cut into steps.
        step_tokens: the engine's default token budget a step (`SchedulerConfig.
            max_num_batched_tokens`): what its kernels run best at.
    """

    whole_graph_rows: int = 0
    padding_row: bool = False
    step_tokens: int = 512


@dataclass(frozen=True)
class StepPlan:
    """One step, as the backend runs it.

    tokens, positions: the packed tokens and their positions. batch: the block tables, pasts and
    where each sequence's tokens start. rows: the packed rows whose logits the step returns (each
    sequence's last token, and before it its guesses' rows, or every token of a prompt chunk whose
    request asks for its prompt's log-probabilities); chunk_rows: how many of them each chunk has,
    in order. pad: the lone token gets the whole
    graph's padding row. copies: copy-on-write block pairs to apply before the step. chunks: the
    scheduled chunks, with their guesses (`Chunk.draft`).
    """

    path: str
    tokens: np.ndarray
    positions: np.ndarray
    batch: PagedBatch
    rows: np.ndarray
    chunk_rows: tuple[int, ...] = ()
    pad: bool = False
    copies: tuple[tuple[int, int], ...] = ()
    chunks: tuple[Chunk, ...] = field(default=(), repr=False)

    @property
    def num_seqs(self) -> int:
        return self.batch.num_seqs

    @property
    def kind(self) -> str:
        """What the step is, as profiles group steps: "prefill" (prompt chunks only), "decode bN"
        (a token for each of N sequences, with any guesses), or "mixed" (prompt chunks beside
        decodes, however many: a batch's prompts arrive beside a growing number of decodes)."""
        prompts = sum(c.count - len(c.draft) > 1 for c in self.chunks)
        if prompts == len(self.chunks):
            return "prefill"
        return "mixed" if prompts else f"decode b{self.num_seqs}"

    def attended_positions(self) -> int:
        """Positions the step's attention reads, summed over its tokens (a token at position p
        attends to p + 1, windows aside): the KV cache it reads, for profiles' bounds."""
        pasts = np.asarray(self.batch.context_lens, np.int64)
        starts = np.asarray(self.batch.query_start_loc, np.int64)
        new = starts[1:] - starts[:-1]
        return int(np.sum(new * pasts + new * (new + 1) // 2))

    def __str__(self) -> str:
        guesses = sum(len(c.draft) for c in self.chunks)
        decodes = sum(c.count - len(c.draft) == 1 for c in self.chunks)
        return (f"step {self.path}: {self.num_seqs} seqs ({decodes} decodes), {len(self.tokens)} tokens, "
                f"{guesses} guesses, {len(self.rows)} logits rows{', padded' if self.pad else ''}"
                f"{f', {len(self.copies)} block copies' if self.copies else ''}")


def choose_path(paths: StepPaths, num_seqs: int, tokens: int) -> str:
    """The whole graph where it runs the step (one sequence, or a token for each of at most its
    rows), else packed."""
    if paths.whole_graph_rows and (num_seqs == 1 or tokens == num_seqs <= paths.whole_graph_rows):
        return WHOLE_GRAPH
    return PACKED


def packed_plan(paths: StepPaths, tokens: np.ndarray, positions: np.ndarray, batch: PagedBatch,
                rows: np.ndarray) -> StepPlan:
    """The plan of a step packed by its caller (`Engine.logits`: one sequence's every row)."""
    return StepPlan(choose_path(paths, batch.num_seqs, len(tokens)), tokens, positions, batch, rows)


def pack(chunks, block_tables: list[list[int | None]], paths: StepPaths, exact: bool = False,
         copies=()) -> StepPlan:
    """The plan of a step of `chunks` (their guesses included) whose sequences hold `block_tables`.
    `exact`: a lone token gets the padding row where the whole graph has one (a request that
    guesses, alone in its step: its outputs must not depend on how its guesses cut its steps)."""
    width = max(len(t) for t in block_tables)
    tables = np.zeros((len(chunks), width), np.int64)
    for row, table in enumerate(block_tables):
        # Blocks released behind the window are None: attention never reads their entries.
        tables[row, :len(table)] = [0 if block is None else block for block in table] if None in table else table
    starts = np.array([c.start for c in chunks], np.int64)
    if all(c.count == 1 for c in chunks):  # decodes only: a token each
        tokens = np.array([c.request.token_ids[c.start] for c in chunks], np.int64)
        positions, packed = starts, np.arange(len(chunks) + 1)
        rows, counts = packed[1:] - 1, [1] * len(chunks)
    else:
        tokens = np.concatenate([c.tokens for c in chunks]).astype(np.int64)
        positions = np.concatenate([np.arange(c.start, c.start + c.count) for c in chunks]).astype(np.int64)
        packed = np.concatenate([[0], np.cumsum([c.count for c in chunks])]).astype(np.int64)
        # A guess is checked against the logits of the token before it.
        counts = [c.count if c.request.wants_prompt_rows else 1 + len(c.draft) for c in chunks]
        rows = np.concatenate([np.arange(end - n, end) for n, end in zip(counts, packed[1:])]) \
            if any(n > 1 for n in counts) else packed[1:] - 1
    path = choose_path(paths, len(chunks), len(tokens))
    pad = path == WHOLE_GRAPH and paths.padding_row and exact and len(tokens) == 1
    return StepPlan(path, tokens, positions, PagedBatch(tables, starts, packed), rows, tuple(counts), pad,
                    tuple(copies), tuple(chunks))


class StepPlanner:
    """Decides each step of an engine: the guesses its greedy requests make, the packing, the path.

    Args:
        paths: what the backend runs.
        speculative_tokens: the most tokens a request guesses ahead (0: none).
        guess_beside_others: a request may guess in a step with others (which runs packed, whose
            attention rounds unlike the whole graph's: exact enough for fp32 linear layers only).
        scheduler: the scheduler whose chunks it plans (a guess's slots are held through it, and
            its block manager's tables are the step's).
        budget: the most tokens a request may generate.
    """

    def __init__(self, paths: StepPaths, speculative_tokens: int, guess_beside_others: bool, scheduler: Scheduler,
                 budget: Callable[[Request], int]):
        self.paths, self.speculative_tokens = paths, speculative_tokens
        self._beside_others, self._scheduler, self._budget = guess_beside_others, scheduler, budget

    def plan(self, chunks: list[Chunk], lookups: Mapping[str, PromptLookup]) -> StepPlan:
        """The step of the scheduled `chunks`; `lookups`: the requests that may guess."""
        if lookups:
            chunks = self._with_drafts(chunks, lookups)
        exact = len(chunks) == 1 and chunks[0].request.request_id in lookups
        blocks = self._scheduler.blocks
        return pack(chunks, [blocks.block_table(c.request.request_id) for c in chunks], self.paths, exact,
                    self._scheduler.copies)

    def _with_drafts(self, chunks: list[Chunk], lookups: Mapping[str, PromptLookup]) -> list[Chunk]:
        """The step's decode chunks with their requests' guesses, within the step's token budget.
        A request alone in its step guesses up to speculative_tokens: the step reads the weights
        once for all its tokens. Beside others it guesses only as far as its guesses are likely
        to be kept (`PromptLookup.likely`): such a step is bound by compute as well, and a step
        with a guess runs packed (measured: as fast as the whole graph from 16 decodes up, 5-10%
        slower at 4)."""
        room = self._scheduler.config.max_num_batched_tokens - sum(c.count for c in chunks)
        drafted = []
        for chunk in chunks:
            request = chunk.request
            lookup = lookups.get(request.request_id)
            if lookup is not None and room > 0 and chunk.count == 1 and chunk.start == len(request.token_ids) - 1:
                # Guesses past the request's last token would be generated for nothing.
                limit = min(self.speculative_tokens, room, self._budget(request) - len(request.output_ids) - 1)
                draft = lookup.propose(limit) if len(chunks) == 1 else \
                    lookup.likely(limit) if self._beside_others else []
                chunk = self._scheduler.with_draft(chunk, draft) if draft else chunk
                room -= len(chunk.draft)
            drafted.append(chunk)
        return drafted
