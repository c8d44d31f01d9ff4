"""The Llama family: Llama, Mistral and Qwen2 (RMSNorm, rotary embeddings, GQA, SwiGLU MLP).

Module and parameter names mirror Hugging Face's (`model.embed_tokens`,
`model.layers.{i}.self_attn.q_proj`, ..., `model.norm`, `lm_head`), so an HF state dict
loads without renaming. See `models/base.py` for the forward contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .attention import allowed_keys, attend, repeat_kv
from .base import DecoderLM

# Rope scaling types we implement; "default" means none.
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, kw_only=True)
class LlamaArgs:
    """Shape and numerics of a Llama-family model.

    `attention_bias` puts a bias on q/k/v and `attention_out_bias` on o: Llama's HF
    `attention_bias` sets both, Qwen2 has only the first. `head_dim` defaults to
    hidden_size // num_heads. `rope_scaling` is None or a dict with "rope_type" (or the
    legacy "type") "linear" or "llama3" and that type's parameters. `sliding_window`
    (Mistral) limits each query to the last `sliding_window` keys, itself included.
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

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaArgs.{field} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"LlamaArgs.hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"LlamaArgs.head_dim must be a positive even int, got {self.head_dim!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaArgs.num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("LlamaArgs.rms_norm_eps and rope_theta must be positive")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"LlamaArgs.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.rope_scaling is not None:
            rope_type = _rope_type(self.rope_scaling)
            if rope_type not in _ROPE_KEYS:
                raise ValueError(
                    f"unsupported rope scaling type {rope_type!r} (supported: {', '.join(_ROPE_KEYS)})"
                )
            missing = [k for k in _ROPE_KEYS[rope_type] if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope scaling {rope_type!r} lacks {', '.join(missing)}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlamaArgs:
        """Read a Hugging Face `config.json` dict of model_type llama, mistral or qwen2.

        Handles both the legacy `rope_theta` + `rope_scaling` fields and the newer
        `rope_parameters` dict.

        Args:
            cfg: the parsed config.json.
        """
        model_type = cfg.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a Llama-family type ({', '.join(_MODEL_TYPES)})")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        rope_theta, rope_scaling = _hf_rope(cfg)
        if model_type == "llama":
            bias = bool(cfg.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias = bias, bias, bool(cfg.get("mlp_bias", False))
        elif model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            qkv_bias, o_bias, mlp_bias = False, False, False
        num_heads = _required(cfg, "num_attention_heads")
        return cls(
            vocab_size=_required(cfg, "vocab_size"),
            hidden_size=_required(cfg, "hidden_size"),
            intermediate_size=_required(cfg, "intermediate_size"),
            num_layers=_required(cfg, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or None,
            max_position_embeddings=_required(cfg, "max_position_embeddings"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_out_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=_hf_sliding_window(cfg, model_type),
        )


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


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like HF."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given position ids, with HF's rotate-half layout (frequencies repeated twice)."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        # Not persistent: derived from args, and HF checkpoints do not (reliably) store it.
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim/2], with linear or Llama 3 scaling applied.

    Args:
        args: model args; uses head_dim, rope_theta and rope_scaling.
    """
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    rope_type = _rope_type(scaling) if scaling is not None else "default"
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
    """Rotate query or key states [B, H, S, D] by position tables cos/sin [B, S, D].

    Args:
        x: states to rotate.
        cos: from `RotaryEmbedding`.
        sin: from `RotaryEmbedding`.
    """
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        d = args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * d, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * d, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * d, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.num_heads * d, args.hidden_size, bias=args.attention_out_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        heads_shape = (*x.shape[:-1], -1, self.head_dim)  # [B, S, heads, D]
        q = self.q_proj(x).view(heads_shape).transpose(1, 2)
        k = self.k_proj(x).view(heads_shape).transpose(1, 2)
        v = self.v_proj(x).view(heads_shape).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k = torch.cat((past[0], k), dim=2)
        v = torch.cat((past[1], v), dim=2)
        groups = self.num_heads // self.num_kv_heads
        out = attend(q, repeat_kv(k, groups), repeat_kv(v, groups), allowed, self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(*x.shape[:-1], -1)
        return self.o_proj(out), (k, v)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args)
        self.mlp = LlamaMLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn_out, present = self.self_attn(self.input_layernorm(x), cos, sin, allowed, past)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, present


class LlamaBackbone(nn.Module):
    """Holds the HF `model.` submodules; the forward pass lives in `Llama`."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args)


class Llama(DecoderLM):
    """Llama/Mistral/Qwen2 causal LM following the contract in `models/base.py`.

    Args:
        args: the model's shape and numerics.
    """

    family = "llama"

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaBackbone(args)
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
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(position_ids)
        allowed = allowed_keys(attention_mask, input_ids.shape[1], self.args.sliding_window)
        presents = []
        for layer, past in zip(self.model.layers, past_key_values):
            x, present = layer(x, cos, sin, allowed, past)
            presents.append(present)
        return self.lm_head(self.model.norm(x)), presents

    @staticmethod
    def normalize_hf_name(hf_name: str) -> str | None:
        # Older checkpoints store the derived rotary table per layer; we recompute it.
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        return hf_name


def _rope_type(scaling: dict[str, Any]) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


def _required(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise ValueError(f"config field {key!r} is missing")
    return cfg[key]


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either HF config layout."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
    if not isinstance(params, dict):
        raise ValueError(f"config field rope_parameters must be a dict, got {params!r}")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if _rope_type(scaling) == "default":
        return theta, None
    return theta, scaling


def _hf_sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    if model_type == "mistral":
        return cfg.get("sliding_window")
    if model_type == "qwen2" and cfg.get("use_sliding_window", False):
        # Qwen2 windows only the layers listed as sliding; we support all-or-nothing.
        num_layers = cfg.get("num_hidden_layers", 0)
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", 0) else "full_attention"
            for i in range(num_layers)
        ]
        sliding = [t == "sliding_attention" for t in layer_types]
        if all(sliding):
            return cfg.get("sliding_window")
        if any(sliding):
            raise ValueError("qwen2 with sliding window on only some layers is not supported")
    return None
