"""Built-in models, argument validation and the forward contract's mask semantics."""

from __future__ import annotations

import pytest
import torch

from llmc.errors import LlmcError
from llmc.models import BUILTIN_MODELS, load_model
from llmc.models.gpt2 import GPT2Args
from llmc.models.decoder import DecoderArgs as LlamaArgs


def _past(model, batch: int, length: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (batch, model.num_kv_heads, length, model.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]


def test_builtin_weights_are_deterministic() -> None:
    first = load_model("tiny-llama").model.state_dict()
    second = load_model("tiny-llama").model.state_dict()
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    weight = first["model.layers.0.self_attn.q_proj.weight"]
    assert 0.015 < weight.std().item() < 0.025  # normal(0, 0.02), not the default init
    assert torch.equal(first["model.norm.weight"], torch.ones(256))


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_forward_contract(name: str) -> None:
    loaded = load_model(name)
    model = loaded.model
    assert loaded.name == name and loaded.tokenizer.vocab_size == model.vocab_size == 258
    assert model.family in ("llama", "gpt2") and not model.training
    ids = torch.tensor([loaded.tokenizer.encode("hello"), loaded.tokenizer.encode("world")])
    batch, seq = ids.shape
    mask = torch.ones(batch, seq, dtype=torch.long)
    pos = torch.arange(seq).expand(batch, seq)
    with torch.no_grad():
        logits, presents = model(ids, mask, pos, _past(model, batch))
        # Splitting the sequence into prefill + chunk must give the same logits as one pass.
        head, head_past = model(ids[:, :4], mask[:, :4], pos[:, :4], _past(model, batch))
        tail, _ = model(ids[:, 4:], mask, pos[:, 4:], head_past)
    assert logits.shape == (batch, seq, model.vocab_size) and logits.dtype == torch.float32
    assert len(presents) == model.num_layers
    assert presents[0][0].shape == (batch, model.num_kv_heads, seq, model.head_dim)
    torch.testing.assert_close(torch.cat((head, tail), dim=1), logits, atol=1e-5, rtol=0)


def test_fully_padded_row_gives_no_nan() -> None:
    model = load_model("tiny-llama").model
    ids = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.tensor([[0, 0, 0], [1, 1, 1]])
    with torch.no_grad():
        logits, _ = model(ids, mask, torch.zeros(2, 3, dtype=torch.long), _past(model, 2))
    assert torch.isfinite(logits).all()


def test_past_with_wrong_layer_count() -> None:
    model = load_model("tiny-gpt2").model
    ids = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(LlmcError, match="past_key_values has 1 layers, the model has 4"):
        model(ids, torch.ones(1, 1, dtype=torch.long), ids, _past(model, 1)[:1])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_kv_heads": 3}, "num_heads=4 is not divisible by num_kv_heads=3"),
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope scaling type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
        ({"sliding_window": 0}, "sliding_window must be a positive int"),
    ],
)
def test_llama_args_validation(changes: dict, message: str) -> None:
    base = dict(vocab_size=10, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=4,
                num_kv_heads=2, max_position_embeddings=8)
    with pytest.raises(LlmcError, match=message):
        LlamaArgs(**{**base, **changes})


def test_gpt2_args_validation() -> None:
    with pytest.raises(LlmcError, match="hidden_size=10 is not divisible by num_heads=4"):
        GPT2Args(vocab_size=10, hidden_size=10, num_layers=1, num_heads=4, max_position_embeddings=8)
    with pytest.raises(LlmcError, match="activation 'relu'"):
        GPT2Args(vocab_size=10, hidden_size=8, num_layers=1, num_heads=4, max_position_embeddings=8, activation="relu")


def test_qwen2_sliding_window_config() -> None:
    cfg = dict(model_type="qwen2", vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8, sliding_window=4)
    assert LlamaArgs.from_hf_config({**cfg, "use_sliding_window": False}).sliding_window is None
    assert LlamaArgs.from_hf_config({**cfg, "use_sliding_window": True, "max_window_layers": 0}).sliding_window == 4
    # Qwen2 windows the layers from max_window_layers on: a per-layer window.
    partial = LlamaArgs.from_hf_config({**cfg, "use_sliding_window": True, "max_window_layers": 1})
    assert partial.layer_windows == (None, 4)
