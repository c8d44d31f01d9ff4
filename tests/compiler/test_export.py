"""Export parity: the ONNX graph equals PyTorch at several (batch, seq, past) shapes."""

import logging
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from llmc.errors import LlmcError
from llmc.formats.decoder_interface import recognize_decoder
from llmc.compiler.export import _FlatDecoder, _initializer, _ort_value, export, io_names, model_geometry, sample_inputs
from llmc.formats.onnx_io import save_serialized
from llmc.models import load_model

TOLERANCE = 1e-4  # fp32
SHAPES = [(1, 1, 0), (2, 7, 0), (3, 1, 9), (2, 4, 5), (1, 16, 3)]  # (batch, seq, past)


def written(graph_and_weights, path) -> bytes:
    """The file `llmc export` writes for a trace (its graph and weights), as bytes."""
    save_serialized(*graph_and_weights, path, metadata={})
    return path.read_bytes()


# "auto" is the TorchScript exporter at these sizes; torch.export's is what models past 2 GB take.
@pytest.fixture(scope="module", params=[("tiny-llama", "auto"), ("tiny-gpt2", "auto"), ("tiny-llama", "dynamo")],
                ids=lambda p: "-".join(p))
def exported(request, tmp_path_factory):
    name, exporter = request.param
    loaded = load_model(name)
    path = tmp_path_factory.mktemp(name) / "model.onnx"
    check = export(loaded, path, exporter=exporter)
    return loaded, path, check


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_the_parity_check_feeds_each_weight_as_it_is_written(dtype):
    """The check feeds the weights as onnxruntime values over the bytes the file gets: same type,
    shape and values (bfloat16 included, which NumPy has no type for)."""
    tensor = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) - 7.5).to(dtype)
    header, data = _initializer("w", tensor)
    value = _ort_value(header, data)
    assert value.shape() == [2, 3, 4]
    assert value.data_type() == {torch.float32: "tensor(float)", torch.float16: "tensor(float16)",
                                 torch.bfloat16: "tensor(bfloat16)", torch.int64: "tensor(int64)"}[dtype]
    assert value.data_ptr() == np.frombuffer(data, np.uint8).ctypes.data  # the written bytes, not a copy
    if dtype != torch.bfloat16:  # onnxruntime hands no bfloat16 back to NumPy
        assert torch.equal(torch.from_numpy(value.numpy().copy()), tensor)


def test_weights_past_one_protobuf_go_to_a_data_file(monkeypatch, tmp_path, caplog):
    """Past the threshold the TorchScript export writes its weights to `<name>.data` (the graph
    stays small, its inputs the decoder's interface, the same graph as below the threshold) and
    the parity check runs on the tensors being written; nothing is logged as invalid on the way
    (the graph's nodes read weights it does not declare until they are written); a stale
    temporary never stays."""
    monkeypatch.setattr("llmc.compiler.export.EXTERNAL_DATA_THRESHOLD", 1000)
    with caplog.at_level(logging.WARNING):
        check = export(load_model("tiny-llama"), tmp_path / "model.onnx", exporter="torchscript")
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("onnx_ir")]
    assert check.max_abs < TOLERANCE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert (tmp_path / "model.onnx").stat().st_size < (tmp_path / "model.onnx.data").stat().st_size / 10
    graph = onnx.load(tmp_path / "model.onnx", load_external_data=False)
    assert recognize_decoder(graph, tmp_path / "model.onnx").geometry.num_layers == 4
    monkeypatch.undo()
    export(load_model("tiny-llama"), tmp_path / "inline.onnx", exporter="torchscript", check=False)
    inline = onnx.load(tmp_path / "inline.onnx")
    assert [i.name for i in graph.graph.input] == [i.name for i in inline.graph.input]
    assert sorted(t.name for t in graph.graph.initializer) == sorted(t.name for t in inline.graph.initializer)
    assert len(graph.graph.node) == len(inline.graph.node)
    with pytest.raises(LlmcError, match="--exporter: 'jit' is not one of auto, torchscript, dynamo"):
        export(load_model("tiny-llama"), tmp_path / "other.onnx", exporter="jit")


def test_parity_check_reports_small_error(exported):
    _, _, check = exported
    assert check.max_abs < TOLERANCE


@pytest.mark.parametrize("batch,seq,past", SHAPES)
def test_logits_and_presents_match_pytorch(exported, batch, seq, past):
    loaded, path, _ = exported
    geometry = model_geometry(loaded.model)
    inputs = sample_inputs(geometry, batch, seq, past, seed=batch * 100 + seq * 10 + past)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {name: t.numpy() for name, t in inputs.items()})
    with torch.no_grad():
        want = [t.numpy() for t in _FlatDecoder(loaded.model)(*inputs.values())]
    assert got[0].shape == (batch, seq, geometry.vocab_size)
    assert got[1].shape == (batch, geometry.num_kv_heads, past + seq, geometry.head_dim)
    for name, g, w in zip(io_names(geometry.num_layers)[1], got, want):
        np.testing.assert_allclose(g, w, atol=TOLERANCE, rtol=0, err_msg=name)


def test_left_padded_rows_match_unpadded(exported):
    loaded, path, _ = exported
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    geometry = model_geometry(loaded.model)
    full = sample_inputs(geometry, 1, 6, 0, seed=3)
    padded = {k: v.clone() for k, v in full.items()}
    padded["input_ids"] = torch.cat([torch.zeros(1, 2, dtype=torch.int64), full["input_ids"]], 1)
    padded["attention_mask"] = torch.tensor([[0, 0] + [1] * 6])
    padded["position_ids"] = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5]])
    for name in io_names(geometry.num_layers)[0][3:]:
        padded[name] = full[name]
    want = session.run(["logits"], {k: v.numpy() for k, v in full.items()})[0]
    got = session.run(["logits"], {k: v.numpy() for k, v in padded.items()})[0]
    np.testing.assert_allclose(got[:, 2:], want, atol=TOLERANCE, rtol=0)
    assert np.isfinite(got).all()


def test_interface_names_dims_and_metadata(exported):
    loaded, path, _ = exported
    model = onnx.load(str(path))
    geometry = model_geometry(loaded.model)
    inputs, outputs = io_names(geometry.num_layers)
    assert [i.name for i in model.graph.input] == inputs
    assert [o.name for o in model.graph.output] == outputs
    past_dims = model.graph.input[3].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in past_dims] == [
        "batch", geometry.num_kv_heads, "past_sequence", geometry.head_dim]
    interface = recognize_decoder(model, path)
    assert interface.geometry == geometry
    assert interface.dtype == "float32" and interface.has_position_ids
    metadata = {p.key: p.value for p in model.metadata_props}
    assert loaded.tokenizer.to_json() == metadata["llmc.tokenizer"]


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3", "gemma2", "gpt_neox"])
def test_skipping_torchs_whole_graph_shape_inference_writes_the_same_graph(family, tmp_path, monkeypatch):
    # The TorchScript trace skips torch's two whole-graph shape inferences (they copy every weight
    # to annotate types llmc infers again): the serialized graph must be the one they would give.
    import contextlib

    from hf_checkpoints import write_hf_checkpoint

    from llmc.compiler import export as export_module

    loaded = load_model(write_hf_checkpoint(tmp_path / family, family))
    geometry = model_geometry(loaded.model)
    skipped = written(export_module._trace_torchscript(loaded.model, geometry), tmp_path / "skipped.onnx")
    monkeypatch.setattr(export_module, "_without_whole_graph_shape_inference", contextlib.nullcontext)
    assert written(export_module._trace_torchscript(loaded.model, geometry), tmp_path / "inferred.onnx") == skipped


def _repeated_and_full(model, tmp_path) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The trace of `model`'s first two layers with the second repeated for the rest, and the
    trace of all its layers, as the files `llmc export` would write."""
    from llmc.compiler import export as export_module

    graph, layers, tensors = _short_trace(model)
    assert export_module._repeat_layer(graph, layers, tensors)
    repeated = onnx.load_from_string(written(export_module._with_weights(graph, _FlatDecoder(model)),
                                             tmp_path / "repeated.onnx"))
    full = onnx.load_from_string(written(export_module._with_weights(
        export_module._trace(model, model_geometry(model)), _FlatDecoder(model)), tmp_path / "full.onnx"))
    return repeated, full


def _assert_same_outputs(geometry, *models: onnx.ModelProto) -> None:
    sessions = [ort.InferenceSession(m.SerializeToString()) for m in models]
    for batch, seq, past in [(2, 7, 0), (3, 1, 9)]:
        feeds = {k: v.numpy() for k, v in sample_inputs(geometry, batch, seq, past, seed=1).items()}
        got, want = (s.run(None, feeds) for s in sessions)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


def _op_counts(model: onnx.ModelProto) -> Counter:
    """Op types of a graph's nodes, without the Identity nodes that only rename a weight."""
    weights = {t.name for t in model.graph.initializer}
    return Counter(n.op_type for n in model.graph.node
                   if not (n.op_type == "Identity" and n.input[0] in weights))


def test_a_model_traced_with_two_layers_and_repeated_equals_its_full_trace(tmp_path):
    """tiny-llama (4 layers) is traced with 2 and its second layer copied for layers 2 and 3:
    same interface, weights and op counts as the trace of all 4, and onnxruntime gives the same
    outputs for both (prefill and decode shapes)."""
    loaded = load_model("tiny-llama")
    geometry = model_geometry(loaded.model)
    assert geometry.num_layers == 4
    repeated, full = _repeated_and_full(loaded.model, tmp_path)
    assert [i.name for i in repeated.graph.input] == [i.name for i in full.graph.input] == io_names(4)[0]
    assert [o.name for o in repeated.graph.output] == [o.name for o in full.graph.output] == io_names(4)[1]
    # One initializer per parameter (a linear's transposed, named for its Transpose); the full
    # trace gives weights equal to another's (its layer norms, at ones) as Identity nodes.
    shapes = [Counter(tuple(t.dims) for t in m.graph.initializer) for m in (repeated, full)]
    assert not shapes[1] - shapes[0]
    assert len(repeated.graph.initializer) == len(list(loaded.model.parameters()))
    assert _op_counts(repeated) == _op_counts(full)
    onnx.checker.check_model(repeated)
    # What `llmc export` writes for it.
    from llmc.compiler import export as export_module

    exported = written(export_module._trace_torchscript(loaded.model, geometry), tmp_path / "exported.onnx")
    assert exported == (tmp_path / "repeated.onnx").read_bytes()
    _assert_same_outputs(geometry, repeated, full)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3", "gemma", "gpt_neox"])
def test_each_familys_layers_are_repeated_by_structure(family, tmp_path):
    """Real-shape checkpoints of each layer layout (fused qkv, (1+w) norm, parallel residual with
    LayerNorm biases, a uniform window): the repeated graph computes what the full trace does."""
    from hf_checkpoints import write_hf_checkpoint

    loaded = load_model(write_hf_checkpoint(tmp_path / family, family, real_shape=True))
    layers = loaded.model.num_layers
    assert layers > 2  # a layer past the two traced, repeated
    repeated, full = _repeated_and_full(loaded.model, tmp_path)
    assert len(repeated.graph.output) == len(full.graph.output) == 1 + 2 * layers  # logits, each layer's K and V
    assert _op_counts(repeated) == _op_counts(full)
    _assert_same_outputs(model_geometry(loaded.model), repeated, full)


def _short_trace(model):
    from llmc.compiler import export as export_module

    short = export_module._first_layers(model, 2)
    flat = _FlatDecoder(model)
    tensors = {n for n, _ in [*flat.named_parameters(), *flat.named_buffers()]}
    return export_module._trace(short, model_geometry(short)), export_module._layer_boundaries(flat), tensors


def _reader(graph: onnx.ModelProto, weight: str) -> onnx.NodeProto:
    return next(n for n in graph.graph.node if weight in n.input)


def test_a_layer_output_read_outside_the_layer_is_not_repeated():
    """A node outside the layer reading one of its inner values: the graph is left as traced."""
    from llmc.compiler import export as export_module

    graph, layers, tensors = _short_trace(load_model("tiny-llama").model)
    inner = _reader(graph, "model.model.layers.1.mlp.down_proj.weight").output[0]
    graph.graph.output.append(onnx.helper.make_tensor_value_info("peek", onnx.TensorProto.FLOAT, None))
    graph.graph.node.append(onnx.helper.make_node("Identity", [inner], ["peek"], name="peek"))
    before = graph.SerializeToString()
    assert not export_module._repeat_layer(graph, layers, tensors)
    assert graph.SerializeToString() == before


def test_a_layer_reading_the_layer_befores_weight_is_not_repeated():
    """The last layer reads a weight of the layer before: it is no pattern for the others."""
    from llmc.compiler import export as export_module

    graph, layers, tensors = _short_trace(load_model("tiny-llama").model)
    reader = _reader(graph, "model.model.layers.1.mlp.down_proj.weight")
    reader.input[:] = ["model.model.layers.0.mlp.down_proj.weight" if i == "model.model.layers.1.mlp.down_proj.weight"
                       else i for i in reader.input]
    before = graph.SerializeToString()
    assert not export_module._repeat_layer(graph, layers, tensors)
    assert graph.SerializeToString() == before
