"""llmc models against transformers (the independent reference) on real HF checkpoint folders.

For each family, single-file and sharded: a prefill (batch 2 x 7), a decode step (1 token)
and a chunk (3 tokens) fed with our own presents as past, and the same on a left-padded
batch. Logits and presents must match transformers' within 1e-4 (fp32).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hf_checkpoints import ALL_FAMILIES, VARIANTS, hf_model
from llmc.models import load_checkpoint

ATOL = 1e-4
KV = list[tuple[torch.Tensor, torch.Tensor]]


def _hf_step(model, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache):
    """One transformers forward; the cache argument was renamed from past_key_values to cache in v5."""
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_arg: cache})
    return out.logits, out.past_key_values


def _hf_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def _empty_past(model, batch: int) -> KV:
    shape = (batch, model.num_kv_heads, 0, model.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]


def _positions(mask: torch.Tensor, new: int) -> torch.Tensor:
    """Position ids of the last `new` tokens as HF generate makes them: cumsum(mask) - 1, at least 0."""
    return (mask.cumsum(-1) - 1).clamp(min=0)[:, -new:]


def _compare_presents(ours: KV, cache, model, mask: torch.Tensor) -> None:
    """Our presents have the full shape and equal HF's cache at real (unpadded) positions."""
    batch, total = mask.shape
    for layer, (key, value) in enumerate(ours):
        assert key.shape == value.shape == (batch, model.num_kv_heads, total, model.head_dim)
        hf_key, hf_value = _hf_kv(cache, layer)
        # A sliding-window HF cache may keep only the most recent keys; compare those.
        kept = hf_key.shape[2]
        real = mask[:, -kept:].bool()
        for b in range(batch):
            torch.testing.assert_close(key[b, :, -kept:][:, real[b]], hf_key[b][:, real[b]], atol=ATOL, rtol=0)
            torch.testing.assert_close(value[b, :, -kept:][:, real[b]], hf_value[b][:, real[b]], atol=ATOL, rtol=0)


def _run_and_compare(folder: Path, prefix_mask: torch.Tensor) -> None:
    """Prefill with `prefix_mask`, then decode 1 and 3 tokens; compare every step with HF."""
    loaded = load_checkpoint(folder)
    ours, hf = loaded.model, hf_model(folder)
    generator = torch.Generator().manual_seed(1)
    batch = prefix_mask.shape[0]
    mask = prefix_mask
    past, cache = _empty_past(ours, batch), None
    for step, new in enumerate((prefix_mask.shape[1], 1, 3)):
        if step > 0:  # later tokens are all real
            mask = torch.cat((mask, torch.ones(batch, new, dtype=torch.long)), dim=1)
        ids = torch.randint(0, ours.vocab_size, (batch, new), generator=generator)
        pos = _positions(mask, new)
        with torch.no_grad():
            logits, past = ours(ids, mask, pos, past)
        hf_logits, cache = _hf_step(hf, ids, mask, pos, cache)
        assert logits.shape == (batch, new, ours.vocab_size) and logits.dtype == torch.float32
        real = mask[:, -new:].bool()
        torch.testing.assert_close(logits[real], hf_logits[real], atol=ATOL, rtol=0)
        _compare_presents(past, cache, ours, mask)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_prefill_and_decode_match_transformers(hf_checkpoint: Callable[..., Path], family: str, sharded: bool) -> None:
    _run_and_compare(hf_checkpoint(family, sharded), torch.ones(2, 7, dtype=torch.long))


@pytest.mark.parametrize("family", ALL_FAMILIES + VARIANTS)
def test_left_padded_batch_matches_transformers(hf_checkpoint: Callable[..., Path], family: str) -> None:
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0  # row 0: 3 pad tokens on the left
    _run_and_compare(hf_checkpoint(family), mask)


def test_loaded_model_shape_properties(hf_checkpoint: Callable[..., Path]) -> None:
    model = load_checkpoint(hf_checkpoint("mistral")).model
    assert (model.family, model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim) == (
        "mistral", 2, 4, 2, 32,
    )
    assert (model.vocab_size, model.max_positions, model.args.sliding_window) == (258, 128, 4)
    assert not model.training
    gpt2 = load_checkpoint(hf_checkpoint("gpt2")).model
    assert (gpt2.family, gpt2.num_kv_heads, gpt2.head_dim) == ("gpt2", 4, 16)
    assert gpt2.lm_head.weight is gpt2.wte.weight


def test_llama3_rotary_frequencies_match_transformers(hf_checkpoint: Callable[..., Path]) -> None:
    folder = hf_checkpoint("llama")
    ours = load_checkpoint(folder).model.model.rotary_emb.inv_freq
    theirs = hf_model(folder).model.rotary_emb.inv_freq
    torch.testing.assert_close(ours, theirs, atol=0, rtol=1e-6)
    # The scaling must actually have changed something, or this test proves nothing.
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(ours, plain)
