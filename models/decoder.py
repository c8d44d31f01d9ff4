"""One generic decoder for the rotary families: Llama, Mistral, Qwen2/3, Phi-3, Gemma 1/2/3, GPT-NeoX.

The parts come from `DecoderArgs` (filled from an HF config by `models/hf_config.py`): the norm
kind (RMSNorm, Gemma's x * (1 + w) RMSNorm, LayerNorm), optional q/k norms, the rotary fraction
(rotate-half layout on the first part of each head), the MLP kind (gated: SwiGLU/GeGLU; plain:
GELU), the residual layout (sequential, parallel as in GPT-NeoX, or Gemma 2's sandwich norms),
and attention extras (query scale, soft-capping, per-layer sliding windows, a local rope base,
scaled embeddings, final-logit soft-capping).

Module and parameter names mirror Hugging Face's Llama (`model.embed_tokens`,
`model.layers.{i}.self_attn.q_proj`, ..., `model.norm`, `lm_head`); `models/hf_weights.py`
maps the other families' names and fused tensors onto them. With Llama's defaults every
optional part is absent from the graph, so a Llama export has exactly its historical ops.
See `models/base.py` for the forward contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .attention import allowed_keys, attend, repeat_kv
from .base import DecoderLM
from llmc.errors import LlmcError

# Rope scaling types we implement; "default" means none.
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
NORMS = ("rms", "rms_offset", "layer")  # rms_offset: Gemma's x / rms(x) * (1 + w)
MLPS = ("gated", "plain")  # gated: down(act(gate(x)) * up(x)); plain: down(act(up(x)))
RESIDUALS = ("sequential", "parallel", "sandwich")
# HF activation names -> (function, GELU approximation)
ACTIVATIONS = {"silu": ("silu", None), "gelu_pytorch_tanh": ("gelu", "tanh"), "gelu_new": ("gelu", "tanh"),
               "gelu": ("gelu", "none")}


@dataclass(frozen=True, kw_only=True)
class DecoderArgs:
    """Shape, numerics and parts of a decoder.

    `attention_bias` puts a bias on q/k/v and `attention_out_bias` on o. `head_dim` defaults
    to hidden_size // num_heads. `rope_scaling` is None or a dict with "rope_type" (or the
    legacy "type") "linear" or "llama3" and that type's parameters. `sliding_window` limits a
    query to the last `sliding_window` keys, itself included, on the layers `sliding_layers`
    marks (all layers when it is None); those layers use `local_rope_theta`, unscaled, when set.
    `query_scale` defaults to head_dim ** -0.5. `weight_layout` names how the HF checkpoint
    stores the tensors ("llama", "phi3", "gpt_neox"; see `models/hf_weights.py`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = None  # type: ignore[assignment]  # resolved in __post_init__
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    family: str = "llama"
    norm: str = "rms"
    qk_norm: bool = False
    activation: str = "silu"
    mlp: str = "gated"
    residual: str = "sequential"
    rotary_fraction: float = 1.0
    embedding_scale: float | None = None
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None
    weight_layout: str = "llama"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise LlmcError(f"DecoderArgs.{field} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise LlmcError(
                    f"DecoderArgs.hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise LlmcError(f"DecoderArgs.head_dim must be a positive even int, got {self.head_dim!r}")
        if self.num_heads % self.num_kv_heads:
            raise LlmcError(
                f"DecoderArgs.num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise LlmcError("DecoderArgs.rms_norm_eps and rope_theta must be positive")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise LlmcError(f"DecoderArgs.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        for field, allowed in (("norm", NORMS), ("mlp", MLPS), ("residual", RESIDUALS), ("activation", ACTIVATIONS)):
            if getattr(self, field) not in allowed:
                raise LlmcError(f"DecoderArgs.{field} {getattr(self, field)!r} is not one of {', '.join(allowed)}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise LlmcError(f"DecoderArgs.sliding_layers has {len(self.sliding_layers)} entries, "
                             f"the model has {self.num_layers} layers")
        if not 0 < self.rotary_fraction <= 1 or self.rotary_dim % 2:
            raise LlmcError(f"DecoderArgs.rotary_fraction {self.rotary_fraction} must give an even rotary "
                             f"dimension in (0, head_dim={self.head_dim}]")
        if self.rope_scaling is not None:
            rope_type = rope_type_of(self.rope_scaling)
            if rope_type not in ROPE_KEYS:
                raise LlmcError(
                    f"unsupported rope scaling type {rope_type!r} (supported: {', '.join(ROPE_KEYS)})"
                )
            missing = [k for k in ROPE_KEYS[rope_type] if k not in self.rope_scaling]
            if missing:
                raise LlmcError(f"rope scaling {rope_type!r} lacks {', '.join(missing)}")

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head are rotated."""
        return int(self.head_dim * self.rotary_fraction)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None for full attention."""
        sliding = self.sliding_layers or (True,) * self.num_layers
        return tuple(self.sliding_window if s else None for s in sliding)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> DecoderArgs:
        """Read a Hugging Face `config.json` dict of any family `models/hf_config.py` knows.

        Args:
            cfg: the parsed config.json.
        """
        from .hf_config import decoder_args  # hf_config builds DecoderArgs: import here, not at the top

        return decoder_args(cfg)


# Built-in models (models/registry.py), seeded random weights; all use the byte-level tokenizer.
CONFIGS: dict[str, DecoderArgs] = {
    "tiny-llama": DecoderArgs(
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

class RMSNorm(nn.Module):
    """x / rms(x) * weight (or * (1 + weight), Gemma's form), computed in float32 like HF.

    Args:
        size: the normalized dimension.
        eps: added to the mean square.
        offset: Gemma stores w and scales by 1 + w.
    """

    def __init__(self, size: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def make_norm(args: DecoderArgs, size: int) -> nn.Module:
    """The config's norm over `size` features.

    Args:
        args: model args; uses norm and rms_norm_eps (the epsilon of every kind).
        size: the normalized dimension.
    """
    if args.norm == "layer":
        return nn.LayerNorm(size, eps=args.rms_norm_eps)
    return RMSNorm(size, args.rms_norm_eps, offset=args.norm == "rms_offset")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given position ids, with HF's rotate-half layout (frequencies repeated twice).

    Args:
        args: model args.
        theta: rope base overriding args.rope_theta, unscaled (a local layer's base).
    """

    def __init__(self, args: DecoderArgs, theta: float | None = None) -> None:
        super().__init__()
        # Not persistent: derived from args, and HF checkpoints do not (reliably) store it.
        self.register_buffer("inv_freq", rope_inv_freq(args, theta), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]  # [B, S, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rope_inv_freq(args: DecoderArgs, theta: float | None = None) -> torch.Tensor:
    """Inverse rotary frequencies [rotary_dim/2], with linear or Llama 3 scaling applied.

    Args:
        args: model args; uses rotary_dim, rope_theta and rope_scaling.
        theta: a base to use instead of rope_theta, without scaling (local layers).
    """
    dim = args.rotary_dim
    base = args.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling if theta is None else None
    rope_type = rope_type_of(scaling) if scaling is not None else "default"
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate query or key states [B, H, S, D] by position tables cos/sin [B, S, R].

    Only the first R dims rotate (partial rotary, R < D); the rest pass through.

    Args:
        x: states to rotate.
        cos: from `RotaryEmbedding`.
        sin: from `RotaryEmbedding`.
    """
    cos, sin = cos[:, None], sin[:, None]
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2), or x when cap is None.

    Args:
        x: scores or logits.
        cap: the soft cap.
    """
    return x if cap is None else torch.tanh(x / cap) * cap


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.scale = args.query_scale if args.query_scale is not None else args.head_dim**-0.5
        self.softcap = args.attn_softcap
        d = args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * d, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * d, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * d, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.num_heads * d, args.hidden_size, bias=args.attention_out_bias)
        if args.qk_norm:
            self.q_norm = make_norm(args, d)
            self.k_norm = make_norm(args, d)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        heads_shape = (*x.shape[:-1], -1, self.head_dim)  # [B, S, heads, D]
        q = self.q_proj(x).view(heads_shape)
        k = self.k_proj(x).view(heads_shape)
        if hasattr(self, "q_norm"):  # per head, before rotary (Qwen3, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(heads_shape).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k = torch.cat((past[0], k), dim=2)
        v = torch.cat((past[1], v), dim=2)
        groups = self.num_heads // self.num_kv_heads
        out = attend(q, repeat_kv(k, groups), repeat_kv(v, groups), allowed, self.scale, self.softcap)
        out = out.transpose(1, 2).reshape(*x.shape[:-1], -1)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    """Gated (SwiGLU, GeGLU): down(act(gate(x)) * up(x)); plain: down(act(up(x)))."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        if args.mlp == "gated":
            self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.function, self.approximate = ACTIVATIONS[args.activation]

    def act(self, x: torch.Tensor) -> torch.Tensor:
        if self.function == "silu":
            return nn.functional.silu(x)
        return nn.functional.gelu(x, approximate=self.approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_proj"):
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = make_norm(args, args.hidden_size)
        self.post_attention_layernorm = make_norm(args, args.hidden_size)
        self.residual = args.residual
        if args.residual == "sandwich":
            self.pre_feedforward_layernorm = make_norm(args, args.hidden_size)
            self.post_feedforward_layernorm = make_norm(args, args.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn_out, present = self.self_attn(self.input_layernorm(x), cos, sin, allowed, past)
        if self.residual == "parallel":  # GPT-NeoX: both branches read the layer's input
            return x + attn_out + self.mlp(self.post_attention_layernorm(x)), present
        if self.residual == "sandwich":  # Gemma 2/3: each branch's output is normed too
            x = x + self.post_attention_layernorm(attn_out)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), present
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, present


class Backbone(nn.Module):
    """Holds the HF `model.` submodules; the forward pass lives in `Decoder`."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = make_norm(args, args.hidden_size)
        self.rotary_emb = RotaryEmbedding(args)
        if args.local_rope_theta is not None:
            self.local_rotary_emb = RotaryEmbedding(args, args.local_rope_theta)


class Decoder(DecoderLM):
    """The generic decoder, following the contract in `models/base.py`.

    Args:
        args: the model's shape, numerics and parts.
    """

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.family = args.family
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits for the new tokens and the grown key/value cache.

        Args:
            input_ids: [B, S] new token ids.
            attention_mask: [B, P+S], 1 for real tokens, 0 for left padding.
            position_ids: [B, S] rotary positions of the new tokens.
            past_key_values: num_layers (key, value) pairs, each [B, num_kv_heads, P, head_dim].
        """
        self.check_past(past_key_values)
        args = self.args
        x = self.model.embed_tokens(input_ids)
        if args.embedding_scale is not None:
            x = x * args.embedding_scale
        rotary = self.model.rotary_emb(position_ids)
        local_rotary = self.model.local_rotary_emb(position_ids) if args.local_rope_theta is not None else rotary
        # One mask per distinct window (at most two: full and sliding).
        masks = {w: allowed_keys(attention_mask, input_ids.shape[1], w) for w in set(args.layer_windows)}
        presents = []
        for layer, past, window in zip(self.model.layers, past_key_values, args.layer_windows):
            cos, sin = local_rotary if window is not None else rotary
            x, present = layer(x, cos, sin, masks[window], past)
            presents.append(present)
        return soft_cap(self.lm_head(self.model.norm(x)), args.final_softcap), presents

    def normalize_hf_name(self, hf_name: str) -> str | None:
        from .hf_weights import normalize_hf_name

        return normalize_hf_name(self.args, hf_name)

    def hf_name(self, name: str) -> str:
        from .hf_weights import hf_name

        return hf_name(self.args, name)

    def split_hf_tensor(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        from .hf_weights import split_hf_tensor

        return split_hf_tensor(self.args, name, tensor)


def rope_type_of(scaling: dict[str, Any]) -> str:
    """The rope type of a scaling dict ("rope_type", or the legacy "type")."""
    return scaling.get("rope_type", scaling.get("type", "default"))
