"""tests/exporters.py: each exporter's graph of each HF family equals transformers' forward.

The reference is the transformers model itself, called with a `DynamicCache` built the documented
way (`DynamicCache(ddp_cache_data=...)`), not the wrapper the exporters trace. Each step compares
logits and every present within 1e-4: a prefill (batch 2, sequence 5, empty past) and a decode step
(sequence 1) whose past is the prefill's presents (ONNX's own for the ONNX side, transformers' for
the reference). Row 1 of the attention mask has a hole, so the padding mask is exercised without
rows that attend to nothing (whose output is implementation-defined).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from exporters import EXPORTERS, export_decoder, hf_geometry
from hf_checkpoints import FAMILIES, hf_model
from transformers.cache_utils import DynamicCache

from llmc.formats.decoder_interface import recognize_decoder
from llmc.compiler.export import io_names

ATOL = 1e-4
BATCH, PREFILL = 2, 5


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, hf_checkpoint):
    """(name, transformers reference steps) of one family."""
    return request.param, _reference(hf_checkpoint(request.param))


@pytest.fixture(scope="module", params=EXPORTERS)
def exported(request, family, hf_export):
    """(the family's export by this exporter, made once per session: tests/conftest.py, the
    reference steps)."""
    name, reference = family
    return hf_export(name, request.param), reference


def _step_inputs(geometry, seq: int, past: int, seed: int) -> dict[str, np.ndarray]:
    gen = torch.Generator().manual_seed(seed)
    mask = np.ones((BATCH, past + seq), np.int64)
    mask[1, 1] = 0
    feeds = {"input_ids": torch.randint(0, geometry.vocab_size, (BATCH, seq), generator=gen).numpy(),
             "attention_mask": mask,
             "position_ids": np.tile(np.arange(past, past + seq), (BATCH, 1))}
    return feeds


def _transformers_step(model, feeds: dict, past: list[np.ndarray]) -> list[np.ndarray]:
    pairs = [(torch.from_numpy(k), torch.from_numpy(v)) for k, v in zip(past[0::2], past[1::2])]
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(feeds["input_ids"]),
                    attention_mask=torch.from_numpy(feeds["attention_mask"]),
                    position_ids=torch.from_numpy(feeds["position_ids"]),
                    cache=DynamicCache(ddp_cache_data=pairs), use_cache=True)
    presents = [t for layer in out.cache.layers for t in (layer.keys, layer.values)]
    return [out.logits.numpy()] + [t.numpy() for t in presents]


def _reference(folder) -> dict:
    model = hf_model(folder)
    geometry = hf_geometry(model.config)
    empty_shape = (BATCH, geometry.num_kv_heads, 0, geometry.head_dim)
    empty = [np.zeros(empty_shape, np.float32)] * (2 * geometry.num_layers)
    prefill = _step_inputs(geometry, PREFILL, 0, seed=1)
    prefill_out = _transformers_step(model, prefill, empty)
    decode = _step_inputs(geometry, 1, PREFILL, seed=2)
    decode_out = _transformers_step(model, decode, prefill_out[1:])
    return {"geometry": geometry, "empty": empty, "prefill": (prefill, prefill_out),
            "decode": (decode, decode_out)}


def _assert_close(got: list[np.ndarray], want: list[np.ndarray], names: list[str], step: str) -> None:
    assert len(got) == len(want)
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, f"{step} {name}: shape {g.shape} != {w.shape}"
        np.testing.assert_allclose(g, w, atol=ATOL, rtol=0, err_msg=f"{step} {name}")


def _check_steps(path, reference) -> None:
    """Run the prefill and the decode step in onnxruntime and compare them with the reference."""
    input_names, output_names = io_names(reference["geometry"].num_layers)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds, want = reference["prefill"]
    prefill = session.run(output_names, {**feeds, **dict(zip(input_names[3:], reference["empty"]))})
    _assert_close(prefill, want, output_names, "prefill")
    feeds, want = reference["decode"]
    decode = session.run(output_names, {**feeds, **dict(zip(input_names[3:], prefill[1:]))})
    _assert_close(decode, want, output_names, "decode")


def test_prefill_and_decode_equal_transformers(exported):
    _check_steps(*exported)


def test_interface_and_geometry_metadata(exported):
    path, reference = exported
    geometry = reference["geometry"]
    model = onnx.load(str(path))
    input_names, output_names = io_names(geometry.num_layers)
    # Same names; Optimum's GPT-2 lists the past before attention_mask (feeds go by name).
    assert sorted(v.name for v in model.graph.input) == sorted(input_names)
    assert [v.name for v in model.graph.output] == output_names
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    caches = [v for v in model.graph.input if v.name.startswith("past_key_values.")]
    for value in caches + list(model.graph.output)[1:]:
        dims = value.type.tensor_type.shape.dim
        assert [d.dim_value for d in dims][1::2] == [geometry.num_kv_heads, geometry.head_dim], value.name
        assert not dims[0].HasField("dim_value") and not dims[2].HasField("dim_value"), value.name
    # Read from the graph's metadata alone: no config.json lies beside the file.
    assert not (path.parent / "config.json").exists()
    assert recognize_decoder(model, path).geometry == geometry


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_sdpa_attention_exports_equal_transformers(exporter, hf_checkpoint, hf_export):
    """transformers' default attention (sdpa) exports too; one family keeps this quick."""
    _check_steps(hf_export("llama", exporter, "sdpa"), _reference(hf_checkpoint("llama")))


def test_unknown_exporter_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown exporter"):
        export_decoder(tmp_path, "onnxscript", tmp_path / "model.onnx")
