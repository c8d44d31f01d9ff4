"""The engine file format: round trip, and every way a file can be bad."""

import struct

import pytest

from llmc.compiler import engine_file
from llmc.compiler.engine_file import read_engine, read_manifest, write_engine
from llmc.errors import LlmcError

SECTIONS = {"empty": b"", "model.onnx": b"\x01" * 1000, "tokenizer.json": b'{"x": 1}'}


@pytest.fixture
def engine(tmp_path):
    path = tmp_path / "engine.plan"
    write_engine(path, {"backend": "onnxruntime", "geometry": {"num_layers": 2}}, SECTIONS)
    return path


def test_round_trip_keeps_manifest_and_sections(engine):
    loaded = read_engine(engine)
    assert loaded.manifest["backend"] == "onnxruntime"
    assert loaded.manifest["geometry"] == {"num_layers": 2}
    assert loaded.manifest["format_version"] == engine_file.FORMAT_VERSION
    assert {name: bytes(data) for name, data in loaded.sections.items()} == SECTIONS
    assert [s["offset"] % 64 for s in loaded.manifest["sections"]] == [0, 0, 0]
    assert read_manifest(engine) == loaded.manifest


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
    with pytest.raises(LlmcError, match="format version 2 is newer"):
        read_manifest(engine)


@pytest.mark.parametrize("content", [b"", b"ir_version: 8", b"LLMCENG\0\x01\0\0\0\xff\xff\0\0\0\0\0\0{"])
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
        write_engine(tmp_path / "e.plan", {"bad": object()}, {"a": b"abc"})
    assert list(tmp_path.iterdir()) == []


def test_a_file_section_is_streamed_in_and_its_offset_recorded(tmp_path):
    # How a large model's weights get in: named by path, read in chunks, never all in memory.
    payload = bytes(range(256)) * 5000
    (tmp_path / "weights.data").write_bytes(payload)
    path = tmp_path / "engine.plan"
    write_engine(path, {"backend": "onnxruntime"},
                 {"model.onnx": b"graph", "model.onnx.data": tmp_path / "weights.data"})
    loaded = read_engine(path)
    assert bytes(loaded.sections["model.onnx.data"]) == payload
    table = {s["name"]: s for s in loaded.manifest["sections"]}
    assert table["model.onnx.data"]["length"] == len(payload)
    with open(path, "rb") as f:
        f.seek(loaded.offsets["model.onnx.data"])
        assert f.read(len(payload)) == payload
