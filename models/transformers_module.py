"""Any decoder-only checkpoint transformers runs, behind llmc's decoder contract (models/base.py).

For a `model_type` outside llmc's own table, transformers' module is the model: `TransformersDecoder`
hands it the past as a cache of plain full-length layers and returns what that cache holds after the
step, so `compiler/export.py` traces it as it traces llmc's decoders and checks it the same way.
Attention is transformers' eager form (explicit MatMul/Softmax, which llmc's passes fuse; sdpa's
Python-level mask shortcuts would be fixed by a trace), mixture-of-experts layers its `batched_mm`
form (each token gathers its experts' weights: no loop over the experts a trace would fix).

Sliding windows are applied by transformers' attention mask, as for the table's families, and
written to the metadata for the paged engine; the cache keeps every position.
"""

from __future__ import annotations

import contextlib
import difflib
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.cache_utils import DynamicCache, DynamicLayer

from llmc.errors import LlmcError, first_line


class TransformersDecoder(torch.nn.Module):
    """A transformers causal LM with llmc's forward contract and geometry properties."""

    def __init__(self, model: torch.nn.Module, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_positions: int):
        super().__init__()
        self.model = model
        self.family = model.config.model_type
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.vocab_size = model.config.get_text_config().vocab_size
        self.max_positions = max_positions
        # Each layer's attention window is read from this config by the exporter
        # (formats/decoder_interface.py config_windows), as for any Hugging Face config.
        self.hf_config = model.config.get_text_config().to_dict()

    def forward(self, input_ids, attention_mask, position_ids, past_key_values):
        cache = _cache(past_key_values)
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            cache=cache, use_cache=True).logits
        return logits, [(layer.keys, layer.values) for layer in cache.layers]


class FullLengthCacheLayer(DynamicLayer):
    """A DynamicLayer holding a given past, whose length is its shape: DynamicLayer's own reads 0
    when the past is empty, a data branch a trace (or torch.export's guards) would fix."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


def _cache(past: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache of full-length layers holding `past`, or empty layers made as the model writes them."""
    cache = DynamicCache()
    if past:
        cache.layers = [FullLengthCacheLayer(k, v) for k, v in past]
    return cache


def load_transformers_checkpoint(folder: Path, cfg: dict[str, Any]) -> TransformersDecoder:
    """The checkpoint in `folder` as transformers builds it, float32, eval mode.

    Args:
        folder: a Hugging Face checkpoint folder.
        cfg: its parsed config.json (model_type outside llmc's table).

    Raises:
        LlmcError: transformers cannot build it as a causal LM, or its attention is a kind the
            decoder-with-past interface cannot carry (one line naming the layer).
    """
    config_path = folder / "config.json"
    model_type = cfg.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        nearest = difflib.get_close_matches(str(model_type), list(transformers.CONFIG_MAPPING.keys()), n=1)
        raise LlmcError(f"{config_path}: model_type {model_type!r} is neither one of llmc's own families nor "
                        f"known to transformers {transformers.__version__}"
                        + (f" (nearest: {nearest[0]})" if nearest else ""))
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except Exception as e:  # whatever its config class raises on fields it refuses
        raise LlmcError(f"{config_path}: transformers cannot read it ({_one_line(e)})") from None
    causal = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    if causal is None:
        raise LlmcError(f"{config_path}: model_type {model_type!r} has no causal-LM (decoder-only) model in "
                        f"transformers {transformers.__version__}")
    _check_layer_types(config.get_text_config(), config_path)
    options = {"experts_implementation": "batched_mm"} if causal._can_set_experts_implementation() else {}
    try:
        with warnings.catch_warnings(), _quiet_transformers():
            warnings.simplefilter("ignore")
            model, loading = causal.from_pretrained(folder, config=config, dtype=torch.float32,
                                                    attn_implementation="eager", output_loading_info=True, **options)
    except Exception as e:  # mismatched tensors, unreadable files: its message is the line
        raise LlmcError(f"{folder}: transformers cannot load it as {causal.__name__} ({_one_line(e)})") from None
    # transformers fills a tensor the files lack with random values and only warns.
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        raise LlmcError(f"{folder}: missing tensor {missing[0]!r} of {causal.__name__} ({len(missing)} missing in all)")
    model.eval()
    text = config.get_text_config()
    num_heads = getattr(text, "num_attention_heads", None)
    max_positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    for name, value in (("num_attention_heads", num_heads), ("max_position_embeddings", max_positions)):
        if not isinstance(value, int):
            raise LlmcError(f"{config_path}: no integer {name} (transformers' {type(text).__name__})")
    kv_heads, head_dim = _cache_geometry(model, folder, text.num_hidden_layers)
    return TransformersDecoder(model, num_heads=num_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                               max_positions=max_positions)


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {first_line(error, 200)}"


@contextlib.contextmanager
def _quiet_transformers():
    """No progress bars or advice on stderr while loading: `llmc export` reports its own stages."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.enable_progress_bar()
        transformers.logging.set_verbosity(verbosity)


# transformers' names for layers that keep keys and values (`layer_types`); hybrid models mix in
# others (convolution, state-space, linear attention) whose state the paged engine has no place for.
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")


def _check_layer_types(config, config_path: Path) -> None:
    types = getattr(config, "layer_types", None) or ()
    other = next(((i, t) for i, t in enumerate(types) if t not in _ATTENTION_LAYER_TYPES), None)
    if other is not None:
        raise LlmcError(f"{config_path}: layer {other[0]} is a {other[1]!r} layer (layer_types), not attention; "
                        "llmc's paged engine carries only attention layers' keys and values")


def _cache_geometry(model: torch.nn.Module, folder: Path, num_layers: int) -> tuple[int, int]:
    """Kv heads and head dim as the model writes its cache (one step of two tokens), checked to
    be the plain per-layer keys and values the decoder-with-past interface carries."""
    cache = _cache([])
    ids = torch.zeros(1, 2, dtype=torch.int64)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(2)[None],
                  cache=cache, use_cache=True)
    except Exception as e:  # a model transformers builds but cannot step with a plain cache
        raise LlmcError(f"{folder}: {type(model).__name__} does not run with a key/value cache "
                        f"({type(e).__name__}: {first_line(e, 200)})") from None
    attention = _attention_modules(model)
    shapes = []
    for i, layer in enumerate(cache.layers):
        kind = type(attention[i]).__name__ if i < len(attention) else "attention"
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or not isinstance(values, torch.Tensor) \
                or values.dim() != 4:
            raise LlmcError(f"{folder}: layer {i} ({kind}) keeps no [batch, heads, positions, head dim] "
                            f"keys and values ({type(layer).__name__}); llmc's paged attention needs them")
        if keys.shape[-1] != values.shape[-1] or keys.shape[1] != values.shape[1]:
            raise LlmcError(f"{folder}: layer {i} ({kind}) caches keys of {keys.shape[1]} x {keys.shape[-1]} "
                            f"(heads x head dim) and values of {values.shape[1]} x {values.shape[-1]}, as "
                            "multi-head latent attention does; llmc's paged attention needs keys and values of "
                            "one shape")
        shapes.append((keys.shape[1], keys.shape[-1]))
    if len(cache.layers) != num_layers:
        raise LlmcError(f"{folder}: {type(model).__name__} cached {len(cache.layers)} layers of its "
                        f"{num_layers}; llmc's paged attention needs keys and values in every layer")
    if len(set(shapes)) != 1:
        layer = next(i for i, s in enumerate(shapes) if s != shapes[0])
        raise LlmcError(f"{folder}: layer {layer} caches {shapes[layer][0]} heads x {shapes[layer][1]}, layer 0 "
                        f"{shapes[0][0]} x {shapes[0][1]}; llmc's paged attention needs one shape for every layer")
    return shapes[0]


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each decoder layer's attention module, in order (for naming a layer's kind): transformers
    names their classes `<Family>Attention`."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]
