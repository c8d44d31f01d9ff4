"""The paged-attention reference against plain dense causal attention, on random ragged batches
with random block tables; and every bad input it must refuse."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_cases import build_case

from llmc.errors import LlmcError
from llmc.plugins.paged_attention import BLOCK_SIZES, paged_attention_reference


def dense_attention(q, k, v, past, window=0):
    """torch SDPA over one sequence: q [new, H, D], k/v [past + new, KV, D], causal with offset;
    with a window W, query p sees keys p - W + 1 … p."""
    groups = q.shape[1] // k.shape[1]
    qt = torch.from_numpy(q).double().transpose(0, 1)
    kt = torch.from_numpy(k).double().repeat_interleave(groups, 1).transpose(0, 1)
    vt = torch.from_numpy(v).double().repeat_interleave(groups, 1).transpose(0, 1)
    new, total = q.shape[0], k.shape[0]
    distance = past + torch.arange(new)[:, None] - torch.arange(total)[None, :]
    mask = (distance >= 0) & ((distance < window) if window else True)
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return out.transpose(0, 1).numpy()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 9)), min_size=1, max_size=5),
       ratio=st.sampled_from([1, 2, 4]), block_size=st.sampled_from(BLOCK_SIZES),
       head_dim=st.sampled_from([64, 128]), window=st.sampled_from([0, 1, 3, 16, 33]))
def test_reference_equals_dense_attention(seed, lens, ratio, block_size, head_dim, window):
    rng = np.random.default_rng(seed)
    past_lens, new_lens = [p for p, _ in lens], [n for _, n in lens]
    inputs, (dense_k, dense_v) = build_case(rng, past_lens, new_lens, 2 * ratio, 2, head_dim, block_size,
                                            window=window)
    query, key, value, *_, starts = inputs
    got = paged_attention_reference(*inputs, window=window)
    assert got.shape == query.shape and got.dtype == np.float32
    for s, past in enumerate(past_lens):
        begin, end = starts[s], starts[s + 1]
        if begin == end:
            continue
        want = dense_attention(query[begin:end], np.concatenate([dense_k[s], key[begin:end]]),
                               np.concatenate([dense_v[s], value[begin:end]]), past, window)
        np.testing.assert_allclose(got[begin:end], want, atol=1e-5, rtol=1e-5)


def test_decode_tokens_and_prefill_chunks_mix_in_one_call():
    rng = np.random.default_rng(1)
    inputs, _ = build_case(rng, past_lens=[0, 17, 5, 64], new_lens=[6, 1, 3, 1], heads=8, kv_heads=2,
                           head_dim=64, block_size=16)
    whole = paged_attention_reference(*inputs)
    # Running each sequence alone gives the same rows: sequences never see each other.
    query, key, value, kc, vc, tables, past, starts = inputs
    for s in range(4):
        rows = slice(starts[s], starts[s + 1])
        alone = paged_attention_reference(query[rows], key[rows], value[rows], kc, vc, tables[s:s + 1],
                                          past[s:s + 1], np.array([0, starts[s + 1] - starts[s]]))
        np.testing.assert_array_equal(whole[rows], alone)


def test_window_limits_each_token_to_its_last_keys():
    """A window of 1 leaves each token only itself: the output is its own value, whatever the past."""
    rng = np.random.default_rng(3)
    inputs, _ = build_case(rng, past_lens=[9, 0], new_lens=[3, 2], heads=4, kv_heads=2, head_dim=64,
                           block_size=4, window=1)
    out = paged_attention_reference(*inputs, window=1)
    np.testing.assert_allclose(out, np.repeat(inputs[2], 2, axis=1), atol=1e-6)


def test_stale_table_entries_before_the_window_are_read_without_a_window():
    inputs, _ = build_case(np.random.default_rng(4), [9], [1], 2, 2, 64, 4, window=2)
    with pytest.raises(LlmcError, match="sequence 0 points at block -1000000 outside the pool"):
        paged_attention_reference(*inputs)  # full attention reads every past block


def test_softcap_bounds_scores_before_the_mask():
    """Soft-capped scores equal plain attention whose scores were capped first: with a key
    scaled up, capping changes the output, and capping with a huge cap does not."""
    rng = np.random.default_rng(5)
    inputs, (dense_k, dense_v) = build_case(rng, [6], [3], 2, 2, 64, 4)
    query, key, value, *_ = inputs
    plain = paged_attention_reference(*inputs)
    np.testing.assert_allclose(paged_attention_reference(*inputs, softcap=1e6), plain, atol=1e-6)
    capped = paged_attention_reference(*inputs, softcap=0.5)
    k = np.concatenate([dense_k[0], key]).astype(np.float64)
    v = np.concatenate([dense_v[0], value]).astype(np.float64)
    scores = np.einsum("qhd,khd->hqk", query.astype(np.float64), k) * 64 ** -0.5
    scores = 0.5 * np.tanh(scores / 0.5)
    scores = np.where(np.arange(9)[None, None, :] <= 6 + np.arange(3)[None, :, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(capped, np.einsum("hqk,khd->qhd", probs, v), atol=1e-6)
    assert np.abs(capped - plain).max() > 1e-2


@pytest.fixture
def case():
    return build_case(np.random.default_rng(2), [5, 9], [2, 1], 4, 2, 64, 4)[0]


def replace(inputs, index, value):
    return tuple(value if i == index else x for i, x in enumerate(inputs))


@pytest.mark.parametrize("index,make,message", [
    (5, lambda t: np.where(t == t[1, 0], 999, t), "sequence 1 points at block 999 outside the pool"),
    (5, lambda t: t[:, :1], "sequence 0 has 5 cached tokens but its block table holds only 1 blocks"),
    (6, lambda c: np.array([5, -1]), "negative context length"),
    (7, lambda s: np.array([0, 3, 2]), "query_start_loc must rise from 0 to 3"),
    (3, lambda k: np.zeros((4, 2, 3, 64), np.float32), "block size 3 is not supported"),
    (1, lambda k: k[:, :1].repeat(3, 1), "4 query heads is not a multiple of 3 kv heads"),
])
def test_bad_inputs_are_named(case, index, make, message):
    inputs = replace(case, index, make(case[index]))
    if index == 3:
        inputs = replace(inputs, 4, inputs[3])
    if index == 1:
        inputs = replace(inputs, 2, inputs[1])
    with pytest.raises(LlmcError, match=message):
        paged_attention_reference(*inputs)
