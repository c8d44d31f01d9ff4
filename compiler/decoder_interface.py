"""Recognize the decoder-with-past interface and the model geometry of an ONNX graph.

The interface is the de-facto standard that Optimum, onnxruntime-genai and `llmc export` write:
inputs ``input_ids``, ``attention_mask``, optional ``position_ids``,
``past_key_values.{i}.key|value`` [batch, kv_heads, past, head_dim]; outputs ``logits``
[batch, seq, vocab] and ``present.{i}.key|value``. Geometry that the interface does not show
(attention heads, maximum positions) comes from the graph's ``llmc.*`` metadata, written by
`llmc export`, or from a Hugging Face ``config.json`` beside the file.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

from llmc.errors import LlmcError

_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
_PRESENT = re.compile(r"present\.(\d+)\.(key|value)$")
_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
           onnx.TensorProto.BFLOAT16: "bfloat16"}


@dataclass(frozen=True)
class Geometry:
    """The shape of a decoder: what the runtime needs to size caches and validate requests."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int


@dataclass(frozen=True)
class DecoderInterface:
    """A recognized decoder graph: its geometry, cache dtype and optional inputs."""

    geometry: Geometry
    dtype: str
    has_position_ids: bool
    sliding_window: int | None = None  # attention limited to the last N keys (Mistral)

    def to_dict(self) -> dict:
        return {"geometry": asdict(self.geometry), "dtype": self.dtype,
                "has_position_ids": self.has_position_ids, "sliding_window": self.sliding_window}


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
    kv_heads, head_dim = (_static_dim(past, axis, fault) for axis in (1, 3))
    vocab = _static_dim(outputs["logits"], 2, fault)
    elem_type = past.type.tensor_type.elem_type
    if elem_type not in _DTYPES:
        raise LlmcError(f"{fault}: unsupported cache element type "
                        f"{onnx.TensorProto.DataType.Name(elem_type)}")

    facts = _geometry_facts(model, source)
    missing = [k for k in ("num_heads", "max_positions") if k not in facts]
    if missing:
        raise LlmcError(f"{source}: cannot tell the model's {' and '.join(missing)}: export it with "
                        "`llmc export` or put its Hugging Face config.json beside it")
    geometry = Geometry(num_layers=num_layers, num_heads=facts["num_heads"], num_kv_heads=kv_heads,
                        head_dim=head_dim, vocab_size=vocab, max_positions=facts["max_positions"])
    if geometry.num_heads % geometry.num_kv_heads:
        raise LlmcError(f"{source}: {geometry.num_heads} attention heads is not a multiple of "
                        f"{geometry.num_kv_heads} kv heads")
    return DecoderInterface(geometry, _DTYPES[elem_type], "position_ids" in inputs,
                            facts.get("sliding_window"))


def geometry_metadata(geometry: Geometry, sliding_window: int | None = None) -> dict[str, str]:
    """The ``llmc.*`` metadata entries that `recognize_decoder` reads back."""
    entries = {"llmc.num_heads": str(geometry.num_heads),
               "llmc.max_positions": str(geometry.max_positions)}
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


def _geometry_facts(model: onnx.ModelProto, source: Path) -> dict[str, int]:
    facts: dict[str, int] = {}
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
        # Mistral windows every layer; Qwen2 only when use_sliding_window says so.
        if isinstance(hf.get("sliding_window"), int) and hf.get("use_sliding_window", True):
            facts["sliding_window"] = hf["sliding_window"]
    # The graph's own metadata wins over a config file that may belong to another export.
    for prop in model.metadata_props:
        if prop.key in ("llmc.num_heads", "llmc.max_positions", "llmc.sliding_window"):
            facts[prop.key.removeprefix("llmc.")] = int(prop.value)
    return facts
