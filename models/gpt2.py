"""The GPT-2 family: learned positions, pre-LayerNorm blocks, fused qkv, tanh GELU, tied head.

Our names are HF's without the `transformer.` prefix (`wte`, `h.{i}.attn.c_attn`, `ln_f`,
`lm_head`). HF stores c_attn/c_proj/c_fc in Conv1D layout [in, out]; we use nn.Linear
[out, in] and transpose while loading. See `models/base.py` for the forward contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .attention import allowed_keys, attend
from .base import DecoderLM
from llmc.errors import LlmcError

# HF activation names -> torch GELU approximation.
_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@dataclass(frozen=True, kw_only=True)
class GPT2Args:
    """Shape and numerics of a GPT-2 model. `intermediate_size` defaults to 4 * hidden_size."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_new"
    intermediate_size: int = None  # type: ignore[assignment]  # resolved in __post_init__
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise LlmcError(f"GPT2Args.{field} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise LlmcError(
                f"GPT2Args.hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        if not isinstance(self.intermediate_size, int) or self.intermediate_size <= 0:
            raise LlmcError(f"GPT2Args.intermediate_size must be a positive int, got {self.intermediate_size!r}")
        if self.activation not in _ACTIVATIONS:
            raise LlmcError(
                f"GPT2Args.activation {self.activation!r} is not supported ({', '.join(_ACTIVATIONS)})"
            )
        if self.layer_norm_eps <= 0:
            raise LlmcError("GPT2Args.layer_norm_eps must be positive")

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> GPT2Args:
        """Read a Hugging Face GPT-2 `config.json` dict.

        Args:
            cfg: the parsed config.json.
        """
        if cfg.get("model_type") != "gpt2":
            raise LlmcError(f"model_type {cfg.get('model_type')!r} is not 'gpt2'")
        # Variants whose math differs from plain GPT-2; refuse rather than compute wrong logits.
        if cfg.get("scale_attn_by_inverse_layer_idx", False):
            raise LlmcError("gpt2 config scale_attn_by_inverse_layer_idx=true is not supported")
        if not cfg.get("scale_attn_weights", True):
            raise LlmcError("gpt2 config scale_attn_weights=false is not supported")
        if cfg.get("add_cross_attention", False):
            raise LlmcError("gpt2 config add_cross_attention=true is not supported")
        for key in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"):
            if key not in cfg:
                raise LlmcError(f"config field {key!r} is missing")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["n_embd"],
            num_layers=cfg["n_layer"],
            num_heads=cfg["n_head"],
            max_position_embeddings=cfg["n_positions"],
            layer_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            activation=cfg.get("activation_function", "gelu_new"),
            intermediate_size=cfg.get("n_inner") or None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )


CONFIGS: dict[str, GPT2Args] = {
    "tiny-gpt2": GPT2Args(
        vocab_size=258,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        max_position_embeddings=512,
    ),
}


class GPT2Attention(nn.Module):
    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.c_attn = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.c_proj = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(
        self, x: torch.Tensor, allowed: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        heads_shape = (*x.shape[:-1], -1, self.head_dim)
        # split with its static width, not chunk: the TorchScript exporter writes chunk as three
        # Slices of computed bounds, which the QKV fusion does not see as one projection.
        q, k, v = (t.view(heads_shape).transpose(1, 2)
                   for t in self.c_attn(x).split(self.c_proj.in_features, dim=-1))
        k = torch.cat((past[0], k), dim=2)
        v = torch.cat((past[1], v), dim=2)
        out = attend(q, k, v, allowed, self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(*x.shape[:-1], -1)
        return self.c_proj(out), (k, v)


class GPT2MLP(nn.Module):
    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.c_fc = nn.Linear(args.hidden_size, args.intermediate_size)
        self.c_proj = nn.Linear(args.intermediate_size, args.hidden_size)
        self.approximate = _ACTIVATIONS[args.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.attn = GPT2Attention(args)
        self.ln_2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = GPT2MLP(args)

    def forward(
        self, x: torch.Tensor, allowed: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn_out, present = self.attn(self.ln_1(x), allowed, past)
        x = x + attn_out
        x = x + self.mlp(self.ln_2(x))
        return x, present


class GPT2(DecoderLM):
    """GPT-2 causal LM following the contract in `models/base.py`.

    Args:
        args: the model's shape and numerics.
    """

    family = "gpt2"

    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.hidden_size)
        self.wpe = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.h = nn.ModuleList(GPT2Block(args) for _ in range(args.num_layers))
        self.ln_f = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

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
            position_ids: [B, S] learned-position indices of the new tokens.
            past_key_values: num_layers (key, value) pairs, each [B, num_heads, P, head_dim].
        """
        self.check_past(past_key_values)
        x = self.wte(input_ids) + self.wpe(position_ids)
        allowed = allowed_keys(attention_mask, input_ids.shape[1], None)
        presents = []
        for block, past in zip(self.h, past_key_values):
            x, present = block(x, allowed, past)
            presents.append(present)
        return self.lm_head(self.ln_f(x)), presents

    @staticmethod
    def normalize_hf_name(hf_name: str) -> str | None:
        name = hf_name.removeprefix("transformer.")
        # attn.bias / attn.masked_bias are causal-mask buffers in older checkpoints, not weights.
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None
        return name

    @staticmethod
    def hf_name(name: str) -> str:
        return name if name.startswith("lm_head.") else f"transformer.{name}"

    @staticmethod
    def hf_transposed(name: str) -> bool:
        return name.endswith(_CONV1D_SUFFIXES)
