"""Hugging Face config.json → `DecoderArgs`, one small reader per family in one table.

Each reader states only what differs from Llama; `_common` reads the fields every rotary
family shares. A config whose math we do not implement (an activation, a rope type, a
layer pattern) raises LlmcError rather than produce wrong logits.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from .decoder import DecoderArgs, rope_type_of
from llmc.errors import LlmcError


def decoder_args(cfg: dict[str, Any]) -> DecoderArgs:
    """The `DecoderArgs` of an HF config dict, dispatching on model_type.

    Args:
        cfg: the parsed config.json.
    """
    model_type = cfg.get("model_type")
    if model_type not in READERS:
        raise LlmcError(f"model_type {model_type!r} is not a generic-decoder type ({', '.join(READERS)})")
    return DecoderArgs(**READERS[model_type](cfg))


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {**_common(cfg), "attention_bias": bias, "attention_out_bias": bias,
            "mlp_bias": bool(cfg.get("mlp_bias", False))}


def _mistral(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**_common(cfg), "sliding_window": cfg.get("sliding_window")}


def _qwen2(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**_common(cfg), "attention_bias": True, **_qwen_windows(cfg)}


def _qwen3(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {**_common(cfg), "attention_bias": bias, "attention_out_bias": bias, "qk_norm": True,
            **_qwen_windows(cfg)}


def _phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**_common(cfg), "sliding_window": cfg.get("sliding_window"), "weight_layout": "phi3",
            "rotary_fraction": _rotary_fraction(cfg)}


def _gemma(cfg: dict[str, Any]) -> dict[str, Any]:
    # Gemma 1 configs name the activation hidden_act; a "gelu" there has always meant the tanh form.
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    act = "gelu_pytorch_tanh" if act == "gelu" else act
    bias = bool(cfg.get("attention_bias", False))
    return {**_common(cfg, default_act=act), "activation": act, "norm": "rms_offset",
            "attention_bias": bias, "attention_out_bias": bias,
            "embedding_scale": math.sqrt(cfg["hidden_size"]),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}


def _gemma2(cfg: dict[str, Any]) -> dict[str, Any]:
    args = {**_gemma(cfg), "residual": "sandwich",
            "query_scale": float(_required(cfg, "query_pre_attn_scalar")) ** -0.5,
            "attn_softcap": cfg.get("attn_logit_softcapping"),
            "final_softcap": cfg.get("final_logit_softcapping")}
    return {**args, **_layer_windows(cfg, default_pattern=2)}


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    args = {**_gemma2(cfg), "qk_norm": True, **_layer_windows(cfg, default_pattern=6)}
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per layer type (transformers >= 5)
        full, local = _rope(params["full_attention"], {}), _rope(params.get("sliding_attention") or {}, {})
        if local[1] is not None:
            raise LlmcError("gemma3 rope scaling on sliding layers is not supported")
        args.update(rope_theta=full[0], rope_scaling=full[1], local_rope_theta=local[0])
    else:
        args.update(local_rope_theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    return args


def _gpt_neox(cfg: dict[str, Any]) -> dict[str, Any]:
    args = _common(cfg, default_act="gelu")
    return {**args, "norm": "layer", "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)), "mlp": "plain",
            "activation": cfg.get("hidden_act", "gelu"), "attention_bias": bool(cfg.get("attention_bias", True)),
            "attention_out_bias": bool(cfg.get("attention_bias", True)), "mlp_bias": True,
            "residual": "parallel" if cfg.get("use_parallel_residual", True) else "sequential",
            "rotary_fraction": _rotary_fraction(cfg), "weight_layout": "gpt_neox",
            "intermediate_size": cfg.get("intermediate_size") or 4 * cfg["hidden_size"]}


# model_type -> reader. Every reader returns DecoderArgs keyword arguments.
READERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "phi3": _phi3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "gpt_neox": _gpt_neox,
}


def _common(cfg: dict[str, Any], default_act: str = "silu") -> dict[str, Any]:
    act = cfg.get("hidden_act", default_act)
    if cfg.get("model_type") in ("llama", "mistral", "qwen2", "qwen3", "phi3") and act != "silu":
        raise LlmcError(f"hidden_act {act!r} is not supported (only 'silu')")
    params = cfg.get("rope_parameters")
    rope_theta, rope_scaling = _rope(params if params is not None else dict(cfg.get("rope_scaling") or {}), cfg)
    num_heads = _required(cfg, "num_attention_heads")
    return dict(
        family=cfg["model_type"],
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
    )


def _required(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise LlmcError(f"config field {key!r} is missing")
    return cfg[key]


def _rope(params: Any, cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from a rope_parameters (or legacy rope_scaling) dict."""
    if not isinstance(params, dict):
        raise LlmcError(f"config field rope_parameters must be a dict, got {params!r}")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", cfg.get("rotary_emb_base", 10000.0))))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if rope_type_of(scaling) == "default":
        return theta, None
    return theta, scaling


def _rotary_fraction(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", cfg.get("rotary_pct", 1.0))))


def _qwen_windows(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/3 window only the layers listed as sliding, and only with use_sliding_window."""
    if not cfg.get("use_sliding_window", False):
        return {}
    num_layers = cfg.get("num_hidden_layers", 0)
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i >= cfg.get("max_window_layers", 0) else "full_attention" for i in range(num_layers)
    ]
    return _windows_from_types(cfg, layer_types)


def _layer_windows(cfg: dict[str, Any], default_pattern: int) -> dict[str, Any]:
    """Gemma 2/3: layer_types, or every `sliding_window_pattern`-th layer global, the rest sliding."""
    num_layers = _required(cfg, "num_hidden_layers")
    pattern = cfg.get("sliding_window_pattern") or default_pattern
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
    return _windows_from_types(cfg, layer_types)


def _windows_from_types(cfg: dict[str, Any], layer_types: list[str]) -> dict[str, Any]:
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise LlmcError(f"layer_types {unknown[0]!r} is not supported")
    sliding = tuple(t == "sliding_attention" for t in layer_types)
    if not any(sliding) or cfg.get("sliding_window") is None:
        return {"sliding_window": None}
    return {"sliding_window": cfg["sliding_window"], "sliding_layers": sliding}
