"""Random paged-attention inputs for the plugin tests: a pool with each sequence's past scattered
over random blocks, and the same past laid out densely for the reference comparison."""

import numpy as np

from llmc.plugins.paged_attention import first_visible_block


def build_case(rng, past_lens, new_lens, heads, kv_heads, head_dim, block_size, spare_blocks=3, window=0):
    """Random pool with each sequence's past scattered into random blocks; also the dense K/V.

    With a window, table entries of blocks wholly before it are then made garbage (as after the
    block manager freed them): the op must not read them."""
    blocks_per_seq = [-(-p // block_size) for p in past_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = rng.permutation(num_blocks)
    key_cache = rng.standard_normal((num_blocks, kv_heads, block_size, head_dim)).astype(np.float32)
    value_cache = rng.standard_normal(key_cache.shape).astype(np.float32)
    width = max(blocks_per_seq + [1])
    # Entries past a sequence's last block are garbage on purpose: the op must ignore them.
    tables = rng.integers(-5, 10_000, (len(past_lens), width))
    dense_k, dense_v, used = [], [], 0
    for s, (past, count) in enumerate(zip(past_lens, blocks_per_seq)):
        tables[s, :count] = order[used:used + count]
        used += count
        slots = np.arange(past)
        blocks = tables[s, slots // block_size]
        dense_k.append(key_cache[blocks, :, slots % block_size])
        dense_v.append(value_cache[blocks, :, slots % block_size])
        tables[s, :first_visible_block(past, window, block_size)] = -1_000_000
    total = sum(new_lens)
    query = rng.standard_normal((total, heads, head_dim)).astype(np.float32)
    key = rng.standard_normal((total, kv_heads, head_dim)).astype(np.float32)
    value = rng.standard_normal((total, kv_heads, head_dim)).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(new_lens)])
    return (query, key, value, key_cache, value_cache, tables, np.array(past_lens), starts), (dense_k, dense_v)


class Stepper:
    """A backend and its KV cache, stepped as the engine steps them (runtime/backends/base.py), with
    the arrays a test packs by hand."""

    def __init__(self, backend, kv):
        self.backend, self.kv = backend, kv

    @classmethod
    def open(cls, engine, kv_pool_mb=None, **options):
        from llmc.runtime.backends.base import BackendOptions
        from llmc.runtime.backends.registry import open_backend

        return cls(*open_backend(engine, BackendOptions(**options), kv_pool_mb))

    def step(self, tokens, positions, batch, rows=None):
        """The logits of `rows` (default: each sequence's last token) of a step of packed tokens."""
        from llmc.runtime.step_plan import packed_plan

        rows = np.asarray(batch.query_start_loc)[1:] - 1 if rows is None else np.asarray(rows)
        return self.backend.run(packed_plan(self.backend.paths, np.asarray(tokens), np.asarray(positions), batch, rows))
