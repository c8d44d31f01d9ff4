"""The onnxruntime lowering of paged attention equals the NumPy reference."""

import numpy as np
import onnxruntime as ort
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cases import build_case

from llmc.plugins.paged_attention import PagedBatch, paged_attention_reference, plan_step
from llmc.plugins.paged_attention_onnx import standalone_model

SESSIONS = {}


def session(heads, kv_heads, head_dim, block_size):
    key = (heads, kv_heads, head_dim, block_size)
    if key not in SESSIONS:
        model = standalone_model(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                 block_size=block_size)
        SESSIONS[key] = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return SESSIONS[key]


def run_lowered(inputs, heads, kv_heads, head_dim, block_size):
    query, key, value, key_cache, value_cache, tables, past, starts = inputs
    plan = plan_step(PagedBatch(tables, past, starts), block_size)
    feeds = {"query": query, "key": key, "value": value, "key_cache": key_cache,
             "value_cache": value_cache, **plan.feeds()}
    return session(heads, kv_heads, head_dim, block_size).run(None, feeds)[0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       lens=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=5),
       ratio=st.sampled_from([1, 2, 4]), block_size=st.sampled_from([1, 4, 16, 256]),
       head_dim=st.sampled_from([64, 128]))
def test_lowering_equals_reference(seed, lens, ratio, block_size, head_dim):
    rng = np.random.default_rng(seed)
    heads = 2 * ratio
    inputs, _ = build_case(rng, [p for p, _ in lens], [n for _, n in lens], heads, 2, head_dim, block_size)
    got = run_lowered(inputs, heads, 2, head_dim, block_size)
    np.testing.assert_allclose(got, paged_attention_reference(*inputs), atol=2e-5, rtol=1e-4)


def test_plan_for_a_mixed_step():
    batch = PagedBatch(block_tables=np.array([[7, 2, 0], [4, 0, 0]]), context_lens=np.array([5, 0]),
                       query_start_loc=np.array([0, 1, 4]))
    plan = plan_step(batch, block_size=4)
    assert plan.block_ids.tolist() == [7, 2]  # only the blocks the step reads, unpadded
    visible = plan.mask[0, 0] == 0
    assert visible.shape == (4, 8 + 4)
    # Sequence 0's token sees its 5 cached slots and itself; sequence 1 is causal over 3 tokens.
    assert visible[0].tolist() == [True] * 5 + [False] * 3 + [True, False, False, False]
    assert visible[1].tolist() == [False] * 8 + [False, True, False, False]
    assert visible[3].tolist() == [False] * 8 + [False, True, True, True]
