"""Recognize the decoder-with-past interface and the model geometry of an ONNX graph.

The interface is the de-facto standard that Optimum, onnxruntime-genai and `llmc export` write:
inputs ``input_ids``, ``attention_mask``, optional ``position_ids``,
``past_key_values.{i}.key|value`` [batch, kv_heads, past, head_dim]; outputs ``logits``
[batch, seq, vocab] and ``present.{i}.key|value``. Geometry that the interface does not show
(attention heads, maximum positions, sliding windows) comes from the graph's ``llmc.*``
metadata, written by `llmc export`, or from a Hugging Face ``config.json`` beside the file.

Sliding windows: ``llmc.sliding_window`` (an int) when every layer has the same window,
``llmc.layer_windows`` (a JSON list, one int per layer, 0 = full attention) when layers differ
(Gemma-2/3 alternate local and global layers). A window W lets a token see the last W positions,
itself included, as transformers' ``sliding_window`` does.
"""

from __future__ import annotations

import json
import operator
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import onnx

from llmc.errors import LlmcError
from llmc.formats.manifest import Geometry

_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"present\.(\d+)\.(key|value)$")
_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
           onnx.TensorProto.BFLOAT16: "bfloat16"}


@dataclass(frozen=True)
class DecoderInterface:
    """A recognized decoder graph: its geometry, cache dtype and optional inputs."""

    geometry: Geometry
    dtype: str
    has_position_ids: bool
    sliding_window: int | None = None  # every layer's attention limited to the last N keys (Mistral)
    layer_windows: tuple[int, ...] | None = None  # when layers differ: each one's window, 0 = full

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's attention window, 0 for full attention."""
        if self.layer_windows is not None:
            return self.layer_windows
        return (self.sliding_window or 0,) * self.geometry.num_layers

    def to_dict(self) -> dict:
        return {"geometry": asdict(self.geometry), "dtype": self.dtype,
                "has_position_ids": self.has_position_ids, "sliding_window": self.sliding_window,
                "layer_windows": None if self.layer_windows is None else list(self.layer_windows)}


def recognize_decoder(model: onnx.ModelProto, source: Path) -> DecoderInterface:
    """Check that `model` is a decoder with past and read its geometry.

    Args:
        model: the graph (weights need not be loaded).
        source: the file it came from; named in errors, and its folder is searched for config.json.
    """
    inputs = {i.name: i for i in model.graph.input}
    outputs = {o.name: o for o in model.graph.output}
    fault = f"{source}: not a decoder with past"
    for name in ("input_ids", "attention_mask"):
        if name not in inputs:
            raise LlmcError(f"{fault}: no input '{name}'")
    if "logits" not in outputs:
        raise LlmcError(f"{fault}: no output 'logits'")

    num_layers = _count_layers(inputs, _PAST, "input", fault)
    if _count_layers(outputs, _PRESENT, "output", fault) != num_layers:
        raise LlmcError(f"{fault}: {num_layers} past inputs but a different number of present outputs")

    past = inputs["past_key_values.0.key"]
    facts = _geometry_facts(model, source)
    kv_heads = _static_dim(past, 1, fault)
    # onnxruntime-genai's builder leaves the head size symbolic; its genai_config.json says it.
    dims = past.type.tensor_type.shape.dim
    head_dim = facts["head_dim"] if "head_dim" in facts and len(dims) == 4 and not dims[3].HasField("dim_value") \
        else _static_dim(past, 3, fault)
    vocab = _static_dim(outputs["logits"], 2, fault)
    elem_type = past.type.tensor_type.elem_type
    if elem_type not in _DTYPES:
        raise LlmcError(f"{fault}: unsupported cache element type "
                        f"{onnx.TensorProto.DataType.Name(elem_type)}")

    missing = [k for k in ("num_heads", "max_positions") if k not in facts]
    if missing:
        raise LlmcError(f"{source}: cannot tell the model's {' and '.join(missing)}: export it with "
                        "`llmc export` or put its Hugging Face config.json beside it")
    geometry = Geometry(num_layers=num_layers, num_heads=facts["num_heads"], num_kv_heads=kv_heads,
                        head_dim=head_dim, vocab_size=vocab, max_positions=facts["max_positions"])
    if geometry.num_heads % geometry.num_kv_heads:
        raise LlmcError(f"{source}: {geometry.num_heads} attention heads is not a multiple of "
                        f"{geometry.num_kv_heads} kv heads")
    windows = facts.get("layer_windows")
    if windows is not None and len(windows) != num_layers:
        raise LlmcError(f"{source}: {len(windows)} layer windows for {num_layers} layers")
    if windows is not None and len(set(windows)) == 1:  # one window for all: say it once
        facts["sliding_window"], windows = windows[0] or None, None
    return DecoderInterface(geometry, _DTYPES[elem_type], "position_ids" in inputs,
                            facts.get("sliding_window") or None, None if windows is None else tuple(windows))


def geometry_metadata(geometry: Geometry, sliding_window: int | Sequence[int] | None = None) -> dict[str, str]:
    """The ``llmc.*`` metadata entries that `recognize_decoder` reads back.

    Args:
        geometry: the model's geometry.
        sliding_window: one window for every layer, or one per layer (0: full attention), or None.
    """
    entries = {"llmc.num_heads": str(geometry.num_heads),
               "llmc.max_positions": str(geometry.max_positions)}
    if sliding_window is not None and not isinstance(sliding_window, int):
        windows = [int(w) for w in sliding_window]
        if len(windows) != geometry.num_layers:
            raise LlmcError(f"sliding windows: {len(windows)} given for {geometry.num_layers} layers")
        if len(set(windows)) > 1:
            entries["llmc.layer_windows"] = json.dumps(windows)
            return entries
        sliding_window = windows[0] or None
    if sliding_window is not None:
        entries["llmc.sliding_window"] = str(sliding_window)
    return entries


def _count_layers(values: dict, pattern: re.Pattern, kind: str, fault: str) -> int:
    found = {(int(m[1]), m[2]) for name in values if (m := pattern.match(name))}
    layers = len({layer for layer, _ in found})
    expected = {(layer, part) for layer in range(layers) for part in ("key", "value")}
    if not found:
        raise LlmcError(f"{fault}: no {kind}s named like '{pattern.pattern[:-1]}'")
    if found != expected:
        first_missing = sorted(expected - found)[0] if expected - found else sorted(found)[-1]
        raise LlmcError(f"{fault}: {kind}s for layer {first_missing[0]} are incomplete")
    return layers


def _static_dim(value: onnx.ValueInfoProto, axis: int, fault: str) -> int:
    dims = value.type.tensor_type.shape.dim
    if len(dims) <= axis or not dims[axis].HasField("dim_value"):
        raise LlmcError(f"{fault}: '{value.name}' needs a fixed size on axis {axis}")
    return dims[axis].dim_value


def _geometry_facts(model: onnx.ModelProto, source: Path) -> dict:
    facts: dict = {}
    config = source.parent / "config.json"
    if config.is_file():
        try:
            hf = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise LlmcError(f"{config}: not valid JSON ({exc})") from None
        for key, names in (("num_heads", ("num_attention_heads", "n_head")),
                           ("max_positions", ("max_position_embeddings", "n_positions"))):
            for name in names:
                if isinstance(hf.get(name), int):
                    facts[key] = hf[name]
                    break
        windows = config_windows(hf)
        if windows is not None:
            facts["layer_windows"] = windows
    genai = source.parent / "genai_config.json"  # onnxruntime-genai's builder writes no config.json
    if not config.is_file() and genai.is_file():
        try:
            decoder = json.loads(genai.read_text())["model"]
            decoder, context = decoder["decoder"], decoder.get("context_length")
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise LlmcError(f"{genai}: not a genai config ({exc})") from None
        for key, value in (("num_heads", decoder.get("num_attention_heads")), ("max_positions", context),
                           ("head_dim", decoder.get("head_size"))):
            if isinstance(value, int) and value > 0:
                facts[key] = value
        window, layers = decoder.get("sliding_window") or {}, decoder.get("num_hidden_layers")
        if isinstance(window, dict) and isinstance(window.get("window_size"), int) and isinstance(layers, int):
            local = window.get("layers") or range(layers)  # no list: every layer
            facts["layer_windows"] = [window["window_size"] if i in local else 0 for i in range(layers)]
    # The graph's own metadata wins over a config file that may belong to another export.
    for prop in model.metadata_props:
        if prop.key in ("llmc.num_heads", "llmc.max_positions", "llmc.sliding_window"):
            facts[prop.key.removeprefix("llmc.")] = int(prop.value)
            if prop.key == "llmc.sliding_window":
                facts.pop("layer_windows", None)
        elif prop.key == "llmc.layer_windows":
            try:
                windows = json.loads(prop.value)
                facts["layer_windows"] = [operator.index(w) for w in windows]
            except (json.JSONDecodeError, TypeError):
                raise LlmcError(f"{source}: metadata llmc.layer_windows is not a list of ints: "
                                f"{prop.value[:80]}") from None
            facts.pop("sliding_window", None)
    return facts


# Layers that alternate local and global attention in configs written without `layer_types`
# (transformers' defaults): every n-th layer is global.
_GLOBAL_EVERY = {"gemma2": 2, "gemma3_text": 6, "gemma3": 6}


def config_windows(hf: dict) -> list[int] | None:
    """Each layer's window from a Hugging Face config (0: full attention); None without windows.

    transformers 5 writes `layer_types` ("sliding_attention" / "full_attention") for the
    families that mix them (Qwen2, Gemma-2/3); Mistral's `sliding_window` covers every layer;
    Qwen2 windows only when `use_sliding_window`, and then only layers from `max_window_layers`.
    """
    window, layers = hf.get("sliding_window"), hf.get("num_hidden_layers")
    if not isinstance(window, int) or window <= 0 or not isinstance(layers, int):
        return None
    types = hf.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return [window if t == "sliding_attention" else 0 for t in types]
    if hf.get("use_sliding_window", True) is False:
        return None
    if hf.get("model_type") in _GLOBAL_EVERY:
        every = hf.get("sliding_window_pattern") or _GLOBAL_EVERY[hf["model_type"]]
        return [0 if (i + 1) % every == 0 else window for i in range(layers)]
    first = hf.get("max_window_layers", 0) if "use_sliding_window" in hf else 0
    return [window if i >= first else 0 for i in range(layers)]
