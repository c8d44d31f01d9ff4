"""The engine file format: round trip, the manifest's schema, and every way a file can be bad."""

import hashlib
import json
import struct

import pytest

from llmc.formats import engine_file
from llmc.formats.engine_file import read_engine, read_manifest, write_engine
from llmc.formats.manifest import FORMAT_VERSION
from llmc.errors import LlmcError

SECTIONS = {"empty": b"", "model.onnx": b"\x01" * 1000, "tokenizer.json": b'{"x": 1}'}
GEOMETRY = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "vocab_size": 64,
            "max_positions": 128}
# A contiguous engine's manifest as `llmc compile` writes it, but for format_version and sections.
MANIFEST = {"llmc_version": "0", "created": "2030-01-01T00:00:00Z", "backend": "onnxruntime",
            "geometry": GEOMETRY, "dtype": "float32", "has_position_ids": True, "sliding_window": None,
            "layer_windows": None, "source": {"file": "model.onnx", "sha256": "0" * 64, "nodes": 1},
            "build_options": {}, "optimization": [], "precision": None, "paged": None,
            "not_paged": "not requested"}


@pytest.fixture
def engine(tmp_path):
    path = tmp_path / "engine.plan"
    write_engine(path, MANIFEST, SECTIONS)
    return path


def test_round_trip_keeps_manifest_and_sections(engine):
    loaded = read_engine(engine)
    assert loaded.manifest.backend == "onnxruntime"
    assert loaded.manifest.geometry.num_kv_heads == 2
    assert loaded.manifest.format_version == FORMAT_VERSION
    assert {name: bytes(data) for name, data in loaded.sections.items()} == SECTIONS
    assert [s.offset % 64 for s in loaded.manifest.sections] == [0, 0, 0]
    assert read_manifest(engine) == loaded.manifest.to_dict()
    assert {k: read_manifest(engine)[k] for k in MANIFEST} == MANIFEST


def rewrite_manifest(path, change):
    """The engine at `path` with its manifest JSON changed by `change` and its checksum made
    right again: what a buggy writer, not a corrupted disk, would produce."""
    data = path.read_bytes()
    magic, version, length, _ = engine_file.HEADER.unpack_from(data)
    start = engine_file.HEADER.size
    manifest = json.loads(data[start:start + length])
    change(manifest)
    raw = json.dumps(manifest).encode().ljust(length)  # same length: section offsets stay right
    assert len(raw) == length
    header = engine_file.HEADER.pack(magic, version, length, hashlib.sha256(raw).digest())
    path.write_bytes(header + raw + data[start + length:])


def test_a_flipped_manifest_byte_fails_its_checksum(engine):
    data = bytearray(engine.read_bytes())
    data[engine_file.HEADER.size + 5] ^= 0x01
    engine.write_bytes(bytes(data))
    with pytest.raises(LlmcError, match="engine.plan: corrupted engine file \\(checksum mismatch in the manifest\\)"):
        read_engine(engine)


@pytest.mark.parametrize("change, message", [
    (lambda m: m["geometry"].update(num_layers="2"), r"manifest field 'geometry.num_layers': expected an integer, got '2'"),
    (lambda m: m.pop("dtype"), r"manifest field 'dtype' is missing"),
    (lambda m: m.update(has_position_ids=1), r"manifest field 'has_position_ids': expected true or false"),
    (lambda m: m.update(paged=[]), r"manifest field 'paged': expected an object"),
    (lambda m: m["sections"][0].pop("sha256"), r"manifest field 'sections\[0\].sha256' is missing"),
    (lambda m: m.update(format_version=1), r"engine format 1 was written by another llmc"),
    (lambda m: m["sections"][2].update(name="tokenizer.jsox"), r"the manifest names no section 'tokenizer.json'"),
    (lambda m: m.update(dtype="float33"), r"manifest field 'dtype': 'float33' is not a valid value"),
    (lambda m: m["geometry"].update(head_dim=0), r"manifest field 'geometry.head_dim': 0 is not a valid value"),
])
def test_a_manifest_of_the_wrong_shape_is_one_error_naming_the_field(engine, change, message):
    rewrite_manifest(engine, change)
    with pytest.raises(LlmcError, match="engine.plan: " + message):
        read_engine(engine)


@pytest.mark.parametrize("change, message", [
    (lambda m: m["paged"]["segments"][0]["attention"].update(dense=None),
     r"manifest field 'paged.segments\[0\].attention.dense' is missing \(the attention's dense form\)"),
    (lambda m: m["paged"]["segments"][0]["attention"].pop("dense"),
     r"manifest field 'paged.segments\[0\].attention.dense' is missing$"),
    (lambda m: m["paged"].pop("single_sequence"), r"manifest field 'paged.single_sequence' is missing$"),
])
def test_a_paged_manifest_names_every_section_the_runtime_reads(tmp_path, tiny_llama_engine, change, message):
    engine = tmp_path / "engine.plan"
    engine.write_bytes(tiny_llama_engine.read_bytes())
    rewrite_manifest(engine, change)
    with pytest.raises(LlmcError, match="engine.plan: " + message):
        read_engine(engine)


def test_older_format_version_is_refused_with_a_way_out(engine):
    data = bytearray(engine.read_bytes())
    struct.pack_into("<I", data, 8, 1)
    engine.write_bytes(bytes(data))
    with pytest.raises(LlmcError, match="format version 1 was written by an older llmc .* recompile it"):
        read_engine(engine)


def test_compile_writes_only_what_the_schema_reads(tmp_path):
    with pytest.raises(LlmcError, match="manifest field 'geometry' is missing"):
        write_engine(tmp_path / "e.plan", {k: v for k, v in MANIFEST.items() if k != "geometry"}, SECTIONS)
    assert list(tmp_path.iterdir()) == []


def test_truncated_file_is_named(engine):
    data = engine.read_bytes()
    engine.write_bytes(data[:-10])
    with pytest.raises(LlmcError, match=r"engine.plan: truncated engine file .*'tokenizer.json'"):
        read_engine(engine)


def test_corrupted_section_fails_its_checksum(engine):
    data = bytearray(engine.read_bytes())
    data[-3] ^= 0xFF  # inside the last section
    engine.write_bytes(bytes(data))
    with pytest.raises(LlmcError, match="checksum mismatch in section 'tokenizer.json'"):
        read_engine(engine)


def test_newer_format_version_is_refused(engine):
    data = bytearray(engine.read_bytes())
    struct.pack_into("<I", data, 8, engine_file.FORMAT_VERSION + 1)
    engine.write_bytes(bytes(data))
    with pytest.raises(LlmcError, match=f"format version {FORMAT_VERSION + 1} is newer"):
        read_manifest(engine)


@pytest.mark.parametrize("content", [b"", b"ir_version: 8", b"LLMCENG\0\x02\0\0\0\xff\xff\0\0\0\0\0\0{"])
def test_not_an_engine_or_broken_header(tmp_path, content):
    path = tmp_path / "bad.plan"
    path.write_bytes(content)
    with pytest.raises(LlmcError, match="bad.plan: (not an llmc engine|truncated)"):
        read_engine(path)


def test_missing_file(tmp_path):
    with pytest.raises(LlmcError, match="nothere.plan: no such file"):
        read_engine(tmp_path / "nothere.plan")


def test_failed_write_leaves_nothing(tmp_path):
    # An unserializable manifest fails mid-write; no file, temporary or final, may remain.
    with pytest.raises(TypeError):
        write_engine(tmp_path / "e.plan", {**MANIFEST, "bad": object()}, SECTIONS)
    assert list(tmp_path.iterdir()) == []


def test_a_file_section_is_streamed_in_and_its_offset_recorded(tmp_path):
    # How a large model's weights get in: named by path, read in chunks, never all in memory.
    payload = bytes(range(256)) * 5000
    (tmp_path / "weights.data").write_bytes(payload)
    path = tmp_path / "engine.plan"
    write_engine(path, MANIFEST, {"model.onnx": b"graph", "model.onnx.data": tmp_path / "weights.data",
                                  "tokenizer.json": b"{}"})
    loaded = read_engine(path)
    assert bytes(loaded.sections["model.onnx.data"]) == payload
    table = {s.name: s for s in loaded.manifest.sections}
    assert table["model.onnx.data"].length == len(payload)
    with open(path, "rb") as f:
        f.seek(loaded.offsets["model.onnx.data"])
        assert f.read(len(payload)) == payload


def test_engine_is_readable_as_the_umask_allows_and_stale_temporaries_go(tmp_path):
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f".engine.plan.{dead}.abc123"  # a writer that died mid-write
    stale.write_bytes(b"partial")
    ours = tmp_path / f".engine.plan.{os.getpid()}.xyz"  # a live writer's: not touched
    ours.write_bytes(b"in progress")
    old = os.umask(0o022)
    try:
        write_engine(tmp_path / "engine.plan", MANIFEST, SECTIONS)
    finally:
        os.umask(old)
    assert (tmp_path / "engine.plan").stat().st_mode & 0o777 == 0o644
    assert not stale.exists() and ours.exists()


@pytest.mark.parametrize("name", ["e.plan", "odd-length.plan", "x" * 200])
def test_engine_weights_are_bound_to_the_engine_file_without_onnx(tmp_path, name):
    # An engine's graphs reference their weights by placeholder; the runtime writes the file's
    # name (padded to the placeholder's width, odd or even) and absolute offsets over them.
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from llmc.formats import onnx_io
    from llmc.formats.engine_file import FileRange, bind_weights
    from llmc.formats.sessions import open_session, session_options

    rng = np.random.default_rng(0)
    weights = rng.standard_normal((64, 32)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 32])],
                              [numpy_helper.from_array(weights, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inline = model.SerializeToString()
    x = rng.standard_normal((3, 64)).astype(np.float32)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    data = onnx_io.engine_weights(model)
    assert model.graph.initializer[0].data_location == TensorProto.EXTERNAL
    assert sum(len(part) for part in data) >= weights.nbytes  # parts: padding and the tensor's bytes
    path = tmp_path / name
    write_engine(path, MANIFEST, {"tokenizer.json": b"{}", "model.onnx": model.SerializeToString(), "model.onnx.data": data})
    engine = read_engine(path)
    weights_file = FileRange(path, engine.offsets["model.onnx.data"])
    bound = bind_weights(engine.sections["model.onnx"], weights_file)
    assert len(bound) == len(model.SerializeToString()) and bound != model.SerializeToString()  # same widths: no length changed
    session = open_session({"model.onnx": engine.sections["model.onnx"], "model.onnx.data": weights_file},
                           session_options(1))
    np.testing.assert_allclose(session.run(None, {"x": x})[0], reference, rtol=1e-6, atol=1e-6)
    assert bind_weights(inline, weights_file) == inline  # weights inline: nothing to bind
