"""Config readers on the fields published checkpoints use, against transformers' own reading.

The dicts hold the fields that matter of real config.json files (legacy spellings included:
rotary_pct, rotary_emb_base, rope_local_base_freq, sliding_window_pattern, hidden_act "gelu"
in Gemma 1). transformers' config classes derive each layer's attention type and the rope
parameters from them; our `DecoderArgs` must agree.
"""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from llmc.errors import LlmcError
from llmc.models.hf_config import decoder_args

_SHAPE = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_attention_heads=4,
              num_key_value_heads=1, max_position_embeddings=4096)
REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "gemma-3-1b": dict(model_type="gemma3_text", num_hidden_layers=26, head_dim=256, query_pre_attn_scalar=256,
                       rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None, sliding_window=512,
                       sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh"),
    "gemma-3-4b-text": dict(model_type="gemma3_text", num_hidden_layers=34, head_dim=256, query_pre_attn_scalar=256,
                            rope_theta=1000000.0, rope_local_base_freq=10000.0,
                            rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=1024,
                            sliding_window_pattern=6),
    "gemma-2-2b": dict(model_type="gemma2", num_hidden_layers=26, head_dim=256, query_pre_attn_scalar=256,
                       sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma-2b": dict(model_type="gemma", num_hidden_layers=18, head_dim=256, hidden_act="gelu"),
    "pythia-70m": dict(model_type="gpt_neox", num_hidden_layers=6, rotary_pct=0.25, rotary_emb_base=10000,
                       use_parallel_residual=True, hidden_act="gelu", num_key_value_heads=None),
    "phi-3-mini-4k": dict(model_type="phi3", num_hidden_layers=32, sliding_window=2047, rope_scaling=None),
    "qwen2.5-windowed": dict(model_type="qwen2", num_hidden_layers=8, use_sliding_window=True, sliding_window=64,
                             max_window_layers=6),
}


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_layer_windows_and_rotary_agree_with_transformers(name: str) -> None:
    cfg = {**_SHAPE, **REAL_CONFIGS[name]}
    cfg = {k: v for k, v in cfg.items() if v is not None or k == "rope_scaling"}
    theirs = transformers.AutoConfig.for_model(**cfg)
    ours = decoder_args(cfg)
    layer_types = getattr(theirs, "layer_types", None) or ["full_attention"] * theirs.num_hidden_layers
    if name == "phi-3-mini-4k":  # Phi-3 windows every layer, without layer_types
        layer_types = ["sliding_attention"] * theirs.num_hidden_layers
    want = tuple(theirs.sliding_window if t == "sliding_attention" else None for t in layer_types)
    assert ours.layer_windows == want
    rope = theirs.rope_parameters
    full = rope.get("full_attention", rope)
    assert ours.rope_theta == full["rope_theta"]
    assert ours.rotary_dim == int(ours.head_dim * full.get("partial_rotary_factor", 1.0))
    assert (ours.rope_scaling or {}).get("factor") == (full.get("factor") if full["rope_type"] != "default" else None)
    if "sliding_attention" in rope:
        assert ours.local_rope_theta == rope["sliding_attention"]["rope_theta"]
    act = getattr(theirs, "hidden_activation", None) or theirs.hidden_act
    assert ours.activation == act


def test_gemma2_extras() -> None:
    args = decoder_args({**_SHAPE, **REAL_CONFIGS["gemma-2-2b"]})
    assert (args.norm, args.residual, args.attn_softcap, args.final_softcap) == ("rms_offset", "sandwich", 50.0, 30.0)
    assert args.query_scale == 256**-0.5 and args.embedding_scale == 16.0 and args.tie_word_embeddings


@pytest.mark.parametrize(("changes", "message"), [
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "unsupported rope scaling type 'longrope'"),
    ({"model_type": "gemma2", "layer_types": ["chunked_attention", "full_attention"]},
     "layer_types 'chunked_attention' is not supported"),
    ({"model_type": "qwen3", "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_unsupported_settings_are_refused(changes: dict[str, Any], message: str) -> None:
    cfg = {**_SHAPE, "num_hidden_layers": 2, "query_pre_attn_scalar": 64, "sliding_window": 8, **changes}
    with pytest.raises(LlmcError, match=message):
        decoder_args(cfg)
