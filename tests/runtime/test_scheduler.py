"""The scheduler alone (no model): random request mixes run to completion under the budget,
FIFO never starves, every block comes back, preemption keeps requests whole."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from llmc.errors import LlmcError
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Request, Scheduler, SchedulerConfig, Status


def limits(**given) -> SchedulerConfig:
    """A config as an engine of 16 seats and a 512-token budget fills what `given` leaves unset."""
    return SchedulerConfig(**given).filled(16, 512, lone_prompt_uses_budget=True)


def simulate(requests, config, num_blocks, block_size, max_steps=10_000):
    """Drive the scheduler like the engine does, with a fake model emitting token 7."""
    blocks = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(config, blocks)
    for r in requests:
        scheduler.add(r)
    finished_order, steps = [], 0
    while scheduler.has_unfinished():
        steps += 1
        assert steps < max_steps, "no progress"
        queued = len(scheduler.waiting)
        chunks = scheduler.schedule(now=float(steps))
        check_step(scheduler, chunks, queued)
        finished_order += run_step(scheduler, chunks)
    assert blocks.num_free_blocks == num_blocks  # nothing leaked
    return scheduler, finished_order


def check_step(scheduler, chunks, queued=0):
    """What a step's chunks must satisfy for the engine to run them; `queued`: the requests
    waiting before the step was scheduled (a queue of several may start under the whole budget)."""
    config, blocks = scheduler.config, scheduler.blocks
    assert sum(c.count for c in chunks) <= config.max_num_batched_tokens
    # A one-token chunk ending its sequence may be a decode; every other chunk is prompt.
    prompt = sum(c.count for c in chunks if c.count > 1 or c.start + 1 < len(c.request.token_ids))
    alone = config.lone_prompt_uses_budget and len(scheduler.running) == 1 and not scheduler.waiting
    uncapped = alone or queued > 1
    assert prompt <= (config.max_num_batched_tokens if uncapped else config.max_prefill_tokens or config.max_num_batched_tokens)
    assert len(chunks) <= len(scheduler.running) <= config.max_num_seqs
    assert len({id(c.request) for c in chunks}) == len(chunks)
    for chunk in chunks:
        request = chunk.request
        assert request in scheduler.running and request.request_id in blocks
        assert chunk.start == request.num_computed and chunk.count > 0
        assert blocks.num_tokens(request.request_id) >= chunk.start + chunk.count
        assert len(blocks.block_table(request.request_id)) * blocks.block_size >= chunk.start + chunk.count
    for block in range(blocks.num_blocks):
        assert blocks.ref_count(block) >= 0


def run_step(scheduler, chunks):
    """The engine's execute and postprocess, with a fake model emitting token 7; returns the ids
    of the requests that finished."""
    finished = []
    for chunk in chunks:
        request = chunk.request
        request.num_computed += chunk.count
        scheduler.blocks.mark_computed(request.request_id, request.num_computed)
        if request.num_computed == len(request.token_ids):
            request.add_output(7)
            if len(request.output_ids) == request.params.max_new_tokens:
                scheduler.finish(request, "length")
                finished.append(request.request_id)
    return finished


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12)), min_size=1, max_size=12),
       budget=st.integers(8, 64), seats=st.integers(1, 6), block_size=st.sampled_from([1, 4, 16]),
       spare=st.integers(0, 8))
def test_every_request_finishes_within_budget_and_frees_its_blocks(lens, budget, seats, block_size, spare):
    longest = max(p + n for p, n in lens)
    num_blocks = -(-longest // block_size) + spare  # room for the largest request, little more
    requests = [Request(f"r{i}", list(range(1, p + 1)), SamplingParams(max_new_tokens=n, ignore_eos=True),
                        arrival=float(i)) for i, (p, n) in enumerate(lens)]
    config = limits(max_num_seqs=seats, max_num_batched_tokens=budget)
    scheduler, _ = simulate(requests, config, num_blocks, block_size)
    assert all(r.status is Status.FINISHED and len(r.output_ids) == r.params.max_new_tokens for r in requests)


def test_fifo_admits_in_arrival_order_and_priority_by_rank():
    def make(policy):
        requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=2), priority=p, arrival=float(i))
                    for i, p in enumerate([2, 0, 1])]
        _, order = simulate(requests, limits(max_num_seqs=1, policy=policy), 16, 4)
        return order

    assert make("fifo") == ["r0", "r1", "r2"]
    assert make("priority") == ["r1", "r2", "r0"]


def test_decodes_run_before_a_long_prefill_is_done():
    long_prompt = Request("long", list(range(1, 301)), SamplingParams(max_new_tokens=1))
    short = Request("short", [1, 2], SamplingParams(max_new_tokens=5), arrival=-1.0)
    blocks = BlockManager(64, 16)
    scheduler = Scheduler(limits(max_num_batched_tokens=64), blocks)
    scheduler.add(short)
    scheduler.add(long_prompt)
    first = scheduler.schedule(now=0.0)
    assert [(c.request.request_id, c.count) for c in first] == [("short", 2), ("long", 62)]
    for c in first:
        c.request.num_computed += c.count
        blocks.mark_computed(c.request.request_id, c.request.num_computed)
    short.add_output(9)
    second = scheduler.schedule(now=1.0)
    # The short request decodes first; the long prompt takes the rest as its next chunk.
    assert [(c.request.request_id, c.count) for c in second] == [("short", 1), ("long", 63)]


def test_preemption_returns_the_newest_request_to_the_queue_whole():
    # Each needs 3 blocks of 4 at its longest (4 prompt + 8 output); the pool has 4.
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_new_tokens=8), arrival=0.0)
    b = Request("b", [5, 6, 7, 8], SamplingParams(max_new_tokens=8), arrival=1.0)
    scheduler, order = simulate([a, b], limits(max_num_seqs=2), num_blocks=4, block_size=4)
    assert scheduler.preemptions > 0
    assert order == ["a", "b"] and len(a.output_ids) == len(b.output_ids) == 8


def test_a_request_preempted_later_in_a_step_leaves_it():
    # Priority: "lo" is admitted first, so it decodes first in each step; "hi" comes after it.
    # Pool: 3 blocks of 4. At the third step lo's token fits its block, but hi's ninth token needs
    # a new block: hi preempts lo, whose decode was already packed in that step.
    blocks = BlockManager(3, 4)
    scheduler = Scheduler(limits(policy="priority"), blocks)
    lo = Request("lo", [1, 2], SamplingParams(max_new_tokens=4), priority=5, arrival=0.0)
    hi = Request("hi", list(range(11, 19)), SamplingParams(max_new_tokens=4), priority=0, arrival=1.0)
    scheduler.add(lo)
    run_step(scheduler, scheduler.schedule(now=0.0))
    scheduler.add(hi)
    second = scheduler.schedule(now=1.0)
    assert [(c.request.request_id, c.start, c.count) for c in second] == [("lo", 2, 1), ("hi", 0, 8)]
    run_step(scheduler, second)
    third = scheduler.schedule(now=2.0)
    assert scheduler.preemptions == 1 and scheduler.waiting == [lo] and lo.output_ids == [7, 7]
    assert [(c.request.request_id, c.start, c.count) for c in third] == [("hi", 8, 1)]
    check_step(scheduler, third)
    run_step(scheduler, third)
    for step in range(3, 50):
        if not scheduler.has_unfinished():
            break
        chunks = scheduler.schedule(now=float(step))
        check_step(scheduler, chunks)
        run_step(scheduler, chunks)
    assert lo.output_ids == hi.output_ids == [7] * 4 and blocks.num_free_blocks == 3


def test_max_wait_holds_admission_until_the_oldest_has_waited():
    blocks = BlockManager(16, 4)
    scheduler = Scheduler(limits(max_num_seqs=4, max_wait_ms=50), blocks)
    scheduler.add(Request("r", [1, 2], SamplingParams(), arrival=10.0))
    assert scheduler.schedule(now=10.01) == []
    assert [c.request.request_id for c in scheduler.schedule(now=10.06)] == ["r"]


def test_abort_frees_blocks():
    blocks = BlockManager(8, 4)
    scheduler = Scheduler(limits(), blocks)
    scheduler.add(Request("r", list(range(1, 10)), SamplingParams()))
    scheduler.schedule(now=0.0)
    assert blocks.num_free_blocks < 8
    assert scheduler.abort("r").finish_reason == "abort"
    assert blocks.num_free_blocks == 8 and not scheduler.has_unfinished()
    assert scheduler.abort("r") is None


@pytest.mark.parametrize("field,value,message", [
    ("max_num_seqs", 0, "max_num_seqs must be ≥ 1"), ("max_num_batched_tokens", 0, "must be ≥ 1"),
    ("policy", "lifo", "policy must be one of fifo, priority"), ("max_wait_ms", -1, "max_wait_ms must be ≥ 0"),
])
def test_bad_config(field, value, message):
    with pytest.raises(LlmcError, match=message):
        SchedulerConfig(**{field: value})


def test_a_config_leaves_the_engines_limits_to_the_engine():
    given = SchedulerConfig(max_num_seqs=4)
    filled = given.filled(64, 2048, lone_prompt_uses_budget=False)
    assert (filled.max_num_seqs, filled.max_num_batched_tokens, filled.lone_prompt_uses_budget) == (4, 2048, False)
    assert SchedulerConfig(lone_prompt_uses_budget=True).filled(64, 512, False).lone_prompt_uses_budget is True
    with pytest.raises(ValueError, match="max_num_batched_tokens, lone_prompt_uses_budget unset"):
        Scheduler(given, BlockManager(4, 4))


def test_requests_keep_their_random_streams():
    a = Request("a", [1], SamplingParams(seed=3))
    b = Request("b", [1], SamplingParams(seed=3))
    assert np.array_equal(a.rng.integers(0, 100, 5), b.rng.integers(0, 100, 5))


def test_new_requests_are_admitted_before_a_running_prefill_continues():
    blocks = BlockManager(64, 16)
    scheduler = Scheduler(limits(max_num_batched_tokens=64), blocks)
    long_prompt = Request("long", list(range(1, 301)), SamplingParams(max_new_tokens=1), arrival=0.0)
    scheduler.add(long_prompt)
    first = scheduler.schedule(now=0.0)
    assert [(c.request.request_id, c.count) for c in first] == [("long", 64)]
    long_prompt.num_computed += 64
    blocks.mark_computed("long", 64)
    scheduler.add(Request("short", [1, 2, 3], SamplingParams(), arrival=1.0))
    second = scheduler.schedule(now=1.0)
    # The newcomer's whole prompt runs at once; the long prompt sits this step out...
    assert [(c.request.request_id, c.count) for c in second] == [("short", 3)]
    _advance(scheduler, blocks, second)
    scheduler.add(Request("other", [4, 5], SamplingParams(), arrival=2.0))
    # ...but never two in a row: with another newcomer, it continues with what is left.
    third = scheduler.schedule(now=2.0)
    assert [(c.request.request_id, c.count) for c in third] == [("other", 2), ("long", 62)]


def test_a_burst_of_newcomers_takes_the_budget_and_a_lone_one_the_cap():
    blocks = BlockManager(128, 16)
    scheduler = Scheduler(limits(max_num_batched_tokens=512, max_prefill_tokens=100), blocks)
    scheduler.add(Request("a", list(range(1, 301)), SamplingParams(), arrival=0.0))
    scheduler.add(Request("b", list(range(1, 51)), SamplingParams(), arrival=1.0))
    first = scheduler.schedule(now=1.0)  # a queue: both start at once, not 100 tokens a step
    assert [(c.request.request_id, c.count) for c in first] == [("a", 300), ("b", 50)]
    _advance(scheduler, blocks, first)
    for chunk in first:
        chunk.request.add_output(7)
    scheduler.add(Request("c", list(range(2001, 3001)), SamplingParams(), arrival=2.0))
    for now in (2.0, 3.0):  # alone in the queue, then in prefill: the cap keeps the decodes' steps short
        chunks = scheduler.schedule(now=now)
        assert [(c.request.request_id, c.count) for c in chunks] == [("a", 1), ("b", 1), ("c", 100)]
        _advance(scheduler, blocks, chunks)
        for chunk in chunks[:2]:
            chunk.request.add_output(7)
    with pytest.raises(LlmcError, match="max_prefill_tokens must be ≥ 1"):
        SchedulerConfig(max_prefill_tokens=0)


def _advance(scheduler, blocks, chunks):
    for chunk in chunks:
        chunk.request.num_computed += chunk.count
        blocks.mark_computed(chunk.request.request_id, chunk.request.num_computed)


def test_a_lone_prompt_runs_in_budget_sized_chunks_until_another_request_comes():
    blocks = BlockManager(256, 16)
    scheduler = Scheduler(limits(max_num_batched_tokens=512, max_prefill_tokens=128), blocks)
    scheduler.add(Request("long", list(range(1, 2001)), SamplingParams(max_new_tokens=1), arrival=0.0))
    for _ in range(2):
        chunks = scheduler.schedule(now=0.0)
        assert [(c.request.request_id, c.count) for c in chunks] == [("long", 512)]
        _advance(scheduler, blocks, chunks)
    scheduler.add(Request("short", list(range(5001, 5041)), SamplingParams(max_new_tokens=4), arrival=1.0))
    chunks = scheduler.schedule(now=1.0)  # the cap again: the newcomer first, the long prompt sits out
    assert [(c.request.request_id, c.count) for c in chunks] == [("short", 40)]
    _advance(scheduler, blocks, chunks)
    chunks = scheduler.schedule(now=2.0)
    assert sum(c.count for c in chunks if c.request.request_id == "long") <= 128


def test_deep_in_a_long_prompt_its_chunk_shrinks_while_others_run_and_slivers_wait():
    blocks = BlockManager(256, 16)
    config = limits(max_num_batched_tokens=512, max_prefill_tokens=128, lone_prompt_uses_budget=False)
    scheduler = Scheduler(config, blocks)
    long_prompt = Request("long", list(range(1, 2001)), SamplingParams(max_new_tokens=1), arrival=0.0)
    scheduler.add(long_prompt)
    for _ in range(8):  # alone, it runs full chunks: 1,024 tokens computed
        chunks = scheduler.schedule(now=0.0)
        assert [(c.request.request_id, c.count) for c in chunks] == [("long", 128)]
        _advance(scheduler, blocks, chunks)
    short = Request("short", list(range(5001, 5121)), SamplingParams(max_new_tokens=4), arrival=1.0)
    scheduler.add(short)
    # The newcomer takes 120 of the 128; an 8-token sliver of the long prompt waits.
    chunks = scheduler.schedule(now=1.0)
    assert [(c.request.request_id, c.count) for c in chunks] == [("short", 120)]
    _advance(scheduler, blocks, chunks)
    short.add_output(7)  # its first token, sampled
    # Beside the short one's decode, the long prompt's chunk is 128 · 512 / 1,024 tokens.
    chunks = scheduler.schedule(now=2.0)
    assert [(c.request.request_id, c.count) for c in chunks] == [("short", 1), ("long", 64)]


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arrive, are aborted and run under either policy, with admission held for a
    simulated clock and a pool so small that preemption is common."""

    @initialize(data=st.data(), policy=st.sampled_from(["fifo", "priority"]),
                max_wait_ms=st.sampled_from([0.0, 3.0]), seats=st.integers(1, 4), budget=st.integers(1, 24),
                prefill=st.sampled_from([None, 4, 16]), num_blocks=st.integers(2, 8),
                block_size=st.sampled_from([1, 2, 4]), arrivals=st.integers(1, 6))
    def setup(self, data, policy, max_wait_ms, seats, budget, prefill, num_blocks, block_size, arrivals):
        config = limits(max_num_seqs=seats, max_num_batched_tokens=budget, policy=policy,
                        max_wait_ms=max_wait_ms, max_prefill_tokens=prefill)
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(config, self.blocks)
        self.now, self.requests, self.outputs = 0.0, [], {}
        for _ in range(arrivals):
            self.add(data, data.draw(st.integers(0, 2)), data.draw(st.booleans()))

    @rule(data=st.data(), priority=st.integers(0, 2), shared=st.booleans())
    def add(self, data, priority, shared):
        # A request's slots (its prompt and all its tokens but the last) fit the pool: alone, it
        # finishes. Prompts are short or near the pool's size; shared ones start alike, so that
        # prefix-cache hits take part.
        capacity = self.blocks.num_blocks * self.blocks.block_size
        prompt = data.draw(st.integers(1, max(1, capacity // 3)) | st.integers(max(1, capacity - 3), capacity))
        new = data.draw(st.integers(1, min(8, capacity - prompt + 1)))
        first = 1 if shared else 100 * (len(self.requests) + 1)
        request = Request(f"r{len(self.requests)}", list(range(first, first + prompt)),
                          SamplingParams(max_new_tokens=new), priority=priority, arrival=self.now)
        self.requests.append(request)
        self.scheduler.add(request)

    @rule(index=st.integers(0, 99))
    def abort(self, index):
        pending = self.scheduler.waiting + self.scheduler.running
        if not pending:
            return
        request = pending[index % len(pending)]
        assert self.scheduler.abort(request.request_id) is request
        assert request.status is Status.FINISHED and request.request_id not in self.blocks

    @rule(ms=st.sampled_from([0, 1, 2, 5]), steps=st.integers(1, 3))
    def step(self, ms, steps=1):
        for _ in range(steps):
            self.now += ms / 1000
            queued = len(self.scheduler.waiting)
            chunks = self.scheduler.schedule(now=self.now)
            check_step(self.scheduler, chunks, queued)
            run_step(self.scheduler, chunks)
            self.consistent()

    @invariant()
    def consistent(self):
        scheduler, blocks = self.scheduler, self.blocks
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        for request in scheduler.running:
            assert request.status is Status.RUNNING
            assert blocks.num_tokens(request.request_id) >= request.num_computed
        for request in scheduler.waiting:  # preempted ones included: they hold no block
            assert request.status is Status.WAITING and request.request_id not in blocks
        stats = blocks.stats
        assert all(blocks.ref_count(b) >= 0 for b in range(blocks.num_blocks))
        assert stats.blocks_in_use + stats.free_blocks == blocks.num_blocks
        if not scheduler.running:
            assert blocks.num_free_blocks == blocks.num_blocks
        for request in self.requests:  # output is never lost, preempted or not
            seen = self.outputs.get(request, [])
            assert request.output_ids[:len(seen)] == seen
            self.outputs[request] = list(request.output_ids)

    def teardown(self):
        # Without new arrivals every request finishes within a bound: none starves, under either
        # policy, and every block comes back.
        if not hasattr(self, "scheduler"):
            return
        for _ in range(1000):
            if not self.scheduler.has_unfinished():
                break
            self.step(1)
        assert not self.scheduler.has_unfinished() and self.blocks.num_free_blocks == self.blocks.num_blocks
        for request in self.requests:
            assert request.finish_reason == "abort" or len(request.output_ids) == request.params.max_new_tokens


SchedulerMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
test_scheduler_machine = SchedulerMachine.TestCase
