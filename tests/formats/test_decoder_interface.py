"""Sliding windows in the decoder interface: the metadata `llmc export` writes, and Hugging Face
configs of every family that windows attention, read back as one window per layer."""

import json

import onnx
import pytest
from onnx import TensorProto, helper

from llmc.formats.decoder_interface import Geometry, geometry_metadata, recognize_decoder
from llmc.errors import LlmcError

GEOMETRY = Geometry(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=10, max_positions=64)


def decoder_graph(metadata=None) -> onnx.ModelProto:
    """The interface alone (recognize_decoder reads inputs, outputs and metadata, not nodes)."""
    value = helper.make_tensor_value_info
    inputs = [value("input_ids", TensorProto.INT64, ["b", "s"]),
              value("attention_mask", TensorProto.INT64, ["b", "t"]),
              value("position_ids", TensorProto.INT64, ["b", "s"])]
    outputs = [value("logits", TensorProto.FLOAT, ["b", "s", GEOMETRY.vocab_size])]
    for i in range(GEOMETRY.num_layers):
        for part in ("key", "value"):
            inputs.append(value(f"past_key_values.{i}.{part}", TensorProto.FLOAT, ["b", 2, "p", 16]))
            outputs.append(value(f"present.{i}.{part}", TensorProto.FLOAT, ["b", 2, "t", 16]))
    model = helper.make_model(helper.make_graph([], "decoder", inputs, outputs))
    for key, text in (metadata or {}).items():
        model.metadata_props.add(key=key, value=text)
    return model


@pytest.mark.parametrize("windows,entries,sliding,per_layer", [
    (None, {}, None, (0, 0, 0)),
    (4, {"llmc.sliding_window": "4"}, 4, (4, 4, 4)),
    ([4, 4, 4], {"llmc.sliding_window": "4"}, 4, (4, 4, 4)),
    ([0, 0, 0], {}, None, (0, 0, 0)),
    ([4, 0, 4], {"llmc.layer_windows": "[4, 0, 4]"}, None, (4, 0, 4)),
])
def test_metadata_round_trip(tmp_path, windows, entries, sliding, per_layer):
    metadata = geometry_metadata(GEOMETRY, windows)
    assert {k: v for k, v in metadata.items() if "window" in k} == entries
    interface = recognize_decoder(decoder_graph(metadata), tmp_path / "model.onnx")
    assert (interface.sliding_window, interface.windows) == (sliding, per_layer)
    assert interface.to_dict()["layer_windows"] == (None if sliding or not any(per_layer) else list(per_layer))


def hf_config(**fields):
    return {"num_attention_heads": 4, "max_position_embeddings": 64, "num_hidden_layers": 3, **fields}


@pytest.mark.parametrize("config,windows", [
    (hf_config(model_type="mistral", sliding_window=4), (4, 4, 4)),
    (hf_config(model_type="mistral", sliding_window=None), (0, 0, 0)),
    (hf_config(model_type="llama"), (0, 0, 0)),
    # Qwen2 as transformers 5 writes it, and as older configs do (no layer_types).
    (hf_config(model_type="qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=1,
               layer_types=["full_attention", "sliding_attention", "sliding_attention"]), (0, 8, 8)),
    (hf_config(model_type="qwen2", sliding_window=8, use_sliding_window=False, max_window_layers=28), (0, 0, 0)),
    (hf_config(model_type="qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=2), (0, 0, 8)),
    # Gemma-2 and Gemma-3: local layers alternate with global ones.
    (hf_config(model_type="gemma2", sliding_window=4,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"]), (4, 0, 4)),
    (hf_config(model_type="gemma2", sliding_window=4), (4, 0, 4)),
    (hf_config(model_type="gemma3_text", sliding_window=4, sliding_window_pattern=2), (4, 0, 4)),
])
def test_windows_from_a_hugging_face_config(tmp_path, config, windows):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert recognize_decoder(decoder_graph(), tmp_path / "model.onnx").windows == windows


def test_gemma2_config_of_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(num_hidden_layers=3, sliding_window=4, num_attention_heads=4,
                                       max_position_embeddings=64)
    (tmp_path / "config.json").write_text(config.to_json_string())
    assert recognize_decoder(decoder_graph(), tmp_path / "model.onnx").windows == (4, 0, 4)


def test_graph_metadata_wins_over_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config(model_type="mistral", sliding_window=4)))
    model = decoder_graph(geometry_metadata(GEOMETRY, [0, 2, 0]))
    assert recognize_decoder(model, tmp_path / "model.onnx").windows == (0, 2, 0)


@pytest.mark.parametrize("text,message", [
    ("[4, 0]", "2 layer windows for 3 layers"),
    ("four", "metadata llmc.layer_windows is not a list of ints"),
])
def test_bad_layer_windows_are_named(tmp_path, text, message):
    model = decoder_graph({**geometry_metadata(GEOMETRY), "llmc.layer_windows": text})
    with pytest.raises(LlmcError, match=message):
        recognize_decoder(model, tmp_path / "model.onnx")
