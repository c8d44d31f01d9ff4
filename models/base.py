"""What every decoder model class in llmc exposes to the exporter and the checkpoint loader.

Forward contract (all families; the ONNX exporter relies on it exactly)::

    forward(input_ids [B, S] int64, attention_mask [B, P+S] int64, position_ids [B, S] int64,
            past_key_values: list of num_layers (key, value), each [B, num_kv_heads, P, head_dim] f32)
      -> (logits [B, S, vocab] f32, presents: list of (key, value) each [B, num_kv_heads, P+S, head_dim])

Presents hold keys after rotary embedding (where the family has one), kv heads not repeated.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from llmc.errors import LlmcError


class DecoderLM(torch.nn.Module):
    """Base class: shape properties read from `self.args`, plus how parameter names map to HF files.

    Subclasses set `family` and `self.args`; the args dataclass must have the fields
    num_layers, num_heads, num_kv_heads, head_dim, vocab_size and max_position_embeddings.
    """

    family: ClassVar[str]
    args: Any

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    @property
    def num_heads(self) -> int:
        return self.args.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.args.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.args.head_dim

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_positions(self) -> int:
        return self.args.max_position_embeddings

    # --- Hugging Face checkpoint naming; the defaults suit families whose names mirror HF's. ---

    @staticmethod
    def normalize_hf_name(hf_name: str) -> str | None:
        """Our parameter name for a tensor name found in an HF file, or None to skip the tensor.

        Args:
            hf_name: tensor name as stored in the safetensors file.
        """
        return hf_name

    @staticmethod
    def hf_name(name: str) -> str:
        """The canonical HF tensor name of our parameter `name` (used in error messages).

        Args:
            name: one of our parameter names.
        """
        return name

    def split_hf_tensor(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Our parameters cut out of a fused HF tensor, or None when `name` is not fused.

        Args:
            name: the tensor's name from `normalize_hf_name`.
            tensor: the tensor as stored.
        """
        return None

    @staticmethod
    def hf_transposed(name: str) -> bool:
        """Whether the HF file stores parameter `name` transposed relative to ours.

        Args:
            name: one of our parameter names.
        """
        return False

    def check_past(self, past_key_values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Reject a past whose layer count does not match the model.

        Args:
            past_key_values: the `past_key_values` argument of `forward`.
        """
        if len(past_key_values) != self.num_layers:
            raise LlmcError(
                f"past_key_values has {len(past_key_values)} layers, the model has {self.num_layers}"
            )
