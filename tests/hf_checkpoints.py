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

FAMILIES = ("llama", "qwen2", "mistral", "gpt2")

# Small configs, vocab 258 to fit the byte-level tokenizer. Each exercises a feature:
# llama: GQA, Llama 3 rope scaling, q/k/v/o bias; qwen2: q/k/v bias, tied embeddings;
# mistral: sliding window 4, head_dim != hidden/heads; gpt2: tied head, Conv1D layout.
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
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=258, n_embd=64, n_layer=2, n_head=4, n_positions=128,
        bos_token_id=256,
        eos_token_id=257,
        initializer_range=_INIT_STD,
    ),
}


def write_hf_checkpoint(folder: Path, family: str, *, sharded: bool = False, seed: int = 0) -> Path:
    """Write a random-weight HF checkpoint of `family` into `folder` and return the folder.

    Args:
        folder: destination folder, created if missing.
        family: one of FAMILIES.
        sharded: write several safetensors shards plus model.safetensors.index.json.
        seed: torch.manual_seed for the weights.
    """
    if family not in CONFIGS:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    folder = Path(folder)
    torch.manual_seed(seed)
    config = CONFIGS[family]()
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
