"""Test fixture factory: small, real Hugging Face checkpoint folders written by transformers.

Used by tests that compare llmc against transformers as an independent reference. The
folders hold random weights (seeded), config.json, safetensors (optionally sharded) and
llmc's byte-level tokenizer as tokenizer.json.

Import it as `from hf_checkpoints import write_hf_checkpoint, hf_model`: tests/conftest.py
puts this `tests/` folder on sys.path (pytest runs with --import-mode=importlib, which does
not add test folders to sys.path by itself, and `tests` is not a package).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from llmc.tokenizer import byte_level_tokenizer

# FAMILIES: the original four, which other tests iterate (keep its meaning stable).
# ALL_FAMILIES: every family `llmc export` supports, for the model and generation tests.
# VARIANTS: other settings of those families, for the model parity tests only.
FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
ALL_FAMILIES = (*FAMILIES, "llama3", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "gpt_neox")
VARIANTS = ("qwen2-layer-windows", "phi3-partial-rotary-window", "gpt_neox-sequential")
# Families that also come at a real model's attention geometry (`real_shape=True`): hidden 512,
# 8 heads of 64; grouped-query (4 KV heads) but plain multi-head for gpt_neox and gpt2; tied
# embeddings for qwen2, gemma and gpt2. The layers (4), the MLP (64) and the vocabulary (258) stay
# small: 4-5 M parameters; more layers repeat what the first few show and only slow the exports.
REAL_SHAPE_FAMILIES = ("llama", "qwen2", "mistral", "phi3", "gemma", "gpt_neox", "gpt2")
_REAL_SHAPE = dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, intermediate_size=64)
_REAL_SHAPE_GQA = dict(num_key_value_heads=4, head_dim=64)

# Small configs, vocab 258 to fit the byte-level tokenizer. Each exercises a feature:
# llama: GQA, Llama 3 rope scaling, q/k/v/o bias; qwen2: q/k/v bias, tied embeddings;
# mistral: sliding window 4, head_dim != hidden/heads; gpt2: tied head, Conv1D layout;
# llama3: several EOS ids, tied embeddings, Llama 3 rope scaling, rope_theta 500000;
# qwen3: q/k RMSNorm; phi3: fused qkv_proj and gate_up_proj; gemma: (1+w) RMSNorm, GeGLU,
# scaled embeddings; gemma2: soft-capping (attention and final logits), sandwich norms,
# sliding layer 0 and global layer 1, query_pre_attn_scalar != head_dim; gemma3 (text):
# q/k norm, local/global rope bases, linear rope scaling on global layers, sliding pattern;
# gpt_neox: parallel residual, partial rotary (half of each head), fused query_key_value.
# Larger than HF's 0.02 so activations are O(1): numerical slips (rope scaling, GELU
# approximation) then move the logits well past the 1e-4 tolerance.
_INIT_STD = 0.1
_LLAMA_COMMON: dict[str, Any] = dict(
    vocab_size=258,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=256,
    eos_token_id=257,
    initializer_range=_INIT_STD,
)
CONFIGS: dict[str, Any] = {
    "llama": lambda: transformers.LlamaConfig(
        **_LLAMA_COMMON,
        attention_bias=True,
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    ),
    "qwen2": lambda: transformers.Qwen2Config(**_LLAMA_COMMON, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(
        **_LLAMA_COMMON, head_dim=32, sliding_window=4, tie_word_embeddings=False
    ),
    "llama3": lambda: transformers.LlamaConfig(
        **{**_LLAMA_COMMON, "eos_token_id": [257, 10]},
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=True,
    ),
    "qwen3": lambda: transformers.Qwen3Config(**_LLAMA_COMMON, head_dim=16, tie_word_embeddings=False),
    "phi3": lambda: transformers.Phi3Config(
        **_LLAMA_COMMON, original_max_position_embeddings=128, pad_token_id=257, tie_word_embeddings=False
    ),
    "gemma": lambda: transformers.GemmaConfig(
        **_LLAMA_COMMON, head_dim=16, hidden_act="gelu_pytorch_tanh", pad_token_id=0
    ),
    "gemma2": lambda: transformers.Gemma2Config(
        **_LLAMA_COMMON, head_dim=16, query_pre_attn_scalar=32, sliding_window=4,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, pad_token_id=0,
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_LLAMA_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        pad_token_id=0,
    ),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, rotary_pct=0.5, use_parallel_residual=True,
        bos_token_id=256, eos_token_id=257, initializer_range=_INIT_STD, tie_word_embeddings=False,
    ),
    # Qwen2 windows the layers from max_window_layers on: layer 0 full, layer 1 sliding.
    "qwen2-layer-windows": lambda: transformers.Qwen2Config(
        **_LLAMA_COMMON, use_sliding_window=True, sliding_window=4, max_window_layers=1
    ),
    "phi3-partial-rotary-window": lambda: transformers.Phi3Config(
        **_LLAMA_COMMON, original_max_position_embeddings=128, pad_token_id=257, partial_rotary_factor=0.5,
        sliding_window=4,
    ),
    "gpt_neox-sequential": lambda: transformers.GPTNeoXConfig(
        vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, rotary_pct=0.25, use_parallel_residual=False, hidden_act="gelu_new",
        bos_token_id=256, eos_token_id=257, initializer_range=_INIT_STD,
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=258, n_embd=64, n_layer=2, n_head=4, n_positions=128,
        bos_token_id=256,
        eos_token_id=257,
        initializer_range=_INIT_STD,
    ),
}


def real_shape_config(family: str) -> transformers.PreTrainedConfig:
    """`family`'s small config (CONFIGS) at the real-shape geometry (REAL_SHAPE_FAMILIES)."""
    small = CONFIGS[family]()
    settings = small.to_dict()
    settings.pop("layer_types", None)  # derived from the layer count again
    if family == "gpt2":
        settings.update(n_layer=8, n_embd=512, n_head=8, n_inner=64)
    else:
        settings.update(_REAL_SHAPE, **({} if family == "gpt_neox" else _REAL_SHAPE_GQA))
    return type(small)(**settings)


def write_hf_checkpoint(folder: Path, family: str, *, sharded: bool = False, seed: int = 0,
                        real_shape: bool = False) -> Path:
    """Write a random-weight HF checkpoint of `family` into `folder` and return the folder.

    Args:
        folder: destination folder, created if missing.
        family: one of ALL_FAMILIES or VARIANTS.
        sharded: write several safetensors shards plus model.safetensors.index.json.
        seed: torch.manual_seed for the weights.
        real_shape: the real-shape geometry (one of REAL_SHAPE_FAMILIES).
    """
    if family not in CONFIGS or (real_shape and family not in REAL_SHAPE_FAMILIES):
        raise ValueError(f"unknown family {family!r} (known: {', '.join(CONFIGS)})")
    folder = Path(folder)
    torch.manual_seed(seed)
    config = real_shape_config(family) if real_shape else CONFIGS[family]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # HF's default init leaves biases and norm scales at 0/1; randomize them so a wrongly
    # loaded bias or norm weight shows in the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB" if sharded else "50GB")
    byte_level_tokenizer().save(folder)
    return folder


def hf_model(folder: Path) -> transformers.PreTrainedModel:
    """The transformers model of a checkpoint folder: eval mode, float32, eager attention.

    Args:
        folder: a folder written by `write_hf_checkpoint` (or any HF checkpoint).
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    )
    return model.eval()


def hf_greedy(folder: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy `generate` from a checkpoint folder, stopping at its own EOS ids
    (generation_config): the reference that llmc's greedy tokens are compared with.

    Args:
        folder: a checkpoint folder.
        prompt_ids: the prompt's token ids.
        new_tokens: at most this many new tokens.
    """
    reference = hf_model(folder)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        generated = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=new_tokens, pad_token_id=257)
    return generated[0, ids.shape[1]:].tolist()
