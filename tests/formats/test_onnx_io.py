"""onnx_io past the 2 GB limit: weights stay in external data, read in place, written by streaming.

These use a lowered threshold to run in milliseconds; tests/compiler/test_large_models.py takes a
model past the real limit through export, compile and run.
"""

import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmc.formats import onnx_io


def _matmul_model(weights: np.ndarray) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", weights.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", weights.shape[1]])],
        [numpy_helper.from_array(weights, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def large(monkeypatch):
    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_THRESHOLD", 1000)


def test_large_model_is_loaded_without_its_weights(tmp_path, large):
    weights = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    onnx_io.save_onnx(_matmul_model(weights), tmp_path / "m.onnx")
    assert (tmp_path / "m.onnx.data").is_file()

    model = onnx_io.load_onnx(tmp_path / "m.onnx")
    tensor = model.graph.initializer[0]
    assert tensor.data_location == TensorProto.EXTERNAL and not tensor.raw_data
    assert onnx_io.is_large(model) and model.ByteSize() < 1000  # sized by its references
    np.testing.assert_array_equal(onnx_io.tensor_array(tensor), weights)
    assert not tensor.raw_data  # reading did not load the bytes into the proto
    onnx_io.check_model(model)


def test_new_big_tensors_go_to_external_data_and_saving_streams_them(tmp_path, large):
    weights = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    onnx_io.save_onnx(_matmul_model(weights), tmp_path / "m.onnx")
    model = onnx_io.load_onnx(tmp_path / "m.onnx")
    doubled = onnx_io.make_initializer(2 * weights, "w", external=True)
    assert doubled.data_location == TensorProto.EXTERNAL
    model.graph.initializer[0].CopyFrom(doubled)

    onnx_io.save_onnx(model, tmp_path / "m.onnx")  # over its own source: staged, then renamed
    reread = onnx.load(tmp_path / "m.onnx")  # onnx's own loader, weights included
    np.testing.assert_array_equal(numpy_helper.to_array(reread.graph.initializer[0]), 2 * weights)
    # The saved model now references the file just written.
    np.testing.assert_array_equal(onnx_io.tensor_array(model.graph.initializer[0]), 2 * weights)


def test_checker_still_rejects_a_broken_large_graph(tmp_path, large):
    weights = np.ones((64, 32), np.float32)
    onnx_io.save_onnx(_matmul_model(weights), tmp_path / "m.onnx")
    model = onnx_io.load_onnx(tmp_path / "m.onnx")
    model.graph.node[0].op_type = "NoSuchOp"
    with pytest.raises(Exception, match="NoSuchOp"):
        onnx_io.check_model(model)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.uint64, np.bool_, ml_dtypes.bfloat16,
                                   ml_dtypes.float8_e4m3fn, ml_dtypes.int4])
def test_external_tensors_of_every_type_read_and_size_as_onnx_writes_them(tmp_path, dtype):
    # NumPy maps the plain types itself, onnx-ir decodes the rest (bfloat16, float8, packed int4):
    # both against onnx's own writer and reader.
    values = (np.arange(2400) % 7).astype(dtype).reshape(40, 60)
    tensor = numpy_helper.from_array(values, "w")
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", tensor.data_type, [40, 60])], [tensor])
    onnx.save_model(helper.make_model(graph), tmp_path / "m.onnx", save_as_external_data=True, location="m.data",
                    size_threshold=0)
    loaded = onnx_io.load_onnx(tmp_path / "m.onnx").graph.initializer[0]
    assert loaded.data_location == TensorProto.EXTERNAL
    np.testing.assert_array_equal(onnx_io.tensor_array(loaded), numpy_helper.to_array(tensor))
    assert onnx_io.tensor_array(loaded).dtype == numpy_helper.to_array(tensor).dtype
    assert onnx_io.tensor_bytes(loaded) == onnx_io.tensor_bytes(tensor) == len(tensor.raw_data)
    entries = [e for e in loaded.external_data if e.key != "length"]  # optional in ONNX: sized from type and dims
    del loaded.external_data[:]
    loaded.external_data.extend(entries)
    assert onnx_io.external_length(loaded) == len(tensor.raw_data)
    assert onnx_io.tensor_data(loaded) == tensor.raw_data


def test_a_float_model_is_read_checked_and_packed_without_importing_onnx_ir(tmp_path):
    # `import onnx_ir` imports sympy: 35 MB, a tenth of compiling the 1B checkpoint's peak memory.
    model = _matmul_model(np.ones((64, 32), np.float32))
    model.graph.initializer.append(numpy_helper.from_array(np.ones(1024, ml_dtypes.bfloat16), "unused"))
    onnx.save_model(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    script = f"""
import sys
import llmc.compiler.build
from llmc.formats import onnx_io
model = onnx_io.load_onnx({str(tmp_path / "m.onnx")!r})
onnx_io.validate(model, {str(tmp_path / "m.onnx")!r})
weights = onnx_io.tensor_array(model.graph.initializer[0])
model.graph.initializer.append(onnx_io.make_initializer(2 * weights, "doubled", external=True))
onnx_io.serialize(model)
onnx_io.engine_weights(model)
print(sorted(name for name in ("onnx_ir", "sympy") if name in sys.modules))
onnx_io.tensor_array(onnx_io.load_onnx({str(tmp_path / "m.onnx")!r}).graph.initializer[1])  # bfloat16: onnx-ir's
print(sorted(name for name in ("onnx_ir", "sympy") if name in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "['onnx_ir', 'sympy']"]


def test_a_loaded_model_references_its_weights_in_its_own_file(tmp_path):
    # load_onnx never holds weights in protobuf: an inline initializer becomes a reference to its
    # bytes inside the .onnx file itself (found by walking the encoding), not a copy.
    import onnxruntime as ort

    from llmc.formats.sessions import open_session, session_options

    rng = np.random.default_rng(0)
    weights = rng.standard_normal((64, 32)).astype(np.float32)
    model = _matmul_model(weights)
    model.graph.initializer.append(numpy_helper.from_array(np.arange(3, dtype=np.float32), "small"))
    onnx.save_model(model, tmp_path / "m.onnx")

    loaded = onnx_io.load_onnx(tmp_path / "m.onnx")
    big, small = loaded.graph.initializer
    assert big.data_location == TensorProto.EXTERNAL and not big.raw_data
    location = {e.key: e.value for e in big.external_data}["location"]
    assert location == str((tmp_path / "m.onnx").resolve())
    np.testing.assert_array_equal(onnx_io.tensor_array(big), weights)
    assert small.data_location != TensorProto.EXTERNAL  # under 1 KiB: stays inline
    assert loaded.ByteSize() < weights.nbytes

    x = rng.standard_normal((2, 64)).astype(np.float32)
    session = open_session(onnx_io.serialize(loaded), session_options(1))
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], reference.run(None, {"x": x})[0])


def test_load_onnx_parses_past_the_weights_and_keeps_everything_else(tmp_path):
    # load_onnx parses the file with its large inline weights skipped, in place: every other
    # field (nodes, small and typed-field tensors, metadata after the graph) must come through.
    rng = np.random.default_rng(1)
    first, second = (rng.standard_normal((64, 32)).astype(np.float32) for _ in range(2))
    model = _matmul_model(first)
    model.graph.initializer.extend([
        numpy_helper.from_array(np.arange(3, dtype=np.int64), "small"),
        numpy_helper.from_array(second, "second"),
        onnx.helper.make_tensor("typed", TensorProto.FLOAT, [300], rng.standard_normal(300).tolist()),
        numpy_helper.from_array(np.arange(500, dtype=np.int64), "big_ints"),
    ])
    model.metadata_props.add(key="k", value="v")
    onnx.save_model(model, tmp_path / "m.onnx")

    loaded = onnx_io.load_onnx(tmp_path / "m.onnx")
    want = onnx.load(str(tmp_path / "m.onnx"))
    assert [t.name for t in loaded.graph.initializer] == [t.name for t in want.graph.initializer]
    for got, expected in zip(loaded.graph.initializer, want.graph.initializer):
        np.testing.assert_array_equal(onnx_io.tensor_array(got), numpy_helper.to_array(expected))
    external = {t.name for t in loaded.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert external == {"w", "second", "typed", "big_ints"}, external
    assert loaded.graph.node == want.graph.node and loaded.graph.input == want.graph.input
    assert loaded.metadata_props == want.metadata_props and loaded.opset_import == want.opset_import


def test_save_serialized_appends_tensors_and_metadata_without_parsing(tmp_path):
    weights = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    model = _matmul_model(weights)
    model.metadata_props.add(key="exporter", value="kept")
    weightless = onnx.ModelProto()
    weightless.CopyFrom(model)
    del weightless.graph.initializer[:]
    header = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[64, 32])
    (tmp_path / "m.onnx.data").write_bytes(b"stale")
    onnx_io.save_serialized(weightless.SerializeToString(), [(header, memoryview(weights).cast("B"))],
                            tmp_path / "m.onnx", metadata={"llmc.a": "1", "llmc.b": "2"})
    saved = onnx.load(str(tmp_path / "m.onnx"))
    assert [(p.key, p.value) for p in saved.metadata_props] == [("exporter", "kept"), ("llmc.a", "1"), ("llmc.b", "2")]
    assert saved.graph.node == model.graph.node and saved.graph.input == model.graph.input
    assert [t.name for t in saved.graph.initializer] == ["w"]
    np.testing.assert_array_equal(numpy_helper.to_array(saved.graph.initializer[0]), weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


