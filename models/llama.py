"""The Llama family (Llama, Mistral, Qwen2) under its historical names, and the built-in tiny-llama.

Every rotary family now runs on the generic decoder in `models/decoder.py`; Llama is that
decoder with its default parts (RMSNorm, full rotary, SwiGLU, sequential residual). These
aliases keep `LlamaArgs`/`Llama` imports working.
"""

from __future__ import annotations

from .decoder import (
    MLP as LlamaMLP,
    Attention as LlamaAttention,
    Decoder as Llama,
    DecoderArgs as LlamaArgs,
    DecoderLayer as LlamaDecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    rope_inv_freq,
)

__all__ = ["CONFIGS", "Llama", "LlamaArgs", "LlamaAttention", "LlamaDecoderLayer", "LlamaMLP", "RMSNorm",
           "RotaryEmbedding", "apply_rotary", "rope_inv_freq"]

CONFIGS: dict[str, LlamaArgs] = {
    "tiny-llama": LlamaArgs(
        vocab_size=258,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
