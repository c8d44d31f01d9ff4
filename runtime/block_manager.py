"""The block manager of the serving runtime: block ids, ref counts, content hashes, free lists.

No tensors: the manager decides which pool block holds each token slot of each sequence, and
tells the runtime which block copies to perform; the runtime moves the data.

Prefix caching. Only FULL blocks are cached and shared between requests. A full block's hash
chains over every token before it (sha256 of the previous block's hash and the block's tokens),
so equal blocks at different prefix positions never match. A full block becomes reusable by
other requests once the runtime reports its keys and values are in the pool
(`mark_computed`): the paged-attention op reads the pool and the runtime writes a step's new
keys and values only after the step, so a block still being filled must not be handed out.
`allocate` reuses the longest cached run of leading full blocks, but never the whole prompt: the
last prompt token is always recomputed to get its logits, and to keep the cached count
block-aligned the whole block holding it is recomputed (as vLLM does). So prefix sharing never
writes into a shared block and needs no copy.

Copy-on-write. Sequences forked with `fork` (parallel samples of one prompt) share all blocks,
including a partial last block. The first of them to append into a shared partial block gets a
fresh block and a (src, dst) copy for the runtime to perform before the step; full blocks are
never written again, so they are never copied.

Sliding windows. When every layer of the model attends only to its last `window` positions
(Mistral), a block whose slots all lie more than `window - 1` positions behind a sequence's next
token to compute is never read again: `mark_computed` releases it as the sequence grows, and its
block-table entry becomes None (the paged-attention op never reads entries behind the window).
When some layer attends to the whole past (Gemma-2/3's global layers, any Llama) no block can be
released early: the manager is built without a window.

Free-list order. Free blocks wait in two queues; `free_block_ids()` lists them in the order new
blocks are taken:
  1. blocks holding no cached content, first in first out: initially 0, 1, …, num_blocks-1;
     released blocks whose content is not cached join the back;
  2. cached blocks (ref count 0, content still registered), least recently freed first; one is
     taken only when queue 1 is empty, which evicts its content (counted in `evictions`).
A sequence's blocks are released last block first, so the head of its prefix is the most
recently freed and the last to be evicted (a cached block is useless without its predecessors).
A cache hit on a block of queue 2 takes it out of the queue.
"""

from __future__ import annotations

import hashlib
import operator
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Hashable, Sequence

from llmc.errors import LlmcError


@dataclass(frozen=True)
class BlockStats:
    """Counters of a block manager at one moment.

    Args:
        num_blocks: blocks in the pool.
        blocks_in_use: blocks held by at least one sequence.
        free_blocks: blocks that can be taken, cached ones included.
        cached_free_blocks: free blocks whose content is still registered (evictable).
        utilization: token slots in use ÷ slots of the blocks in use (0.0 when none is in use).
        prompt_tokens: prompt tokens looked up in the prefix cache by `allocate`.
        cached_prompt_tokens: prompt tokens served from the cache.
        prefix_hit_rate: cached_prompt_tokens ÷ prompt_tokens (0.0 before any lookup).
        evictions: cached blocks whose content was dropped to reuse their id.
        copies: copy-on-write block copies requested from the runtime.
    """

    num_blocks: int
    blocks_in_use: int
    free_blocks: int
    cached_free_blocks: int
    utilization: float
    prompt_tokens: int
    cached_prompt_tokens: int
    prefix_hit_rate: float
    evictions: int
    copies: int


@dataclass
class _Sequence:
    tokens: list[int]
    table: list[int | None]  # None: released behind the sliding window
    hashes: list[bytes]  # chained hash of each full block, in table order
    registered: int = 0  # leading full blocks already offered to the prefix cache
    computed: int = 0  # tokens whose keys and values the runtime reported written
    released: int = 0  # leading blocks released behind the sliding window


def _chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Hands out pool blocks to sequences, shares cached full blocks, counts what it does.

    Args:
        num_blocks: blocks in the KV pool (≥ 1).
        block_size: token slots per block (≥ 1).
        window: positions any layer reads behind (and including) a token, when every layer has a
            sliding window; blocks wholly behind it are released as sequences grow. None: keep
            every block until the sequence is freed.
    """

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise LlmcError(f"block manager: num_blocks must be an integer ≥ 1, "
                            f"got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise LlmcError(f"block manager: block_size must be an integer ≥ 1, "
                            f"got {block_size!r}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise LlmcError(f"block manager: window must be an integer ≥ 1 or None, got {window!r}")
        self.num_blocks, self.block_size, self.window = num_blocks, block_size, window
        self._ref = [0] * num_blocks
        self._fill = [0] * num_blocks  # token slots written (or about to be) in each block
        # Kept in step with _ref and _fill (only _incref/_decref/_set_fill change those), so
        # `stats` costs the same whatever the pool size.
        self._in_use = 0  # blocks with _ref > 0
        self._used_slots = 0  # sum of _fill over blocks with _ref > 0
        self._hash: list[bytes | None] = [None] * num_blocks  # set only while registered
        self._content: list[tuple[int, ...] | None] = [None] * num_blocks  # tokens, to verify hits
        self._by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._seqs: dict[Hashable, _Sequence] = {}
        self._prompt_tokens = self._cached_prompt_tokens = self._evictions = self._copies = 0

    # -- queries --------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be taken now, cached free blocks included."""
        return len(self._free) + len(self._cached_free)

    def free_block_ids(self) -> list[int]:
        """Free block ids in the order new blocks will be taken (see the module docstring)."""
        return [*self._free, *self._cached_free]

    def block_table(self, seq_id: Hashable) -> list[int | None]:
        """The pool block of each of the sequence's blocks, in order (a copy); None for blocks
        released behind the sliding window."""
        return list(self._seq(seq_id).table)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Token slots the sequence holds."""
        return len(self._seq(seq_id).tokens)

    def ref_count(self, block_id: int) -> int:
        """Number of block tables holding the block."""
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise LlmcError(f"block manager: no block {block_id!r} in a pool of {self.num_blocks}")
        return self._ref[block_id]

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def utilization(self) -> float:
        """Filled slots over the slots of the blocks in use (0 when none is)."""
        slots = self._in_use * self.block_size
        return self._used_slots / slots if slots else 0.0

    @property
    def stats(self) -> BlockStats:
        prompt, cached = self._prompt_tokens, self._cached_prompt_tokens
        return BlockStats(
            num_blocks=self.num_blocks, blocks_in_use=self._in_use, free_blocks=self.num_free_blocks,
            cached_free_blocks=len(self._cached_free), utilization=self.utilization,
            prompt_tokens=prompt, cached_prompt_tokens=cached,
            prefix_hit_rate=cached / prompt if prompt else 0.0,
            evictions=self._evictions, copies=self._copies)

    # -- prompts --------------------------------------------------------------------------------

    def can_allocate(self, seq_id: Hashable, token_ids: Sequence[int], *, use_cache: bool = True) -> bool:
        """Whether `allocate(seq_id, token_ids, use_cache=...)` would find enough free blocks now.

        Raises LlmcError when it never could (the prompt needs more blocks than the pool has) or
        when seq_id is already allocated.
        """
        tokens = self._check_prompt(seq_id, token_ids)
        hashes = self._hashes(tokens)
        needed = self._blocks_needed(tokens, hashes, self._lookup(tokens, hashes) if use_cache else 0)
        return needed <= self.num_free_blocks

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], *, use_cache: bool = True) -> int:
        """Give a new sequence the blocks for its prompt, reusing cached leading full blocks.

        Args:
            seq_id: any hashable id not allocated now.
            token_ids: the prompt (≥ 1 token).
            use_cache: False takes fresh blocks only and counts no prefix lookup: for a
                computation that needs every position's output (logits of a whole sequence).
        Returns:
            the number of leading prompt tokens whose keys and values are already in the pool
            (a multiple of block_size, less than the prompt length): prefill can skip them.
        """
        tokens = self._check_prompt(seq_id, token_ids)
        hashes = self._hashes(tokens)
        hits = self._lookup(tokens, hashes) if use_cache else 0
        needed = self._blocks_needed(tokens, hashes, hits)
        if needed > self.num_free_blocks:
            raise LlmcError(f"block manager: sequence {seq_id!r} needs {needed} free blocks, "
                            f"{self.num_free_blocks} are free; check can_allocate first")
        table = []
        for h in hashes[:hits]:  # take the hits first, so that no fresh block evicts one of them
            block = self._by_hash[h]
            if self._ref[block] == 0:
                del self._cached_free[block]
            self._incref(block)
            table.append(block)
        for _ in range(-(-len(tokens) // self.block_size) - hits):
            table.append(self._take_block())
        for i, block in enumerate(table):
            self._set_fill(block, min(self.block_size, len(tokens) - i * self.block_size))
        cached = hits * self.block_size
        self._seqs[seq_id] = _Sequence(tokens, table, hashes, registered=hits, computed=cached)
        if use_cache:
            self._prompt_tokens += len(tokens)
            self._cached_prompt_tokens += cached
        return cached

    # -- decoding -------------------------------------------------------------------------------

    def can_append(self, seq_id: Hashable) -> bool:
        """Whether `append_slot(seq_id, ...)` would find the free block it may need."""
        return not self._needs_block(self._seq(seq_id)) or self.num_free_blocks > 0

    def append_slot(self, seq_id: Hashable, token_id: int) -> list[tuple[int, int]]:
        """Grow a sequence by one token slot, for the token whose keys and values come next.

        Takes a new block when the last one is full; copies the last block first when it is a
        partial block shared with a forked sequence (copy-on-write).

        Returns:
            (src, dst) block copies the runtime must perform before writing the new slot.
        """
        seq = self._seq(seq_id)
        token = self._token(token_id, seq_id)
        if self._needs_block(seq) and not self.num_free_blocks:
            raise LlmcError(f"block manager: no free block to grow sequence {seq_id!r}; "
                            f"check can_append first")
        copies = []
        if len(seq.tokens) % self.block_size == 0:
            seq.table.append(self._take_block())
        elif self._ref[seq.table[-1]] > 1:
            src = seq.table[-1]
            dst = self._take_block()
            self._decref(src)  # still held by the sequences it was shared with
            self._set_fill(dst, self._fill[src])
            seq.table[-1] = dst
            copies.append((src, dst))
            self._copies += 1
        seq.tokens.append(token)
        self._set_fill(seq.table[-1], self._fill[seq.table[-1]] + 1)
        if len(seq.tokens) % self.block_size == 0:
            parent = seq.hashes[-1] if seq.hashes else b""
            seq.hashes.append(_chain_hash(parent, seq.tokens[-self.block_size:]))
        return copies

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Drop the sequence's slots from `num_tokens` on (speculative tokens the sampler did not
        keep), releasing the blocks left empty. Slots already marked computed stay."""
        seq = self._seq(seq_id)
        if not isinstance(num_tokens, int) or not seq.computed <= num_tokens <= len(seq.tokens):
            raise LlmcError(f"block manager: sequence {seq_id!r} holds {len(seq.tokens)} tokens, "
                            f"{seq.computed} computed; cannot keep {num_tokens!r}")
        size = self.block_size
        kept = -(-num_tokens // size)
        for block in reversed(seq.table[kept:]):
            self._release(block)
        del seq.table[kept:], seq.tokens[num_tokens:], seq.hashes[num_tokens // size:]
        if num_tokens % size:
            self._set_fill(seq.table[-1], num_tokens % size)

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """Record that the sequence's first num_tokens keys and values are now in the pool.

        Its full blocks among them become reusable by other requests' prompts. Call after each
        step that wrote the sequence's slots; a block is never offered before it is written.
        With a window, blocks that the next token's window no longer reaches are released.
        """
        seq = self._seq(seq_id)
        if not isinstance(num_tokens, int) or not 0 <= num_tokens <= len(seq.tokens):
            raise LlmcError(f"block manager: sequence {seq_id!r} holds {len(seq.tokens)} tokens, "
                            f"cannot mark {num_tokens!r} computed")
        seq.computed = max(seq.computed, num_tokens)
        size = self.block_size
        for i in range(seq.registered, seq.computed // size):
            block, h = seq.table[i], seq.hashes[i]
            if h not in self._by_hash and self._hash[block] is None:
                # First wins: a duplicate computed in parallel stays private and uncached.
                self._by_hash[h] = block
                self._hash[block] = h
                self._content[block] = tuple(seq.tokens[i * size:(i + 1) * size])
        seq.registered = max(seq.registered, seq.computed // size)
        if self.window is not None:
            # The next token, at position `computed`, reads positions computed - window + 1 on.
            behind = max(0, seq.computed - self.window + 1) // size
            for i in range(seq.released, behind):
                self._release(seq.table[i])
                seq.table[i] = None
            seq.released = max(seq.released, behind)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make child_id a sequence sharing every block of parent_id (e.g. parallel samples).

        Takes no block; the first append into a shared partial block copies it.
        """
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise LlmcError(f"block manager: sequence {child_id!r} is already allocated")
        for block in parent.table[parent.released:]:
            self._incref(block)
        self._seqs[child_id] = _Sequence(list(parent.tokens), list(parent.table), list(parent.hashes),
                                         parent.registered, parent.computed, parent.released)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks, last block first; cached ones stay until evicted."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        for block in reversed(seq.table[seq.released:]):
            self._release(block)

    def _release(self, block: int) -> None:
        """Drop one reference; a block no sequence holds joins its free queue."""
        self._decref(block)
        if self._ref[block]:
            return
        if self._hash[block] is None:
            self._free.append(block)
        else:
            self._cached_free[block] = None

    # -- internals ------------------------------------------------------------------------------

    def _seq(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise LlmcError(f"block manager: unknown sequence {seq_id!r}") from None

    def _token(self, token_id: object, seq_id: Hashable) -> int:
        try:
            return operator.index(token_id)
        except TypeError:
            raise LlmcError(f"block manager: sequence {seq_id!r}: token id {token_id!r} is not an "
                            f"integer") from None

    def _check_prompt(self, seq_id: Hashable, token_ids: Sequence[int]) -> list[int]:
        if seq_id in self._seqs:
            raise LlmcError(f"block manager: sequence {seq_id!r} is already allocated")
        tokens = [self._token(t, seq_id) for t in token_ids]
        if not tokens:
            raise LlmcError(f"block manager: sequence {seq_id!r} has an empty prompt")
        blocks = -(-len(tokens) // self.block_size)
        if blocks > self.num_blocks:
            raise LlmcError(f"block manager: KV pool too small: a prompt of {len(tokens)} tokens "
                            f"needs {blocks} blocks of {self.block_size}, the pool has "
                            f"{self.num_blocks}")
        return tokens

    def _hashes(self, tokens: list[int]) -> list[bytes]:
        hashes, parent, size = [], b"", self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            parent = _chain_hash(parent, tokens[start:start + size])
            hashes.append(parent)
        return hashes

    def _lookup(self, tokens: list[int], hashes: list[bytes]) -> int:
        """Leading full blocks found in the cache, leaving the last prompt token to compute."""
        size = self.block_size
        hits = 0
        for i, h in enumerate(hashes[:(len(tokens) - 1) // size]):
            block = self._by_hash.get(h)
            if block is None or self._content[block] != tuple(tokens[i * size:(i + 1) * size]):
                break
            hits += 1
        return hits

    def _blocks_needed(self, tokens: list[int], hashes: list[bytes], hits: int) -> int:
        """Free blocks an allocation takes: fresh ones plus hits now waiting in the free queue."""
        fresh = -(-len(tokens) // self.block_size) - hits
        return fresh + sum(1 for h in hashes[:hits] if self._ref[self._by_hash[h]] == 0)

    def _needs_block(self, seq: _Sequence) -> bool:
        return len(seq.tokens) % self.block_size == 0 or self._ref[seq.table[-1]] > 1

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached_free.popitem(last=False)
            del self._by_hash[self._hash[block]]
            self._hash[block] = self._content[block] = None
            self._evictions += 1
        self._set_fill(block, 0)
        self._incref(block)
        return block

    def _incref(self, block: int) -> None:
        if self._ref[block] == 0:
            self._in_use += 1
            self._used_slots += self._fill[block]
        self._ref[block] += 1

    def _decref(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._in_use -= 1
            self._used_slots -= self._fill[block]

    def _set_fill(self, block: int, fill: int) -> None:
        if self._ref[block]:
            self._used_slots += fill - self._fill[block]
        self._fill[block] = fill
