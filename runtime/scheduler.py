"""Iteration-level scheduling: which requests run in the next step, and how many tokens each.

Every step packs, under a token budget and a cap on sequences:
  1. running requests that decode (one token each) — first, so a long prompt never freezes them;
  2. waiting requests, admitted in FIFO or priority order while seats, budget and KV blocks last;
  3. running requests still in prefill (except in a step that admitted new ones, which they sit
     out, never two in a row), shortest remaining prompt first, one chunk each
     (chunked prefill) with what budget is left; beside other requests, a chunk deep in a long
     prompt shrinks as its context grows, so that such steps stay short too; a prompt with no
     other request running or waiting takes the whole budget instead of the prefill cap.
When a running request needs a block for its next token and the pool is empty, the scheduler
preempts by recompute: the lowest-ranked running request (the newest under FIFO) gives back all
its blocks and returns to the front of the queue with its output so far, to be prefilled again
later. Nothing is lost or corrupted; it only costs recomputation. A preempted request leaves the
step it was packed in, and a step that preempts admits no one. Blocks are touched only through
the block manager.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.sampling_params import SamplingParams

POLICIES = ("fifo", "priority")
# Past this many computed tokens a prompt's chunk shrinks in proportion (see Scheduler._chunk).
LONG_CONTEXT = 512
# The smallest chunk worth running of a prompt in prefill (it is the CPU attention's threshold
# for its dense path too: below it, the in-place kernel serves the chunk, slowly at long context).
QUERY_FLOOR = 16
# The SchedulerConfig fields that None leaves to the engine (`SchedulerConfig.filled`).
ENGINE_SET = ("max_num_seqs", "max_num_batched_tokens", "lone_prompt_uses_budget")
# What a server (`llmc serve`, a Ray replica) schedules by where its options leave it: steps of at
# most 512 tokens on every backend (an engine's own budget is 2,048 on OpenVINO), since every
# running request waits out each step for its next token; and a lone prompt cut like any other,
# since a request may arrive during any step.
SERVER_DEFAULTS = {"max_num_batched_tokens": 512, "lone_prompt_uses_budget": False}


@dataclass(frozen=True)
class SchedulerConfig:
    """How much one step may hold, and in what order waiting requests are admitted.

    The fields left None are the engine's to set (`filled`; `Engine` does): its max batch, its
    backend's step size (`StepPaths.step_tokens`: 512 tokens, 2,048 on OpenVINO), and whether a
    lone prompt takes the whole budget (not where requests are expected to overlap). So a config
    that sets one limit keeps the engine's others.

    Args:
        max_num_seqs: sequences in one step.
        max_num_batched_tokens: tokens in one step (prefill chunks and decode tokens together).
        policy: "fifo" (arrival order) or "priority" (lower value first, then arrival).
        max_wait_ms: hold new requests up to this long while too few wait to fill the free
            seats, trading a little latency for fuller batches; 0 admits at once.
        max_prefill_tokens: most prompt tokens one step may run, all requests together (default
            128); None allows the whole budget. New requests take it first, so a short prompt
            arriving while a long one is in prefill runs whole in the next step, and that step
            stays short: the long prompt gets only what is left. When several requests wait to
            start, they may take the whole budget.
        lone_prompt_uses_budget: a prompt with no other request running or waiting is cut by
            the token budget only, not by `max_prefill_tokens`: the cap keeps steps short for
            other requests, and there are none. A server turns it off: a request may arrive at
            any moment and would wait behind that longer step.
    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    policy: str = "fifo"
    max_wait_ms: float = 0.0
    # Measured (bench/serving_bench.py's interference workload): with a 3,000-token prompt in
    # flight, short requests' p99 time to first token falls several-fold against no cap.
    max_prefill_tokens: int | None = 128
    # Measured (SmolLM2-135M, 2,048-token prompt, 2 threads): chunks of the 512-token budget
    # give the first token 10-20% sooner than chunks of 128, on onnxruntime and OpenVINO alike.
    lone_prompt_uses_budget: bool | None = None

    def __post_init__(self):
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise LlmcError(f"max_num_seqs must be ≥ 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise LlmcError(f"max_num_batched_tokens must be ≥ 1, got {self.max_num_batched_tokens}")
        if self.policy not in POLICIES:
            raise LlmcError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.max_wait_ms >= 0:
            raise LlmcError(f"max_wait_ms must be ≥ 0, got {self.max_wait_ms}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise LlmcError(f"max_prefill_tokens must be ≥ 1, got {self.max_prefill_tokens}")

    def filled(self, max_num_seqs: int, max_num_batched_tokens: int, lone_prompt_uses_budget: bool) -> SchedulerConfig:
        """This config with the given values in the fields it leaves None (those it sets stand)."""
        given = dict(zip(ENGINE_SET, (max_num_seqs, max_num_batched_tokens, lone_prompt_uses_budget)))
        return dataclasses.replace(self, **{name: value for name, value in given.items() if getattr(self, name) is None})


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request and its progress."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose keys and values are in the pool
    status: Status = Status.WAITING
    finish_reason: str | None = None

    def __post_init__(self):
        self.rng = np.random.default_rng(self.params.seed)
        # Prompt then output, grown in place: read several times a step, it must not be rebuilt
        # (a copy per read made per-token work grow with the output's length).
        self.token_ids: list[int] = [*self.prompt_ids, *self.output_ids]
        # The prompt tokens' log-probabilities found so far, when asked for (the first has none).
        self.prompt_logprobs: list | None = None if self.params.prompt_logprobs is None else [None]

    @property
    def wants_prompt_rows(self) -> bool:
        """Whether its next prompt chunk must return the logits of every token, not the last's
        only (its prompt log-probabilities are not all found yet)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    def add_output(self, token: int) -> None:
        self.output_ids.append(token)
        self.token_ids.append(token)

    def rank(self) -> tuple:
        return (self.priority, self.arrival)


@dataclass(frozen=True)
class Chunk:
    """Tokens token_ids[start:start + count] of `request` run in this step; with a `draft`, its
    last len(draft) tokens are those guesses (speculative decoding), not yet the request's."""

    request: Request
    start: int
    count: int
    draft: tuple[int, ...] = ()

    @property
    def tokens(self) -> list[int]:
        return self.request.token_ids[self.start:self.start + self.count - len(self.draft)] + list(self.draft)


class Scheduler:
    """Waiting and running queues, the token budget and preemption.

    Args:
        config: budget, caps, policy, each set (`SchedulerConfig.filled`).
        blocks: the block manager owning the KV pool's blocks.
    """

    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        unset = [name for name in ENGINE_SET if getattr(config, name) is None]
        if unset:
            raise ValueError(f"SchedulerConfig: {', '.join(unset)} unset (SchedulerConfig.filled sets them)")
        self.config, self.blocks = config, blocks
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.preemptions = 0
        self.copies: list[tuple[int, int]] = []  # block copies the next step must perform first
        self._deferred: set[str] = set()  # prompts in prefill that sat out the last step

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is; returns it, or None if unknown or finished."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._release(request, "abort")
                    return request
        return None

    def finish(self, request: Request, reason: str) -> None:
        self.running.remove(request)
        self._release(request, reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float | None = None) -> list[Chunk]:
        """The next step's chunks; may preempt running requests to free blocks."""
        now = time.monotonic() if now is None else now
        budget = self.config.max_num_batched_tokens
        prefill = self.config.max_prefill_tokens or budget
        if self.config.lone_prompt_uses_budget and len(self.running) + len(self.waiting) == 1:
            prefill = max(prefill, budget)
        self.copies = []
        chunks: list[Chunk] = []
        scheduled: set[int] = set()  # id() of the requests with a chunk
        preempted, admitted, deferred = False, [], set()
        # Decodes first, then newly admitted prompts, then the chunks of prompts already in
        # prefill: a long prompt is processed in pieces with what budget is left, while short
        # requests keep decoding and new ones get their first token without waiting for it.
        for decoding in (True, False):
            # Prompts in prefill continue shortest-remaining first: a short prompt split by the
            # cap finishes before a long one takes the cap again.
            order = [r for r in self.running if (self._remaining(r) == 1) == decoding and id(r) not in scheduled]
            for request in order if decoding else sorted(order, key=self._remaining):
                if preempted and request not in self.running:
                    continue  # preempted by an earlier request of this pass
                if not decoding and admitted and request.request_id not in self._deferred:
                    # A step that starts new prompts stays short, so their first tokens come
                    # soon; a prompt in prefill sits out such a step, but never two in a row.
                    deferred.add(request.request_id)
                    continue
                if decoding:
                    if budget == 0:
                        continue  # no slot without a chunk: its copies would not be performed
                    # Only a decode needs a new slot (a prompt holds slots for all its tokens
                    # from admission on), so preemption happens in this first pass, before any
                    # prompt is packed. A victim leaves the step: its decode goes, and the token
                    # it took comes back. And a step that preempts admits no one: the victim
                    # would come back at once, only to be preempted again.
                    victims = self._make_room(request)
                    preempted = preempted or bool(victims)
                    budget += sum(c.count for c in chunks if c.request in victims)
                    chunks = [c for c in chunks if c.request not in victims]
                    scheduled.difference_update(id(v) for v in victims)
                    if request in victims:
                        continue
                count = min(self._remaining(request), budget, 1 if decoding else self._chunk(request, prefill))
                sliver = not decoding and count < min(QUERY_FLOOR, self._remaining(request)) \
                    and prefill < (self.config.max_prefill_tokens or self.config.max_num_batched_tokens)
                if count == 0 or sliver:
                    continue  # what other prompts left of the cap: costs more than it advances
                chunks.append(Chunk(request, request.num_computed, count))
                scheduled.add(id(request))
                budget -= count
                prefill -= 0 if decoding else count
            if decoding and not preempted:
                # One newcomer starts under the cap, like a prompt in prefill. A queue is a
                # burst: whoever arrives now waits behind it anyway, and fuller steps drain it
                # in fewer of them (measured: +10% offline throughput on OpenVINO's kernels).
                admitted = self._admit(budget if len(self.waiting) > 1 else min(budget, prefill), now)
                chunks += admitted
                scheduled.update(id(c.request) for c in admitted)
                budget -= sum(c.count for c in admitted)
                prefill = max(0, prefill - sum(c.count for c in admitted))
        self._deferred = deferred
        return chunks

    def with_draft(self, chunk: Chunk, draft: list[int]) -> Chunk:
        """A decode `chunk` with as much of `draft` as free blocks allow, its slots held: taken
        from free blocks only, never by preempting (a guess is worth no one's recomputation)."""
        request, taken = chunk.request, 0
        for token in draft:
            if not self.blocks.can_append(request.request_id):
                break
            self.copies += self.blocks.append_slot(request.request_id, token)
            taken += 1
        return Chunk(request, chunk.start, chunk.count + taken, tuple(draft[:taken])) if taken else chunk

    def _chunk(self, request: Request, prefill: int) -> int:
        """Prompt tokens a request in prefill may run now. Beside other requests, a chunk's
        attention grows with the tokens already computed, so deep in a long prompt the chunk
        shrinks to keep the step as short as a full chunk at `LONG_CONTEXT`."""
        if len(self.running) == 1:
            return prefill
        return min(prefill, max(QUERY_FLOOR, prefill * LONG_CONTEXT // max(LONG_CONTEXT, request.num_computed)))

    def _admit(self, budget: int, now: float) -> list[Chunk]:
        chunks = []
        free_seats = self.config.max_num_seqs - len(self.running)
        if self.waiting and self.config.max_wait_ms > 0 and len(self.waiting) < free_seats:
            oldest = min(r.arrival for r in self.waiting)
            if (now - oldest) * 1000 < self.config.max_wait_ms:
                return chunks
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0] if self.config.policy == "fifo" else min(self.waiting, key=Request.rank)
            # A cached token's logits are never computed: prompt log-probabilities need them all.
            use_cache = not request.wants_prompt_rows
            if not self.blocks.can_allocate(request.request_id, request.token_ids, use_cache=use_cache):
                break  # wait for blocks; admitting out of order would starve it
            self.waiting.remove(request)
            request.num_computed = self.blocks.allocate(request.request_id, request.token_ids, use_cache=use_cache)
            request.status = Status.RUNNING
            self.running.append(request)
            count = min(self._remaining(request), budget)
            chunks.append(Chunk(request, request.num_computed, count))
            budget -= count
        return chunks

    def _make_room(self, request: Request) -> list[Request]:
        """Give the request a slot for its newest token, preempting others if needed.

        Returns the requests preempted, the request itself last when it had to be.
        """
        victims = []
        while self.blocks.num_tokens(request.request_id) < len(request.token_ids):
            if self.blocks.can_append(request.request_id):
                token = request.token_ids[self.blocks.num_tokens(request.request_id)]
                self.copies += self.blocks.append_slot(request.request_id, token)
                continue
            victim = max(self.running, key=self._preemption_rank)
            self._preempt(victim)
            victims.append(victim)
            if victim is request:
                break
        return victims

    def _preemption_rank(self, request: Request) -> tuple:
        # FIFO preempts the newest; priority the least important, then the newest.
        if self.config.policy == "fifo":
            return (request.arrival,)
        return request.rank()

    def _preempt(self, request: Request) -> None:
        # Its queued copy-on-write copies go too, so that every copy lands in a block that a
        # chunk of the step uses. Kept, they would be wasted but harmless: copies run in order
        # before the step, so a freed block taken again in this step gets its new owner's copy
        # or writes after the stale one.
        held = set(self.blocks.block_table(request.request_id))
        self.copies = [(src, dst) for src, dst in self.copies if dst not in held]
        self.running.remove(request)
        self.blocks.free(request.request_id)
        request.num_computed = 0
        request.status = Status.WAITING
        self.waiting.insert(0, request)
        self.preemptions += 1

    def _remaining(self, request: Request) -> int:
        return len(request.token_ids) - request.num_computed

    def _release(self, request: Request, reason: str) -> None:
        if request.request_id in self.blocks:
            self.blocks.free(request.request_id)
        request.status = Status.FINISHED
        request.finish_reason = reason
