"""The two places where llmc reads and writes ONNX's protobuf encoding itself.

onnx-ir (like onnx) parses a whole ModelProto, inline weights included, and serializes one whole.
For a model whose weights are inline (every export under 2 GB, SmolLM2-135M's 654 MB among them)
that costs seconds and a copy of the weights in protobuf memory that upb frees only with the
message (bench/large_model_bench.py measures `llmc compile`'s time and peak memory). So:

- `parse_leaving_inline_weights` parses a file without the raw bytes of its big initializers and
  says where those bytes are, for the loader to reference them in place;
- `initializer_parts` encodes initializers around buffers it does not copy, for a writer to put
  after a serialized model: protobuf merges a second `graph` field into the first.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Sequence

import onnx

# ModelProto.graph, GraphProto.initializer, TensorProto.raw_data.
_GRAPH, _INITIALIZER, _RAW_DATA = 7, 5, 9


def parse_leaving_inline_weights(path: Path, min_bytes: int) -> tuple[onnx.ModelProto, list[tuple[int, int, int]]]:
    """Parse an ONNX file without the raw bytes of its main graph's initializers of `min_bytes` or
    more; returns the model and, for each left out, (initializer index, offset in the file, length)."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
    inline_weights = []
    encoded = bytearray()
    for field, head, start, end in _fields(data, 0, len(data)):
        if field != _GRAPH or start is None:
            encoded += data[head:end]
            continue
        graph, initializers = bytearray(), 0
        for field, head, begin, stop in _fields(data, start, end):
            if field != _INITIALIZER or begin is None:
                graph += data[head:stop]
                continue
            tensor = bytearray()
            for field, key, first, last in _fields(data, begin, stop):
                if field == _RAW_DATA and first is not None and last - first >= min_bytes:
                    inline_weights.append((initializers, first, last - first))
                else:
                    tensor += data[key:last]
            graph += _length_delimited(_INITIALIZER, tensor)
            initializers += 1
        encoded += _length_delimited(_GRAPH, graph)
    model = onnx.ModelProto()
    model.ParseFromString(bytes(encoded))
    return model, inline_weights


def initializer_parts(tensors: Sequence[tuple[onnx.TensorProto, memoryview]]) -> list[bytes | memoryview]:
    """A ModelProto `graph` field holding `tensors` (TensorProto headers: name, type, dims; and
    their bytes) as initializers, in parts that reference the buffers instead of copying them."""
    graph = []
    for header, data in tensors:
        head = header.SerializeToString()
        raw = _varint_bytes(_RAW_DATA << 3 | 2) + _varint_bytes(data.nbytes)
        graph += [_varint_bytes(_INITIALIZER << 3 | 2), _varint_bytes(len(head) + len(raw) + data.nbytes),
                  head, raw, data]
    length = sum(part.nbytes if isinstance(part, memoryview) else len(part) for part in graph)
    return [_varint_bytes(_GRAPH << 3 | 2), _varint_bytes(length), *graph] if graph else []


def _fields(data, start: int, end: int):
    """(field number, first byte of its key, first byte of its value, end) of each field of the
    message encoded in data[start:end]; the value's first byte is None unless length-delimited."""
    at = start
    while at < end:
        head = at
        key, at = _varint(data, at)
        kind = key & 7
        if kind == 2:
            length, at = _varint(data, at)
            yield key >> 3, head, at, at + length
            at += length
            continue
        if kind == 0:
            _, at = _varint(data, at)
        elif kind in (1, 5):
            at += 8 if kind == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {kind} at byte {at}")
        yield key >> 3, head, None, at
    if at != end:
        raise ValueError(f"a protobuf field runs past byte {end}")


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint_bytes(field << 3 | 2) + _varint_bytes(len(payload)) + payload


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _varint(data, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
