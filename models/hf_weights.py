"""How each family's HF checkpoint names and fuses the generic decoder's tensors.

The decoder's parameters carry Llama's names. Phi-3 stores q/k/v as one `qkv_proj` (q rows,
then k, then v) and gate/up as one `gate_up_proj` (gate rows first); GPT-NeoX renames
everything and stores `query_key_value` interleaved per head ([q_h, k_h, v_h] for each head h).
A fused tensor keeps its HF name through `normalize_hf_name` and is cut into our parameters
by `split_hf_tensor`.
"""

from __future__ import annotations

import re

import torch

from .decoder import DecoderArgs
from llmc.errors import LlmcError

# (HF substring, our substring), applied in order by plain replacement; reversed for hf_name.
_RENAMES: dict[str, list[tuple[str, str]]] = {
    "llama": [],
    "phi3": [],
    "gpt_neox": [
        ("gpt_neox.embed_in.", "model.embed_tokens."),
        ("gpt_neox.final_layer_norm.", "model.norm."),
        ("embed_out.", "lm_head."),
        ("gpt_neox.layers.", "model.layers."),
        (".attention.query_key_value.", ".self_attn.query_key_value."),
        (".attention.dense.", ".self_attn.o_proj."),
        (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
        (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
    ],
}
# Buffers some checkpoints store (rotary tables, causal masks): derived, never loaded.
_BUFFERS = ("rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")
# (our fused name, its parts) per layout; fused names are what normalize_hf_name returns.
_FUSED = {
    "llama": {},
    "phi3": {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
    "gpt_neox": {"self_attn.query_key_value": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
}
_FUSED_NAME = re.compile(r"^(model\.layers\.\d+\.)(.+)\.(weight|bias)$")


def normalize_hf_name(args: DecoderArgs, hf_name: str) -> str | None:
    """Our name for an HF tensor (a fused tensor keeps a fused name), or None to skip it.

    Args:
        args: the model's args (weight_layout).
        hf_name: tensor name in the safetensors file.
    """
    if hf_name.endswith(_BUFFERS):
        return None
    for theirs, ours in _RENAMES[args.weight_layout]:
        hf_name = hf_name.replace(theirs, ours)
    return hf_name


def hf_name(args: DecoderArgs, name: str) -> str:
    """The HF tensor that holds our parameter `name` (the fused tensor for a part of one).

    Args:
        args: the model's args (weight_layout).
        name: one of our parameter names.
    """
    for fused, parts in _FUSED[args.weight_layout].items():
        for part in parts:
            name = name.replace(f".{part}.", f".{fused}.")
    for theirs, ours in reversed(_RENAMES[args.weight_layout]):
        name = name.replace(ours, theirs)
    return name


def split_hf_tensor(args: DecoderArgs, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Our parameters cut out of a fused tensor, or None when `name` is not a fused tensor.

    Args:
        args: the model's args (weight_layout and head counts).
        name: the tensor's name from `normalize_hf_name`.
        tensor: the fused tensor as stored.
    """
    match = _FUSED_NAME.match(name)
    if match is None or match.group(2) not in _FUSED[args.weight_layout]:
        return None
    prefix, fused, kind = match.groups()
    parts = _FUSED[args.weight_layout][fused]
    q_rows, kv_rows = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    rows = [q_rows, kv_rows, kv_rows] if len(parts) == 3 else [args.intermediate_size] * 2
    if tensor.shape[0] != sum(rows):
        raise LlmcError(f"tensor has shape {list(tensor.shape)}, expected {[sum(rows), *tensor.shape[1:]]}")
    if args.weight_layout == "gpt_neox":
        # [heads * 3 * D, ...] with each head's q, k, v rows together.
        per_head = tensor.reshape(args.num_heads, 3, args.head_dim, *tensor.shape[1:])
        pieces = [per_head[:, j].reshape(q_rows, *tensor.shape[1:]) for j in range(3)]
    else:
        pieces = list(torch.split(tensor, rows, dim=0))
    return {f"{prefix}{part}.{kind}": piece for part, piece in zip(parts, pieces)}
