"""The block manager: exact block ids, ref counts, free-list and eviction order, and invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmc.errors import LlmcError
from llmc.runtime.block_manager import BlockManager


def refs(manager):
    return [manager.ref_count(b) for b in range(manager.num_blocks)]


def _recount(manager):
    """blocks_in_use and the token slots they hold, counted from scratch over the whole pool."""
    in_use = [b for b in range(manager.num_blocks) if manager.ref_count(b)]
    return len(in_use), sum(manager._fill[b] for b in in_use)


def test_fresh_pool_hands_out_ids_in_order():
    manager = BlockManager(num_blocks=6, block_size=4)
    assert manager.free_block_ids() == [0, 1, 2, 3, 4, 5]
    assert manager.allocate("a", range(10)) == 0
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.allocate("b", range(100, 104)) == 0
    assert manager.block_table("b") == [3]
    assert refs(manager) == [1, 1, 1, 1, 0, 0]
    assert manager.free_block_ids() == [4, 5]
    assert manager.num_free_blocks == 2


def test_uncached_blocks_return_to_the_back_last_block_first():
    manager = BlockManager(num_blocks=6, block_size=4)
    manager.allocate("a", range(10))
    manager.free("a")  # never marked computed: nothing cached
    assert manager.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert refs(manager) == [0] * 6
    manager.allocate("b", range(20, 25))
    assert manager.block_table("b") == [3, 4]


def test_two_requests_share_a_two_block_prefix():
    manager = BlockManager(num_blocks=8, block_size=4)
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    assert manager.allocate("a", prefix + [1]) == 0
    assert manager.block_table("a") == [0, 1, 2]
    manager.mark_computed("a", 9)
    assert manager.allocate("b", prefix + [2, 3]) == 8
    assert manager.block_table("b") == [0, 1, 3]
    assert refs(manager)[:4] == [2, 2, 1, 1]
    manager.free("a")
    assert refs(manager)[:4] == [1, 1, 0, 1]
    assert manager.free_block_ids() == [4, 5, 6, 7, 2]
    stats = manager.stats
    assert (stats.prompt_tokens, stats.cached_prompt_tokens) == (19, 8)
    assert stats.prefix_hit_rate == pytest.approx(8 / 19)


def test_blocks_are_not_shared_before_they_are_computed():
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.allocate("a", range(9))
    assert manager.allocate("b", range(9)) == 0
    assert manager.block_table("b") == [3, 4, 5]
    manager.mark_computed("a", 4)  # only the first block is written so far
    assert manager.allocate("c", range(9)) == 4
    assert manager.block_table("c") == [0, 6, 7]


def test_whole_prompt_hit_recomputes_the_last_block():
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.allocate("a", range(8))
    manager.mark_computed("a", 8)
    assert manager.allocate("b", range(8)) == 4  # the last token needs its logits
    assert manager.block_table("b") == [0, 2]
    assert manager.append_slot("b", 99) == []  # no write ever lands in a shared block


def test_hashes_chain_over_the_prefix():
    manager = BlockManager(num_blocks=12, block_size=4)
    manager.allocate("a", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    manager.mark_computed("a", 9)
    # block [2, 2, 2, 2] is cached, but only after [1, 1, 1, 1]
    assert manager.allocate("b", [2, 2, 2, 2, 0]) == 0
    assert manager.allocate("c", [3, 3, 3, 3, 2, 2, 2, 2, 0]) == 0
    assert manager.allocate("d", [1, 1, 1, 1, 2, 2, 2, 2, 7]) == 8
    assert manager.block_table("d") == [0, 1, 8]


def test_eviction_takes_the_least_recently_freed_cached_block():
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate("a", [1, 2, 3])
    manager.mark_computed("a", 3)
    manager.allocate("b", [5, 6, 7])
    manager.mark_computed("b", 3)
    assert (manager.block_table("a"), manager.block_table("b")) == ([0, 1], [2, 3])
    manager.free("a")
    manager.free("b")
    # plain free first (partial blocks 1, 3), then cached blocks 0, 2 least recently freed first
    assert manager.free_block_ids() == [1, 3, 0, 2]
    assert manager.stats.cached_free_blocks == 2
    manager.allocate("c", [8] * 6)
    assert manager.block_table("c") == [1, 3, 0]
    assert manager.stats.evictions == 1
    assert manager.free_block_ids() == [2]
    manager.free("c")
    assert manager.free_block_ids() == [0, 3, 1, 2]
    assert manager.allocate("d", [5, 6, 9]) == 2  # block 2 survived
    assert manager.block_table("d") == [2, 0]
    assert manager.allocate("e", [1, 2, 9]) == 0  # block 0's content was evicted
    assert manager.block_table("e") == [3, 1]


def test_a_cache_hit_refreshes_the_block():
    manager = BlockManager(num_blocks=5, block_size=2)
    for seq, prompt in (("a", [1, 2, 0]), ("b", [3, 4, 0])):
        manager.allocate(seq, prompt)
        manager.mark_computed(seq, 3)
        manager.free(seq)
    assert manager.free_block_ids() == [4, 1, 3, 0, 2]
    manager.allocate("c", [1, 2, 5])  # hits 0, takes 4
    manager.free("c")
    assert manager.free_block_ids() == [1, 3, 4, 2, 0]  # 0 is now the most recently freed
    manager.allocate("d", [9] * 8)  # takes 1, 3, 4, then evicts 2
    assert manager.block_table("d") == [1, 3, 4, 2]
    manager.free("d")
    assert manager.free_block_ids() == [2, 4, 3, 1, 0]
    assert manager.allocate("e", [1, 2, 5]) == 2  # 0 survived
    assert manager.allocate("f", [3, 4, 5]) == 0  # 2 did not
    assert (manager.block_table("e"), manager.block_table("f")) == ([0, 2], [4, 3])


def test_decode_fills_blocks_that_become_cached():
    manager = BlockManager(num_blocks=4, block_size=4)
    manager.allocate("a", [1, 2, 3])
    assert manager.append_slot("a", 4) == []
    assert manager.block_table("a") == [0]
    assert manager.append_slot("a", 5) == []
    assert manager.block_table("a") == [0, 1]
    manager.mark_computed("a", 5)
    assert manager.allocate("b", [1, 2, 3, 4, 6]) == 4
    assert manager.block_table("b") == [0, 2]


def test_fork_copies_a_shared_partial_block_on_write():
    manager = BlockManager(num_blocks=6, block_size=4)
    manager.allocate("a", range(6))
    manager.fork("a", "b")
    assert manager.block_table("b") == [0, 1]
    assert refs(manager)[:2] == [2, 2]
    assert manager.append_slot("b", 7) == [(1, 2)]
    assert manager.block_table("b") == [0, 2]
    assert refs(manager)[:3] == [2, 1, 1]
    assert manager.append_slot("a", 8) == []  # block 1 is a's alone now
    assert manager.block_table("a") == [0, 1]
    assert manager.stats.copies == 1


def test_fork_at_a_block_boundary_needs_no_copy():
    manager = BlockManager(num_blocks=4, block_size=4)
    manager.allocate("a", range(4))
    manager.fork("a", "b")
    assert manager.append_slot("a", 4) == []
    assert manager.append_slot("b", 4) == []
    assert (manager.block_table("a"), manager.block_table("b")) == ([0, 1], [0, 2])
    assert manager.ref_count(0) == 2


def test_utilization_counts_each_shared_block_once():
    manager = BlockManager(num_blocks=8, block_size=4)
    assert manager.stats.utilization == 0.0
    manager.allocate("a", range(5))
    assert manager.stats.utilization == pytest.approx(5 / 8)
    manager.mark_computed("a", 5)
    manager.allocate("b", [0, 1, 2, 3, 9, 9])  # shares block 0
    assert manager.stats.blocks_in_use == 3
    assert manager.stats.utilization == pytest.approx((4 + 1 + 2) / 12)
    manager.free("a")
    manager.free("b")
    assert manager.stats.utilization == 0.0
    assert manager.stats.free_blocks == 8


def test_can_allocate_counts_cached_hits_that_sit_in_the_free_queue():
    manager = BlockManager(num_blocks=3, block_size=2)
    manager.allocate("a", [1, 2, 3])
    manager.mark_computed("a", 3)
    manager.allocate("x", [7])
    assert manager.free_block_ids() == []
    assert not manager.can_allocate("b", [1, 2, 3])
    manager.free("a")  # block 0 cached, block 1 plain free
    assert manager.can_allocate("b", [1, 2, 3])  # hit on 0 and one fresh block
    assert not manager.can_allocate("b", [4, 5, 6, 7, 8])
    assert manager.allocate("b", [1, 2, 3]) == 2
    assert manager.block_table("b") == [0, 1]
    assert manager.stats.evictions == 0


def test_can_append():
    manager = BlockManager(num_blocks=2, block_size=2)
    manager.allocate("a", [1])
    manager.allocate("b", [1, 2])
    assert manager.can_append("a")
    assert not manager.can_append("b")  # its block is full and the pool is empty
    with pytest.raises(LlmcError, match="no free block to grow sequence 'b'"):
        manager.append_slot("b", 3)
    assert manager.block_table("b") == [1]
    assert manager.num_tokens("b") == 2


def test_truncate_gives_back_the_blocks_of_guesses_not_kept():
    manager = BlockManager(num_blocks=6, block_size=4)
    manager.allocate("a", [1, 2, 3])
    manager.mark_computed("a", 3)
    for token in (4, 5, 6, 7, 8, 9):  # guesses: the first block full, a second, a third begun
        manager.append_slot("a", token)
    assert manager.num_tokens("a") == 9 and manager.num_free_blocks == 3
    manager.truncate("a", 5)  # one guess kept
    assert manager.num_tokens("a") == 5 and len(manager.block_table("a")) == 2
    assert manager.num_free_blocks == 4 and manager.utilization == 5 / 8
    with pytest.raises(LlmcError, match="sequence 'a' holds 5 tokens, 3 computed; cannot keep 2"):
        manager.truncate("a", 2)  # computed slots stay
    with pytest.raises(LlmcError, match="cannot keep 6"):
        manager.truncate("a", 6)
    for token in (16, 17, 18):  # what came instead of the guesses fills the second block
        manager.append_slot("a", token)
    manager.mark_computed("a", 8)
    assert manager.allocate("b", [1, 2, 3, 4, 5, 16, 17, 18, 99]) == 8  # cached under its own tokens


def test_bad_inputs():
    with pytest.raises(LlmcError, match="num_blocks must be an integer ≥ 1"):
        BlockManager(0, 4)
    with pytest.raises(LlmcError, match="block_size must be an integer ≥ 1"):
        BlockManager(4, 0)
    manager = BlockManager(num_blocks=2, block_size=4)
    manager.allocate("a", [1, 2])
    with pytest.raises(LlmcError, match="'a' is already allocated"):
        manager.allocate("a", [1, 2])
    with pytest.raises(LlmcError, match="'a' is already allocated"):
        manager.can_allocate("a", [1, 2])
    with pytest.raises(LlmcError, match="KV pool too small: a prompt of 9 tokens needs 3 blocks"):
        manager.can_allocate("b", range(9))
    with pytest.raises(LlmcError, match="KV pool too small"):
        manager.allocate("b", range(9))
    with pytest.raises(LlmcError, match="needs 2 free blocks, 1 are free"):
        manager.allocate("b", range(8))
    with pytest.raises(LlmcError, match="empty prompt"):
        manager.allocate("b", [])
    with pytest.raises(LlmcError, match="token id 1.5 is not an integer"):
        manager.allocate("b", [1.5])
    with pytest.raises(LlmcError, match="token id"):
        manager.append_slot("a", "x")
    for call in (manager.free, manager.block_table, manager.can_append, manager.num_tokens,
                 lambda s: manager.append_slot(s, 1), lambda s: manager.fork(s, "c")):
        with pytest.raises(LlmcError, match="unknown sequence 'zz'"):
            call("zz")
    with pytest.raises(LlmcError, match="unknown sequence"):
        manager.free(["unhashable"])
    with pytest.raises(LlmcError, match="'a' is already allocated"):
        manager.fork("a", "a")
    with pytest.raises(LlmcError, match="holds 2 tokens, cannot mark 3 computed"):
        manager.mark_computed("a", 3)
    with pytest.raises(LlmcError, match="no block 2"):
        manager.ref_count(2)
    manager.free("a")
    with pytest.raises(LlmcError, match="unknown sequence 'a'"):
        manager.free("a")  # a double free is refused, not counted twice
    assert manager.free_block_ids() == [1, 0]


# -- property: random request mixes -------------------------------------------------------------

BLOCK_SIZE = 2
# A small vocabulary, so that equal blocks recur at different prefix positions.
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 1, 2], [3, 4, 1, 2, 3]]
TOKENS = st.integers(0, 3)


class RandomRequests(RuleBasedStateMachine):
    """Allocates, appends, forks, steps and frees at random against a simulated pool.

    The simulated pool records, per slot, the prefix whose key/value the runtime wrote there;
    as in the runtime, a step writes the slots scheduled since the last one, then marks them
    computed. Every sequence must read back exactly its own prefixes: sharing, eviction and
    copy-on-write never hand a sequence a slot someone else wrote, or that nobody wrote yet.
    """

    def __init__(self):
        super().__init__()
        self.manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE)
        self.pool: dict[tuple[int, int], tuple[int, ...]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.written: dict[int, int] = {}  # leading slots of each sequence already in the pool
        self.next_id = 0

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(TOKENS, min_size=1, max_size=5))
    def allocate(self, prefix, suffix):
        seq, prompt = self.next_id, prefix + suffix
        self.next_id += 1
        free_before = self.manager.num_free_blocks
        if not self.manager.can_allocate(seq, prompt):
            with pytest.raises(LlmcError):
                self.manager.allocate(seq, prompt)
            assert self.manager.num_free_blocks == free_before
            return
        cached = self.manager.allocate(seq, prompt)
        assert cached % BLOCK_SIZE == 0 and 0 <= cached < len(prompt)
        self.tokens[seq], self.written[seq] = list(prompt), cached
        self._check_reads(seq)  # the cached part must already hold this prompt

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=TOKENS)
    def append(self, data, token):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if not self.manager.can_append(seq):
            return
        self._append_slot(seq, token)
        self.tokens[seq].append(token)

    def _append_slot(self, seq, token):
        """A slot for `token`, with the copies it asks for performed on the simulated pool."""
        for src, dst in self.manager.append_slot(seq, token):
            for offset in range(BLOCK_SIZE):
                if (src, offset) in self.pool:
                    self.pool[dst, offset] = self.pool[src, offset]

    @rule()
    def step(self):
        for seq, tokens in self.tokens.items():
            table = self.manager.block_table(seq)
            for p in range(self.written[seq], len(tokens)):
                self.pool[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = tuple(tokens[: p + 1])
            self.written[seq] = len(tokens)
            self.manager.mark_computed(seq, len(tokens))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), draft=st.lists(TOKENS, min_size=1, max_size=6))
    def speculate(self, data, draft):
        """A step with guesses after a sequence's tokens (slots held for them, their keys and
        values written), then only the guesses the sampler kept stay."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        guessed = []
        for token in draft:
            if not self.manager.can_append(seq):
                break
            self._append_slot(seq, token)
            guessed.append(token)
        tokens, table = self.tokens[seq] + guessed, self.manager.block_table(seq)
        for p in range(self.written[seq], len(tokens)):
            self.pool[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = tuple(tokens[: p + 1])
        kept = data.draw(st.integers(0, len(guessed)))
        self.manager.truncate(seq, len(self.tokens[seq]) + kept)
        self.tokens[seq] += guessed[:kept]
        self.written[seq] = len(self.tokens[seq])
        self.manager.mark_computed(seq, len(self.tokens[seq]))
        assert self.manager.num_tokens(seq) == len(self.tokens[seq])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.manager.fork(parent, child)
        self.tokens[child], self.written[child] = list(self.tokens[parent]), self.written[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq)
        del self.tokens[seq], self.written[seq]

    def _check_reads(self, seq):
        tokens, table = self.tokens[seq], self.manager.block_table(seq)
        for p in range(self.written[seq]):
            assert self.pool.get((table[p // BLOCK_SIZE], p % BLOCK_SIZE)) == tuple(tokens[: p + 1])

    @invariant()
    def every_sequence_reads_its_own_prefix(self):
        for seq in self.tokens:
            self._check_reads(seq)

    @invariant()
    def ref_counts_match_tables_and_free_list_is_exact(self):
        holders = [0] * self.manager.num_blocks
        for seq in self.tokens:
            table = self.manager.block_table(seq)
            assert len(table) == -(-len(self.tokens[seq]) // BLOCK_SIZE)
            for block in table:
                if block is not None:  # released behind a sliding window
                    holders[block] += 1
        assert refs(self.manager) == holders
        free = self.manager.free_block_ids()
        assert len(free) == len(set(free)) == self.manager.num_free_blocks
        assert sorted(free) == [b for b, n in enumerate(holders) if n == 0]

    @invariant()
    def counters_stay_in_range(self):
        stats = self.manager.stats
        assert 0.0 <= stats.utilization <= 1.0
        assert 0.0 <= stats.prefix_hit_rate <= 1.0
        assert stats.blocks_in_use + stats.free_blocks == stats.num_blocks

    @invariant()
    def incremental_counters_match_a_recount(self):
        # stats reads counters kept up to date by every operation instead of walking the pool.
        in_use, slots = _recount(self.manager)
        assert (self.manager._in_use, self.manager._used_slots) == (in_use, slots)
        stats = self.manager.stats
        assert stats.blocks_in_use == in_use
        assert stats.utilization == (slots / (in_use * BLOCK_SIZE) if in_use else 0.0)

    def teardown(self):
        for seq in list(self.tokens):
            self.manager.free(seq)
        assert sorted(self.manager.free_block_ids()) == list(range(self.manager.num_blocks))
        assert refs(self.manager) == [0] * self.manager.num_blocks
        assert _recount(self.manager) == (0, 0) == (self.manager._in_use, self.manager._used_slots)


RandomRequests.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_random_requests = RandomRequests.TestCase


def test_blocks_behind_the_window_are_released_as_the_sequence_grows():
    manager = BlockManager(num_blocks=6, block_size=4, window=5)
    manager.allocate("a", range(10))
    assert manager.block_table("a") == [0, 1, 2]
    manager.mark_computed("a", 10)  # the next token (position 10) reads 6…10: block 0 (0…3) is behind
    assert manager.block_table("a") == [None, 1, 2]
    assert refs(manager) == [0, 1, 1, 0, 0, 0]
    assert manager.free_block_ids() == [3, 4, 5, 0]  # registered (full, computed): evictable cache
    manager.append_slot("a", 10)
    manager.mark_computed("a", 11)  # reads 7…11: block 1 (4…7) still needed
    assert manager.block_table("a") == [None, 1, 2]
    manager.append_slot("a", 11)
    manager.mark_computed("a", 12)  # reads 8…12
    assert manager.block_table("a") == [None, None, 2]
    manager.append_slot("a", 12)  # slot 12 starts a new block
    assert manager.block_table("a") == [None, None, 2, 3]
    assert refs(manager) == [0, 0, 1, 1, 0, 0]
    assert manager.free_block_ids() == [4, 5, 0, 1]
    manager.free("a")  # only the blocks it still holds, last first: no double free
    assert manager.free_block_ids() == [4, 5, 3, 0, 1, 2]
    assert refs(manager) == [0] * 6


def test_released_blocks_stay_cached_for_other_prompts():
    manager = BlockManager(num_blocks=6, block_size=4, window=2)
    manager.allocate("a", range(10))
    manager.mark_computed("a", 10)  # reads 9…10: blocks 0 and 1 are behind
    assert manager.block_table("a") == [None, None, 2]
    assert manager.free_block_ids() == [3, 4, 5, 0, 1]
    assert manager.stats.cached_free_blocks == 2
    assert manager.allocate("b", range(9)) == 8  # a prefix hit on both released blocks
    assert manager.block_table("b") == [0, 1, 3]
    assert refs(manager) == [1, 1, 1, 1, 0, 0]


def test_forked_sequences_share_only_the_blocks_they_still_hold():
    manager = BlockManager(num_blocks=6, block_size=2, window=2)
    manager.allocate("a", range(5))
    manager.mark_computed("a", 5)  # reads 4…5: blocks 0 (0, 1) and 1 (2, 3) are behind
    manager.fork("a", "b")
    assert manager.block_table("b") == [None, None, 2]
    assert refs(manager) == [0, 0, 2, 0, 0, 0]
    manager.free("a")
    manager.free("b")
    assert sorted(manager.free_block_ids()) == list(range(6)) and refs(manager) == [0] * 6


def test_window_must_be_positive():
    with pytest.raises(LlmcError, match="window must be an integer ≥ 1 or None, got 0"):
        BlockManager(num_blocks=4, block_size=4, window=0)


class WindowedRandomRequests(RandomRequests):
    """The same random traffic with every layer windowed: blocks are released behind the window
    as sequences grow, and every sequence still reads back its own prefixes in its window."""

    WINDOW = 3

    def __init__(self):
        super().__init__()
        self.manager = BlockManager(num_blocks=10, block_size=BLOCK_SIZE, window=self.WINDOW)

    @rule()
    def step(self):
        super().step()
        for seq, tokens in self.tokens.items():
            behind = max(0, len(tokens) - self.WINDOW + 1) // BLOCK_SIZE
            table = self.manager.block_table(seq)
            assert table[:behind] == [None] * behind and None not in table[behind:]

    def _check_reads(self, seq):
        tokens, table = self.tokens[seq], self.manager.block_table(seq)
        # The next token reads positions written - WINDOW + 1 on; those must be its own.
        for p in range(max(0, self.written[seq] - self.WINDOW + 1), self.written[seq]):
            assert self.pool.get((table[p // BLOCK_SIZE], p % BLOCK_SIZE)) == tuple(tokens[: p + 1])


WindowedRandomRequests.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_windowed_random_requests = WindowedRandomRequests.TestCase
