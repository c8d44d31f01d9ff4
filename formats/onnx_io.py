"""Loading and saving ONNX models safely, at any size.

Saving goes through a temporary folder next to the destination and renames into place, so a
failed or interrupted save never leaves a file that looks good. Models whose tensors exceed the
2 GB protobuf limit are written with their weights in one external-data file beside them.

A model loaded from a file (`load_onnx`), of any size, never holds its weights. Its tensors of
1 KiB or more are external-data references whose `location` is an absolute path (the source's
.onnx.data file, an engine file, or a scratch file of this process); `tensor_array` reads one as a
read-only memory map. Why: protobuf cannot serialize or even size a message past 2 GB; the upb
runtime keeps every byte stored in a message until the whole message is freed (clearing a field
frees nothing), so moving weights in and out of a ModelProto — to size, check or shape-infer it —
would grow memory by the weights each time; and serializing weights is slow where page faults
are (measured on these VMs: 654 MB, SmolLM2-135M, 7-10 s a serialization, nearly all in the
kernel). A pass that makes a big tensor (merged QKV, fp16 or int4 weights) in such a model writes
it to the scratch file (`make_initializer`), and `spill_large_tensors` moves any left inline there
the next time the model is inferred, checked or serialized. Models built in memory (tests) stay
inline until saved.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

from llmc.errors import LlmcError, first_line
from llmc.formats.engine_file import EXTERNAL_ROOT, OFFSET_DIGITS, WEIGHTS_LOCATION, FileRange

# Protobuf cannot serialize a message of 2 GiB or more; stay clear of it with headroom for the graph.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
# In a large model, tensors this size or more live in external data; smaller ones (shape
# arithmetic that shape inference folds) stay inline.
EXTERNAL_MIN_BYTES = 1024
# External tensors start at multiples of this, so a reader can memory-map them in place.
_ALIGN = 4096
_CHUNK = 1 << 26
_TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")


def load_onnx(path: str | os.PathLike, *, load_weights: bool = True) -> onnx.ModelProto:
    """Load an ONNX file, with its external data if any.

    Past 2 GB the weights are not read: their references are pinned to absolute paths and
    read on demand (see the module docstring).

    Args:
        path: the .onnx file.
        load_weights: False reads only the graph, leaving external tensors as references.
    """
    path = Path(path)
    if not path.is_file():
        raise LlmcError(f"{path}: no such file")
    try:
        if load_weights:
            model, inline_weights = _parse_leaving_inline_weights(path)
        else:
            model, inline_weights = onnx.load(str(path), load_external_data=False), []
    except Exception as exc:  # protobuf raises several unrelated types on garbage input
        raise LlmcError(f"{path}: not a readable ONNX model ({first_line(exc, 200)})") from None
    if not load_weights:
        return model
    try:
        _pin_locations(model, path.parent)
    except (OSError, ValueError, onnx.checker.ValidationError) as exc:
        raise LlmcError(f"{path}: cannot read its external data ({first_line(exc, 200)})") from None
    location = str(path.resolve())
    for index, offset, length in inline_weights:
        _set_external(model.graph.initializer[index], location, offset, length)
    if not _spill(model):
        return model
    weightless = onnx.ModelProto()  # a fresh message: the parsed one's memory still holds the weights
    weightless.ParseFromString(model.SerializeToString())
    return weightless


def _parse_leaving_inline_weights(path: Path) -> tuple[onnx.ModelProto, list[tuple[int, int, int]]]:
    """Parse an ONNX file without the raw bytes of its main graph's initializers of
    `EXTERNAL_MIN_BYTES` or more: they stay in the file, where the protobuf encoding put them,
    and are returned as (initializer index, offset, length) for the caller to reference. Reading
    and parsing SmolLM2-135M's 654 MB cost 3.4 s; the rest of its file is a few hundred KB."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""
    inline_weights = []
    encoded = bytearray()
    for field, head, start, end in _fields(data, 0, len(data)):
        if field != 7 or start is None:  # ModelProto.graph
            encoded += data[head:end]
            continue
        graph, initializers = bytearray(), 0
        for field, head, begin, stop in _fields(data, start, end):
            if field != 5 or begin is None:  # GraphProto.initializer
                graph += data[head:stop]
                continue
            tensor = bytearray()
            for field, key, first, last in _fields(data, begin, stop):
                if field == 9 and first is not None and last - first >= EXTERNAL_MIN_BYTES:  # TensorProto.raw_data
                    inline_weights.append((initializers, first, last - first))
                else:
                    tensor += data[key:last]
            graph += _length_delimited(5, tensor)
            initializers += 1
        encoded += _length_delimited(7, graph)
    model = onnx.ModelProto()
    model.ParseFromString(bytes(encoded))
    return model, inline_weights


def _fields(data, start: int, end: int):
    """(field number, first byte of its key, first byte of its value, end) of each field of the
    protobuf message encoded in data[start:end]; the value's first byte is None for fields that
    are not length-delimited."""
    at = start
    while at < end:
        head = at
        key, at = _varint(data, at)
        kind = key & 7
        if kind == 0:
            _, at = _varint(data, at)
            yield key >> 3, head, None, at
        elif kind == 1:
            at += 8
            yield key >> 3, head, None, at
        elif kind == 5:
            at += 4
            yield key >> 3, head, None, at
        elif kind == 2:
            length, at = _varint(data, at)
            yield key >> 3, head, at, at + length
            at += length
        else:
            raise ValueError(f"protobuf wire type {kind} at byte {at}")
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


def _initializer_parts(tensors: Sequence[tuple[onnx.TensorProto, memoryview]]) -> list[bytes | memoryview]:
    """A ModelProto `graph` field holding `tensors` as initializers, each a TensorProto header
    (name, type, dims) and the buffer of its raw bytes, in parts that reference those buffers:
    protobuf merges a second `graph` field into the first, so these follow a model's bytes as a
    graph of their own (building them as messages and serializing copied SmolLM2-135M's 540 MB
    three times, 3.7 s)."""
    graph = []
    for header, data in tensors:
        head = header.SerializeToString()
        raw = _varint_bytes(9 << 3 | 2) + _varint_bytes(data.nbytes)  # TensorProto.raw_data
        graph += [_varint_bytes(5 << 3 | 2), _varint_bytes(len(head) + len(raw) + data.nbytes), head, raw, data]
    length = sum(part.nbytes if isinstance(part, memoryview) else len(part) for part in graph)
    return [_varint_bytes(7 << 3 | 2), _varint_bytes(length), *graph] if graph else []  # ModelProto.graph


def save_with_external_data(model: bytes, tensors: Sequence[tuple[onnx.TensorProto, memoryview]],
                            path: str | os.PathLike, *, metadata: dict[str, str]) -> None:
    """Write a serialized ModelProto without weights, with `tensors` (headers and bytes, as
    `save_serialized` takes them) as its initializers in `<name>.data` beside it and `metadata`
    as its metadata_props, atomically; the tensors' bytes are written from where they are, never
    gathered into one message (past 2 GB none can hold them)."""
    path = Path(path)
    data_name = path.name + ".data"
    extra = _metadata_message(metadata)
    with _staging(path) as staging:
        with open(staging / data_name, "wb") as out:
            for header, data in tensors:
                tensor = extra.graph.initializer.add()
                tensor.CopyFrom(header)
                _set_external(tensor, data_name, _append_aligned(out, data), data.nbytes)
        with open(staging / path.name, "wb") as f:
            f.write(model)
            f.write(extra.SerializeToString())  # merged into the model's graph (see `_initializer_parts`)
        os.replace(staging / data_name, path.parent / data_name)
        os.replace(staging / path.name, path)


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write `model` to `path` atomically; weights go to `<name>.data` when the model is large,
    else inline.

    A large model's references then point into the written data file.

    Args:
        model: the model.
        path: the destination .onnx file.
    """
    path = Path(path)
    data_name = path.name + ".data"
    with _staging(path) as staging:
        staged = staging / path.name
        if is_large(model):
            offsets = _write_with_external_data(model, staged, data_name)
            os.replace(staging / data_name, path.parent / data_name)
            # The source data file may just have been replaced: point at what was written.
            _repoint(model, path.parent / data_name, offsets)
            os.replace(staged, path)
        else:
            onnx.save_model(_with_weights_inline(model), str(staged))
            _publish_inline(staged, path)


def save_serialized(model: bytes, tensors: Sequence[tuple[onnx.TensorProto, memoryview]], path: str | os.PathLike,
                    *, metadata: dict[str, str]) -> None:
    """Write a serialized ModelProto with `tensors` (TensorProto headers and their bytes) as inline
    initializers (under 2 GB) and `metadata` as its metadata_props, atomically and without parsing
    it or gathering it into one buffer: parsing and serializing SmolLM2-135M's 540 MB again cost
    2.4 s, joining them 0.4 s. Protobuf merges concatenated messages, so the tensors and the
    metadata follow the model's bytes as messages of their own (added to what the model has).

    Args:
        model: the serialized model.
        tensors: initializers to add, written from where their bytes are.
        path: the destination .onnx file (a stale `<name>.data` beside it is removed).
        metadata: key/value pairs for metadata_props.
    """
    path = Path(path)
    with _staging(path) as staging:
        with open(staging / path.name, "wb") as f:
            f.write(model)
            for part in _initializer_parts(tensors):
                f.write(part)
            f.write(_metadata_message(metadata).SerializeToString())
        _publish_inline(staging / path.name, path)


def _metadata_message(metadata: dict[str, str]) -> onnx.ModelProto:
    """A ModelProto holding only `metadata` as metadata_props: written after a serialized model,
    protobuf adds them to its own."""
    extra = onnx.ModelProto()
    for key, value in metadata.items():
        extra.metadata_props.add(key=key, value=value)
    return extra


@contextlib.contextmanager
def _staging(path: Path):
    """A temporary folder beside `path` to write its files in before they are renamed into place
    (a reader never sees a partial model); removed afterwards, whatever happened."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".llmc-", dir=path.parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish_inline(staged: Path, path: Path) -> None:
    """Move a model written with its weights inline into place, removing a stale `<name>.data`
    from an earlier, larger save."""
    data = path.parent / (path.name + ".data")
    if data.exists():
        data.unlink()
    os.replace(staged, path)


def save_ir_model(model, path: str | os.PathLike) -> None:
    """Write an onnx_ir model (what torch.onnx exports) atomically, like `save_onnx`; past 2 GB
    its tensors go straight to the data file, never all copied into one ModelProto.

    Args:
        model: an `onnx_ir.Model`.
        path: the destination .onnx file.
    """
    import onnx_ir as ir  # onnxscript's dependency; only the exporter needs it

    total = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if total <= EXTERNAL_DATA_THRESHOLD:
        save_onnx(ir.serde.serialize_model(model), path)
        return
    path = Path(path)
    data_name = path.name + ".data"
    with _staging(path) as staging:
        ir.save(model, staging / path.name, external_data=data_name, size_threshold_bytes=EXTERNAL_MIN_BYTES)
        os.replace(staging / data_name, path.parent / data_name)
        os.replace(staging / path.name, path)


def engine_weights(*models: onnx.ModelProto) -> list[bytes | FileRange]:
    """Reference the models' tensors of 1 KiB or more as an engine's "model.onnx.data" section
    (as `engine_file.bind_weights` expects) and return that section's parts: each tensor's bytes
    where they are (inline, or a range of its external file), aligned; `write_engine` streams
    them. The graphs then hold no weights, whatever their size. Graphs made from one model (a
    paged engine's and its single-sequence graph) share each tensor of the same name."""
    parts: list[bytes | FileRange] = []
    placed: dict[str, tuple[int, int]] = {}
    size = 0
    for model in models:
        for tensor in _get_all_tensors(model):
            if tensor.name in placed:
                _set_external(tensor, WEIGHTS_LOCATION, *placed[tensor.name], engine=True)
                continue
            if uses_external_data(tensor):
                info = ExternalDataInfo(tensor)
                length = _external_length(tensor)
                data: bytes | FileRange = FileRange(Path(info.location), info.offset or 0, length)
            elif tensor.data_type != onnx.TensorProto.STRING and tensor.ByteSize() >= EXTERNAL_MIN_BYTES:
                data = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
                length = len(data)
            else:
                continue
            offset = -(-size // _ALIGN) * _ALIGN
            parts += [bytes(offset - size), data]
            size = offset + length
            if tensor.name:
                placed[tensor.name] = (offset, length)
            _set_external(tensor, WEIGHTS_LOCATION, offset, length, engine=True)
    return parts


def model_bytes(model: onnx.ModelProto) -> int:
    """Bytes the model's graph and weights take, external weights included; works past 2 GB."""
    total = sum(n.ByteSize() for n in model.graph.node)  # Constant nodes may hold tensors
    for tensor in model.graph.initializer:
        total += _external_length(tensor) if uses_external_data(tensor) else _inline_bytes(tensor)
    return total


def _inline_bytes(tensor: onnx.TensorProto) -> int:
    """`tensor.ByteSize()`, with the raw bytes' length taken from the dims: upb sizes a message
    by encoding it, which made sizing a 25M-parameter model cost 80 ms (called after every pass)."""
    itemsize = _ITEMSIZE.get(tensor.data_type)
    if itemsize is None or not tensor.HasField("raw_data"):
        return tensor.ByteSize()
    length = itemsize * int(np.prod(tensor.dims, dtype=np.int64))
    rest = onnx.TensorProto()
    _copy_fields(tensor, rest, skip="raw_data")
    return rest.ByteSize() + 1 + _varint_size(length) + length  # raw_data: tag, length, bytes


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


_ITEMSIZE = {getattr(onnx.TensorProto, name): size for name, size in [
    ("FLOAT", 4), ("UINT8", 1), ("INT8", 1), ("UINT16", 2), ("INT16", 2), ("INT32", 4), ("INT64", 8),
    ("BOOL", 1), ("FLOAT16", 2), ("DOUBLE", 8), ("UINT32", 4), ("UINT64", 8), ("BFLOAT16", 2)]}


def is_large(model: onnx.ModelProto) -> bool:
    """Whether the model is too big to be one protobuf message (sized tensor by tensor: protobuf
    cannot size a message past 2 GB)."""
    return model_bytes(model) > EXTERNAL_DATA_THRESHOLD


def tensor_array(tensor: onnx.TensorProto) -> np.ndarray:
    """The value of a tensor; one in external data (a large model's weights) is memory-mapped
    read-only, not loaded into the proto (which onnx's `numpy_helper.to_array` would do).

    Args:
        tensor: an initializer or attribute tensor.
    """
    if not uses_external_data(tensor):
        return numpy_helper.to_array(tensor)
    info = ExternalDataInfo(tensor)
    if not os.path.isabs(info.location):
        raise LlmcError(f"tensor '{tensor.name}': its external data was not loaded")
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    length = _external_length(tensor)
    if dtype.kind not in "biufc" or length == 0 or length != dtype.itemsize * int(np.prod(tensor.dims)):
        # Packed or exotic types (int4, bfloat16, ...): decode a copy with onnx's own code.
        inline = onnx.TensorProto()
        inline.CopyFrom(tensor)
        _set_inline(inline, _read_range(info.location, info.offset, length))
        return numpy_helper.to_array(inline)
    return np.memmap(info.location, dtype.newbyteorder("<"), "r", info.offset, tuple(tensor.dims))


def make_initializer(value: np.ndarray, name: str, *, external: bool) -> onnx.TensorProto:
    """`numpy_helper.from_array`, except that with `external` (a pass working on a model loaded
    from a file) a tensor of `EXTERNAL_MIN_BYTES` or more is written straight to the scratch data file:
    a merged or converted weight then never enters (and stays in) the model's protobuf memory.

    Args:
        value: the tensor's value.
        name: its name.
        external: whether the model it is for keeps its weights external (`has_external_weights`).
    """
    value = np.asarray(value)
    if not external or value.nbytes < EXTERNAL_MIN_BYTES or value.dtype.kind not in "biuf":
        return numpy_helper.from_array(value, name)
    data = np.ascontiguousarray(value, value.dtype.newbyteorder("<"))
    tensor = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(value.dtype),
                              dims=value.shape)
    scratch = _scratch_file()
    with open(scratch, "ab") as out:
        offset = _append_aligned(out, data.data.cast("B") if data.ndim else data.tobytes())
    _set_external(tensor, str(scratch), offset, data.nbytes)
    return tensor


def spill_large_tensors(model: onnx.ModelProto) -> int:
    """Move the inline tensors of `EXTERNAL_MIN_BYTES` or more of a model that keeps its weights
    external (loaded from a file, or large) to this process's scratch data file (see the module
    docstring); returns the bytes moved.

    Args:
        model: the model, changed in place (its values are not).
    """
    return _spill(model) if _has_external_weights(model) else 0


def _spill(model: onnx.ModelProto) -> int:
    moved = 0
    scratch = _scratch_file()
    with open(scratch, "ab") as out:
        for tensor in _get_all_tensors(model):
            # Integer tensors stay: shape inference reads their values (shapes, indices).
            if (uses_external_data(tensor) or tensor.data_type in (onnx.TensorProto.STRING, *_SHAPE_DATA_TYPES)
                    or tensor.ByteSize() < EXTERNAL_MIN_BYTES):
                continue
            data = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
            offset = _append_aligned(out, data)
            _set_external(tensor, str(scratch), offset, len(data))
            moved += len(data)
    return moved


def infer_shapes(model: onnx.ModelProto, **options) -> onnx.ModelProto:
    """onnx shape inference that also works past 2 GB (weights' bytes are not needed for shapes).

    Args:
        model: the model; the returned inferred copy holds the same weights.
        options: passed to `onnx.shape_inference.infer_shapes` (e.g. data_prop, strict_mode).
    """
    return transform_without_weights(model, lambda m: onnx.shape_inference.infer_shapes(m, **options))


def infer_value_info(model: onnx.ModelProto, **options) -> list[onnx.ValueInfoProto]:
    """The main graph's value_info after onnx shape inference, computed on a shell of the model
    whose weights carry no bytes (raises what shape inference raises).

    Shape inference only reads a tensor's type and dims, and the values of the small integer
    tensors that shape arithmetic reads; `onnx.shape_inference.infer_shapes` would serialize and
    parse every weight twice (a 25M-parameter model: 1 s a call, 60 ms on the shell). The shell
    keeps integer tensors and every tensor under `EXTERNAL_MIN_BYTES` whole; the rest become
    external-data references to nothing, as a large model's weights already are.

    Args:
        model: the model; not changed.
        options: passed to `onnx.shape_inference.infer_shapes` (e.g. data_prop, strict_mode).
    """
    return list(onnx.shape_inference.infer_shapes(_weightless_shell(model), **options).graph.value_info)


_SHAPE_DATA_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)


def _weightless_shell(model: onnx.ModelProto) -> onnx.ModelProto:
    shell = onnx.ModelProto()
    _copy_fields(model, shell, skip="graph")
    graph = shell.graph
    _copy_fields(model.graph, graph, skip="initializer")
    for tensor in model.graph.initializer:
        if tensor.data_type in _SHAPE_DATA_TYPES or _inline_bytes(tensor) < EXTERNAL_MIN_BYTES:
            graph.initializer.append(tensor)
            continue
        stub = graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims,
                                     data_location=onnx.TensorProto.EXTERNAL)
        stub.external_data.add(key="location", value=_SHELL_LOCATION)
    return shell


_SHELL_LOCATION = "weightless-shell"


def _with_weights_of(model: onnx.ModelProto, shell: onnx.ModelProto) -> onnx.ModelProto:
    """`shell` (a transform's result on `_weightless_shell(model)`) holding `model`'s weights again."""
    originals = {t.name: t for t in model.graph.initializer}
    tensors = [originals[t.name] if t.name in originals and t.external_data
               and t.external_data[0].value == _SHELL_LOCATION else t for t in shell.graph.initializer]
    del shell.graph.initializer[:]
    shell.graph.initializer.extend(tensors)
    return shell


def _copy_fields(source, destination, *, skip: str) -> None:
    # Not ListFields(): it would read the skipped field too (a weight's bytes, copied).
    for field in source.DESCRIPTOR.fields:
        if field.name == skip:
            continue
        value = getattr(source, field.name)
        if field.is_repeated:
            if not value:
                continue
            getattr(destination, field.name).extend(value)
        elif not source.HasField(field.name):
            continue
        elif field.message_type:
            getattr(destination, field.name).extend(value)
        elif field.message_type:
            getattr(destination, field.name).CopyFrom(value)
        else:
            setattr(destination, field.name, value)


def apply_without_weights(model: onnx.ModelProto, transform) -> None:
    """`transform_without_weights`, the result replacing `model` in place: its weights stay where
    they are instead of being copied into a new message (upb copies by encoding, 6 s for 540 MB)."""
    spill_large_tensors(model)
    result = transform(_weightless_shell(model))
    count = len(model.graph.initializer)
    if len(result.graph.initializer) < count or any(
            new.name != old.name or (not (new.external_data and new.external_data[0].value == _SHELL_LOCATION)
                                     and new != old)
            for new, old in zip(result.graph.initializer, model.graph.initializer)):
        model.CopyFrom(_with_weights_of(model, result))  # the transform changed the weights
        return
    for field in model.DESCRIPTOR.fields:
        if field.name != "graph":
            model.ClearField(field.name)
    for field in model.graph.DESCRIPTOR.fields:
        if field.name != "initializer":
            model.graph.ClearField(field.name)
    _copy_fields(result, model, skip="graph")
    _copy_fields(result.graph, model.graph, skip="initializer")
    model.graph.initializer.extend(result.graph.initializer[count:])  # the transform's own


def transform_without_weights(model: onnx.ModelProto, transform) -> onnx.ModelProto:
    """Apply an onnx tool that serializes the model (shape inference, version conversion) to a
    model of any size: past 2 GB its big tensors move to external data first, and the result
    references the same data. The transform sees the model's weights as bytes-less stand-ins
    (`_weightless_shell`): serializing them in and out cost seconds per call."""
    spill_large_tensors(model)
    return _with_weights_of(model, transform(_weightless_shell(model)))


def check_model(model: onnx.ModelProto) -> None:
    """onnx.checker on a model of any size (raises onnx's own errors).

    Past 2 GB the checker only works on files: the graph is written to a temporary folder beside
    sparse stand-ins of the data files it references (same sizes, no bytes: the checker checks
    the references, not the values; it refuses links to the real files).
    """
    if not _has_external_weights(model):
        onnx.checker.check_model(model)
        return
    spill_large_tensors(model)
    with tempfile.TemporaryDirectory(prefix="llmc-") as folder:
        graph = onnx.ModelProto()
        graph.CopyFrom(model)  # cheap: the weights are references
        aliases: dict[str, str] = {}
        for tensor in _get_all_tensors(graph):
            if uses_external_data(tensor):
                source = ExternalDataInfo(tensor).location
                if source not in aliases:
                    aliases[source] = f"weights{len(aliases)}.data"
                    with open(Path(folder) / aliases[source], "wb") as stand_in:
                        stand_in.truncate(os.path.getsize(source))
                _set_location(tensor, aliases[source])
        onnx.save_model(graph, str(Path(folder) / "model.onnx"))
        onnx.checker.check_model(str(Path(folder) / "model.onnx"))


def serialize(model: onnx.ModelProto) -> dict[str, bytes]:
    """The model as {"model.onnx": bytes} for `sessions.open_session`: its external weights
    (a loaded model's, any size) referenced where they are, by their paths relative to the root
    folder `open_session` gives onnxruntime — no copy, from any number of files."""
    if not _has_external_weights(model):
        return {"model.onnx": model.SerializeToString()}
    spill_large_tensors(model)
    graph = onnx.ModelProto()
    graph.CopyFrom(model)  # cheap: the weights are references
    for tensor in _get_all_tensors(graph):
        if uses_external_data(tensor):
            _set_location(tensor, os.path.relpath(ExternalDataInfo(tensor).location, EXTERNAL_ROOT))
    return {"model.onnx": graph.SerializeToString()}


def point_to_file(graph: bytes, data: FileRange) -> bytes:
    """A serialized graph whose "model.onnx.data" references now name `data`'s file (by its
    base name: onnxruntime resolves it in that folder), at offsets shifted by `data.offset`."""
    model = onnx.load_from_string(bytes(graph))
    for tensor in _get_all_tensors(model):
        if uses_external_data(tensor):
            info = ExternalDataInfo(tensor)
            _set_external(tensor, data.path.name, (info.offset or 0) + data.offset, _external_length(tensor))
    return model.SerializeToString()


def validate(model: onnx.ModelProto, source: Path) -> None:
    """Reject a malformed graph (checker, strict typed shape inference) naming the file."""
    try:
        check_model(model)
        try:
            infer_value_info(model, check_type=True, strict_mode=True)
        except Exception:
            if not model.graph.value_info:
                raise
            # The file's own value_info may be wrong (onnxruntime-genai's builder declares its
            # [1]-shaped constants as scalars): it is only a hint, so infer shapes afresh.
            del model.graph.value_info[:]
            infer_value_info(model, check_type=True, strict_mode=True)
    except Exception as exc:  # checker and inference raise several types; all mean "invalid graph"
        raise LlmcError(f"{source}: invalid ONNX graph: {first_line(exc, 200)}") from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a text file through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise



# --- external data ---------------------------------------------------------------------------


def has_external_weights(model: onnx.ModelProto) -> bool:
    """Whether the model needs a data file: it is large, or references one (pinned by load_onnx)."""
    return _has_external_weights(model)


def _has_external_weights(model: onnx.ModelProto) -> bool:
    # References first: sizing a model tensor by tensor costs ~50 ms at SmolLM2's size, per call.
    return any(uses_external_data(t) for t in _get_all_tensors(model)) or is_large(model)


def _external_length(tensor: onnx.TensorProto) -> int:
    info = ExternalDataInfo(tensor)
    if info.length is not None:
        return int(info.length)
    itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    return itemsize * int(np.prod(tensor.dims))


def _pin_locations(model: onnx.ModelProto, folder: Path) -> None:
    """Make external locations absolute (and lengths explicit) so the model can go anywhere."""
    root = folder.resolve()
    for tensor in _get_all_tensors(model):
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        source = (root / info.location).resolve()
        if root not in source.parents or not source.is_file():
            raise ValueError(f"tensor '{tensor.name}': data file '{info.location}' is not a file beside the model")
        _set_external(tensor, str(source), info.offset or 0, _external_length(tensor))


def _write_with_external_data(model: onnx.ModelProto, path: Path, data_name: str) -> list[int]:
    """Write the graph to `path` and every tensor of 1 KiB or more to `data_name` beside it,
    streaming from the tensors' current files; returns the new offsets, in `_get_all_tensors` order."""
    spill_large_tensors(model)
    graph = onnx.ModelProto()
    graph.CopyFrom(model)  # cheap after spilling: the weights are references
    offsets = []
    with open(path.with_name(data_name), "wb") as out:
        for tensor in _get_all_tensors(graph):
            if uses_external_data(tensor):
                info = ExternalDataInfo(tensor)
                length = _external_length(tensor)
                offset = _pad(out)
                _copy_range(info.location, info.offset or 0, length, out)
            elif tensor.data_type != onnx.TensorProto.STRING and tensor.ByteSize() >= EXTERNAL_MIN_BYTES:
                data = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
                length, offset = len(data), _append_aligned(out, data)
            else:
                offsets.append(None)
                continue
            _set_external(tensor, data_name, offset, length)
            offsets.append(offset)
    onnx.save_model(graph, str(path))
    return offsets


def _repoint(model: onnx.ModelProto, data_file: Path, offsets: list[int | None]) -> None:
    """After a save, reference the written data file at `offsets` (tensors that were references)."""
    for tensor, offset in zip(_get_all_tensors(model), offsets):
        if offset is not None and uses_external_data(tensor):
            _set_external(tensor, str(data_file.resolve()), offset, _external_length(tensor))


def _set_external(tensor: onnx.TensorProto, location: str, offset: int, length: int, *, engine: bool = False) -> None:
    """Reference `length` bytes of `location` from `offset`; an engine's reference writes the
    offset at the fixed width `engine_file.bind_weights` rewrites in place."""
    tensor.ClearField("raw_data")
    for name in _TYPED_FIELDS:
        tensor.ClearField(name)
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset).zfill(OFFSET_DIGITS if engine else 0)),
                       ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _set_location(tensor: onnx.TensorProto, location: str) -> None:
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location


def _with_weights_inline(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy holding its external tensors' bytes (a model under 2 GB is saved as one file)."""
    if not _has_external_weights(model):
        return model
    inline = onnx.ModelProto()
    inline.CopyFrom(model)
    for tensor in _get_all_tensors(inline):
        if uses_external_data(tensor):
            info = ExternalDataInfo(tensor)
            _set_inline(tensor, _read_range(info.location, info.offset or 0, _external_length(tensor)))
    return inline


def _set_inline(tensor: onnx.TensorProto, data: bytes) -> None:
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = data


def _pad(out) -> int:
    offset = -(-out.tell() // _ALIGN) * _ALIGN
    out.write(b"\0" * (offset - out.tell()))
    return offset


def _append_aligned(out, data: bytes) -> int:
    offset = _pad(out)
    out.write(data)
    return offset


def _copy_range(source: str, offset: int, length: int, out) -> None:
    """Stream `length` bytes of `source` from `offset` into `out` (through the page cache, not
    into this process's memory)."""
    with open(source, "rb") as f:
        f.seek(offset)
        while length > 0:
            chunk = f.read(min(_CHUNK, length))
            if not chunk:
                raise LlmcError(f"{source}: external data ends before the {length} bytes a tensor needs")
            out.write(chunk)
            length -= len(chunk)


def _read_range(source: str, offset: int, length: int) -> bytes:
    with open(source, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise LlmcError(f"{source}: external data ends before the {length} bytes a tensor needs")
    return data


_scratch_dir: tempfile.TemporaryDirectory | None = None


def _scratch_file() -> Path:
    """This process's scratch data file (in TMPDIR; removed at exit)."""
    global _scratch_dir
    if _scratch_dir is None:
        _scratch_dir = tempfile.TemporaryDirectory(prefix="llmc-weights-")
    return Path(_scratch_dir.name) / "spilled.data"
