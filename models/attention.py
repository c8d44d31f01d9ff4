"""Attention masking and scaled dot-product attention shared by every model family.

Everything here is built from tensor shapes with tensor ops only (no Python values read
out of tensors, no data-dependent branches), because the models are exported with
`torch.onnx.export(dynamo=True)` with dynamic batch, sequence and past lengths.
"""

from __future__ import annotations

import torch


def allowed_keys(attention_mask: torch.Tensor, query_len: int | torch.SymInt, sliding_window: int | None) -> torch.Tensor:
    """Which keys each query may attend to, as a bool tensor [B, 1, S, P+S].

    Query i sits at absolute index P+i of the key sequence. It sees key j iff j <= P+i,
    `attention_mask[b, j] == 1`, and, with a sliding window w, (P+i) - j < w.

    Args:
        attention_mask: [B, P+S] int, 1 for real tokens and 0 for (left) padding.
        query_len: S, the number of new tokens in this call.
        sliding_window: window size w, or None for full causal attention.
    """
    total_len = attention_mask.shape[1]
    device = attention_mask.device
    key_pos = torch.arange(total_len, device=device)
    # The new tokens are the last S of the key sequence: absolute indices P..P+S-1.
    query_pos = torch.arange(query_len, device=device) + (total_len - query_len)
    distance = query_pos[:, None] - key_pos[None, :]  # [S, P+S], >= 0 means key not in the future
    allowed = distance >= 0
    if sliding_window is not None:
        allowed = allowed & (distance < sliding_window)
    return allowed[None, None, :, :] & (attention_mask[:, None, None, :] != 0)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention with an explicit mask; returns [B, H, S, D].

    Masked scores are replaced by the dtype's most negative finite value rather than -inf,
    so a fully masked row (a padding query) softmaxes to a uniform row instead of NaN.

    Args:
        query: [B, H, S, D].
        key: [B, H, T, D], key heads already repeated to H.
        value: [B, H, T, D].
        allowed: bool [B, 1, S, T] from `allowed_keys`.
        scale: multiplier on q.k, normally 1/sqrt(D).
        softcap: Gemma 2's soft cap: scores become softcap * tanh(scores / softcap) before masking.
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # where() instead of adding the mask: adding finfo.min to a very negative score could overflow to -inf.
    scores = torch.where(allowed, scores, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value)


def repeat_kv(x: torch.Tensor, repeats: int) -> torch.Tensor:
    """Repeat each key/value head `repeats` times: [B, KV, T, D] -> [B, KV*repeats, T, D].

    Args:
        x: key or value states with KV heads.
        repeats: query heads per key/value head (grouped-query attention).
    """
    if repeats == 1:
        return x
    batch, kv_heads, length, head_dim = x.shape
    x = x[:, :, None, :, :].expand(batch, kv_heads, repeats, length, head_dim)
    return x.reshape(batch, kv_heads * repeats, length, head_dim)
