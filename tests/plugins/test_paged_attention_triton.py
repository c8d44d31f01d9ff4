"""The Triton paged-attention kernel against the NumPy reference, on CPU via Triton's interpreter.

TRITON_INTERPRET=1 is set before triton is first imported (and before the kernel is wrapped by
triton.jit), so the kernel runs on torch CPU tensors. On a GPU, scripts/gpu_check.py runs the
full grid (block sizes 1..256, head_dim 64/128, GQA 1..8, fp16/bf16/fp32) and times it.
Metadata outside the contract (as TensorRT times plugins on) must keep the kernel inside its
tensors: tensors here sit between NaN margins that any stray read would carry into the output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'llmc[gpu]' or 'llmc[test]')")
torch = pytest.importorskip("torch")

from llmc.errors import LlmcError
from llmc.plugins.paged_attention import paged_attention_reference
from llmc.plugins.paged_attention_triton import paged_attention_triton

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 (CPU tensors)")

TOLERANCE = {np.float32: 2e-5, np.float16: 4e-3}


def make_batch(rng, new_tokens, past_lens, *, heads=4, kv_heads=2, head_dim=64, block_size=16,
               dtype=np.float32, index_dtype=np.int32, spare_blocks=3):
    """A ragged batch whose sequences own shuffled, non-contiguous blocks of one pool."""
    seqs, tokens = len(new_tokens), sum(new_tokens)
    max_blocks = max(1, max(-(-p // block_size) for p in past_lens))
    num_blocks = seqs * max_blocks + spare_blocks
    pool = (num_blocks, kv_heads, block_size, head_dim)
    return dict(
        query=rng.standard_normal((tokens, heads, head_dim)).astype(dtype),
        key=rng.standard_normal((tokens, kv_heads, head_dim)).astype(dtype),
        value=rng.standard_normal((tokens, kv_heads, head_dim)).astype(dtype),
        key_cache=rng.standard_normal(pool).astype(dtype),
        value_cache=rng.standard_normal(pool).astype(dtype),
        block_tables=rng.permutation(num_blocks)[:seqs * max_blocks]
        .reshape(seqs, max_blocks).astype(index_dtype),
        context_lens=np.array(past_lens, index_dtype),
        query_start_loc=np.concatenate([[0], np.cumsum(new_tokens)]).astype(index_dtype),
    )


def run_triton(batch, scale=None):
    return paged_attention_triton(**{k: torch.from_numpy(v) for k, v in batch.items()},
                                  scale=scale).numpy()


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("new_tokens,past_lens", [
    ([5, 1, 1], [0, 7, 30]),          # a fresh prefill beside two decodes
    ([20, 1, 3], [33, 70, 0]),        # a prefill chunk over a long past, decode, short prefill
    ([1, 1], [64, 1]),                # decode only, past ending on and inside a block
])
def test_matches_reference(block_size, new_tokens, past_lens):
    batch = make_batch(np.random.default_rng(block_size), new_tokens, past_lens,
                       block_size=block_size)
    got = run_triton(batch)
    want = paged_attention_reference(**batch)
    np.testing.assert_allclose(got, want, atol=TOLERANCE[np.float32], rtol=0)


def test_fp16_int64_tables_and_custom_scale():
    batch = make_batch(np.random.default_rng(7), [3, 0, 2], [5, 4, 64], block_size=4,
                       dtype=np.float16, index_dtype=np.int64)
    got = run_triton(batch, scale=0.05)
    want = paged_attention_reference(**batch, scale=0.05)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                               atol=TOLERANCE[np.float16], rtol=0)


def test_grouped_heads_not_a_power_of_two():
    batch = make_batch(np.random.default_rng(3), [4, 1], [9, 17], heads=6, kv_heads=2,
                       block_size=8)
    np.testing.assert_allclose(run_triton(batch), paged_attention_reference(**batch),
                               atol=TOLERANCE[np.float32], rtol=0)


def test_rejects_unsupported_head_dim():
    batch = make_batch(np.random.default_rng(0), [1], [3], head_dim=32)
    with pytest.raises(LlmcError, match="head_dim 32"):
        run_triton(batch)


@pytest.mark.parametrize("window", [1, 5, 20])
def test_sliding_window_matches_reference(window):
    from paged_cases import build_case

    # A 40-token prefill (two query tiles) over a long past, a decode, a fresh prompt; table
    # entries behind each window are garbage, as after the runtime freed those blocks.
    inputs, _ = build_case(np.random.default_rng(window), [70, 33, 0], [40, 1, 7], 4, 2, 64, 8, window=window)
    got = paged_attention_triton(*(torch.from_numpy(np.ascontiguousarray(a)) for a in inputs), window=window).numpy()
    np.testing.assert_allclose(got, paged_attention_reference(*inputs, window=window),
                               atol=TOLERANCE[np.float32], rtol=0)


def test_softcap_and_window_match_reference():
    from paged_cases import build_case

    inputs, _ = build_case(np.random.default_rng(11), [37, 0], [20, 5], 4, 2, 64, 8, window=6)
    inputs = (inputs[0] * 4, *inputs[1:])  # large scores, so capping at 0.7 matters
    got = paged_attention_triton(*(torch.from_numpy(np.ascontiguousarray(a)) for a in inputs),
                                 window=6, softcap=0.7).numpy()
    np.testing.assert_allclose(got, paged_attention_reference(*inputs, window=6, softcap=0.7),
                               atol=TOLERANCE[np.float32], rtol=0)


def guarded(array, margin, fill):
    """`array` as a contiguous view into a buffer with `margin` elements of `fill` on each side: a
    kernel that reads outside the tensor reads `fill`, one that writes outside changes it."""
    flat = torch.from_numpy(np.full(array.size + 2 * margin, fill, array.dtype))
    flat[margin:margin + array.size] = torch.from_numpy(array.ravel())
    return flat, flat[margin:margin + array.size].view(array.shape)


@pytest.mark.parametrize("seed", [0, 1])
def test_made_up_metadata_stays_inside_every_tensor(seed):
    """TensorRT times the plugin on made-up inputs: scripts/gpu_check.py's check of that (which a
    GPU machine runs on the JIT and the AOT kernel) under the interpreter. Out-of-contract
    metadata, NaN around every input, a sentinel around the output; in a subprocess, because a
    stray read may crash it, and with a timeout, because a loop over a made-up length never ends."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--cpu-interpret", "--made-up-metadata", "40",
                           "--seed", str(seed)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, (done.stdout + done.stderr)[-2000:])
    assert "40 cases inside every tensor" in done.stdout


def test_valid_metadata_in_guarded_tensors_matches_reference():
    """The clamps change nothing within the contract, and nothing outside the tensors is read."""
    batch = make_batch(np.random.default_rng(5), [20, 1, 3], [33, 70, 0], block_size=16)
    margin = 4096
    inputs = {k: guarded(v, margin, float("nan") if v.dtype == np.float32 else -7)[1] for k, v in batch.items()}
    got = paged_attention_triton(**inputs).numpy()
    np.testing.assert_allclose(got, paged_attention_reference(**batch), atol=TOLERANCE[np.float32], rtol=0)


def test_pool_of_another_float_type_is_read_in_the_query_type():
    """--kv-cache-dtype: an fp16 pool under fp32 queries, read exactly (fp16 widens to fp32)."""
    batch = make_batch(np.random.default_rng(9), [4, 1], [9, 17], block_size=8)
    batch["key_cache"] = batch["key_cache"].astype(np.float16)
    batch["value_cache"] = batch["value_cache"].astype(np.float16)
    got = run_triton(batch)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, paged_attention_reference(**batch), atol=TOLERANCE[np.float32], rtol=0)
