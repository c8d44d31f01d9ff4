"""The CPU implementation of paged attention (in-place kernel + dense form) equals the NumPy
reference, whichever path each sequence takes."""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cases import build_case

from llmc.plugins.paged_attention import PagedBatch, paged_attention_reference
from llmc.plugins.paged_attention_cpu import DENSE_MIN_TOKENS, QUERY_TILE, SERIAL_MAX_KEYS, CpuPagedAttention

OPS = {}


def op(heads, kv_heads, head_dim, block_size, kv_dtype="float32"):
    key = (heads, kv_heads, head_dim, block_size, kv_dtype)
    if key not in OPS:
        OPS[key] = CpuPagedAttention(heads, kv_heads, head_dim, block_size, threads=2, kv_dtype=kv_dtype)
    return OPS[key]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       # New-token counts straddle the kernel's tile and the dense threshold.
       lens=st.lists(st.tuples(st.integers(0, 70), st.sampled_from([0, 1, 2, 15, 17, 63, 64, 80])),
                     min_size=1, max_size=5),
       # Block sizes: one token, the default, and one past every context here; the float16 pool
       # at the default size (how the kernels read a block does not depend on the pool's type).
       # Each pair is a compile of the kernels (12-20 s on first use; Numba caches it after).
       pool=st.sampled_from([(1, "float32"), (16, "float32"), (256, "float32"), (16, "float16")]),
       ratio=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([64, 128]), scale=st.sampled_from([None, 0.05]),
       window=st.sampled_from([0, 0, 1, 5, 16, 40]), softcap=st.sampled_from([0.0, 0.0, 0.5, 50.0]),
       serial=st.booleans())
def test_cpu_op_equals_reference(seed, lens, pool, ratio, head_dim, scale, window, softcap, serial):
    block_size, kv_dtype = pool
    rng = np.random.default_rng(seed)
    heads = 2 * ratio
    inputs, _ = build_case(rng, [p for p, _ in lens], [n for _, n in lens], heads, 2, head_dim, block_size,
                           window=window)
    # A float16 pool holds keys and values rounded to float16, and the decoder rounds the step's
    # new ones the same way: the reference gets the rounded values, widened back to float32.
    inputs = (inputs[0], *(a.astype(kv_dtype) for a in inputs[1:5]), *inputs[5:])
    attention = op(heads, 2, head_dim, block_size, kv_dtype)
    # Either kernel, whatever the step's size would pick: the serial one and the parallel one.
    layout = dataclasses.replace(attention.layout(PagedBatch(*inputs[5:]), windows=(0, window)), serial=serial)
    got = attention(*inputs[:5], layout, scale, window, softcap)
    widened = (inputs[0], *(a.astype(np.float32) for a in inputs[1:5]), *inputs[5:])
    want = paged_attention_reference(*widened, scale=scale, window=window, softcap=softcap)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_layout_sends_decodes_to_the_kernel_and_chunks_to_the_dense_form():
    new = [1, DENSE_MIN_TOKENS - 1, DENSE_MIN_TOKENS]
    starts = np.concatenate([[0], np.cumsum(new)])
    batch = PagedBatch(np.array([[3, 0], [5, 6], [1, 2]]), np.array([20, 4, 0]), starts)
    layout = CpuPagedAttention(4, 2, 64, 16).layout(batch)
    # (sequence, first token, end token, kv head): one item per kv head per tile of new tokens.
    assert QUERY_TILE >= DENSE_MIN_TOKENS - 1
    assert layout.items.tolist() == [[0, 0, 1, 0], [0, 0, 1, 1], [1, 1, 16, 0], [1, 1, 16, 1]]
    [(rows, feeds)] = layout.dense[0]
    assert (rows.start, rows.stop) == (16, 16 + DENSE_MIN_TOKENS)
    assert feeds["paged_block_ids"].tolist() == []  # sequence 2 has no past yet


def test_layout_runs_small_kernel_steps_on_one_thread():
    def layout(context_lens):
        batch = len(context_lens)
        return CpuPagedAttention(4, 2, 64, 16).layout(
            PagedBatch(np.zeros((batch, 1), np.int64), np.array(context_lens), np.arange(batch + 1)))

    # Keys the kernel reads, counted per kv head (2 here), with each decode's own new key.
    assert layout([SERIAL_MAX_KEYS // 2 - 1]).serial
    assert not layout([SERIAL_MAX_KEYS // 2]).serial
    assert not layout([SERIAL_MAX_KEYS // 4] * 2).serial


def test_dense_form_gathers_only_the_blocks_a_window_sees():
    # 40 cached tokens in blocks of 16, 20 new tokens, window 10: the first new token (position
    # 40) sees 31…40, so block 0 (0…15) is never read; blocks 1 and 2 are.
    batch = PagedBatch(np.array([[7, 3, 5]]), np.array([40]), np.array([0, 20]))
    layout = CpuPagedAttention(4, 2, 64, 16).layout(batch, windows=(0, 10))
    assert layout.dense[0][0][1]["paged_block_ids"].tolist() == [7, 3, 5]
    windowed = layout.dense[10][0][1]
    assert windowed["paged_block_ids"].tolist() == [3, 5]
    visible = windowed["paged_mask"][0, 0] == 0  # [20 tokens, 32 cached slots + 20 new]
    assert visible.sum(axis=1).tolist() == [10] * 20
    assert np.flatnonzero(visible[0]).tolist() == list(range(15, 24)) + [32]  # positions 31…39, itself
