"""Where an ONNX model's weights are: references to external data, their values, and moving them.

A model loaded by `onnx_io.load_onnx` holds no weights: each tensor of `EXTERNAL_MIN_BYTES` or more
is an external-data reference with an absolute `location` (the source's data file, the .onnx
file itself, an engine file, or this process's scratch file). Values are memory-mapped read-only;
new big tensors go to the scratch file, never into protobuf memory, which upb frees only with the
whole message.

Tensors of the types NumPy holds as ONNX stores them are read and sized with NumPy alone; onnx-ir
decodes the rest (bfloat16, float8, packed 4- and 2-bit). It is imported only then: `import
onnx_ir` imports sympy, 35 MB, a tenth of `llmc compile`'s peak memory on the 1B checkpoint
(bench/large_model_bench.py), and a float model is compiled and served without it.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

from llmc.errors import LlmcError
from llmc.formats.engine_file import EXTERNAL_ROOT, OFFSET_DIGITS, WEIGHTS_LOCATION, FileRange

# In a loaded or large model, tensors this size or more live in external data; smaller ones
# (shape arithmetic that shape inference folds) stay inline.
EXTERNAL_MIN_BYTES = 1024
# External tensors start at multiples of this, so a reader can memory-map them in place.
ALIGN = 4096
# Integer tensors stay inline: shape inference reads their values (shapes, indices).
SHAPE_DATA_TYPES = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
_SHELL_LOCATION = "weightless-shell"
_NUMPY_TYPES = {t: np.dtype(helper.tensor_dtype_to_np_dtype(t)).newbyteorder("<") for t in (
    onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BOOL,
    *(getattr(onnx.TensorProto, f"{sign}INT{bits}") for sign in ("", "U") for bits in (8, 16, 32, 64)))}


def pin_locations(model: onnx.ModelProto, folder: Path) -> None:
    """Make external locations absolute (and lengths explicit) so the model can go anywhere."""
    root = folder.resolve()
    for tensor in _get_all_tensors(model):
        if uses_external_data(tensor):
            info = ExternalDataInfo(tensor)
            source = (root / info.location).resolve()
            if root not in source.parents or not source.is_file():
                raise ValueError(f"tensor '{tensor.name}': data file '{info.location}' is not a file beside the model")
            set_external(tensor, str(source), info.offset or 0, external_length(tensor))


def tensor_array(tensor: onnx.TensorProto) -> np.ndarray:
    """The value of a tensor; one in external data (a loaded model's weights) is memory-mapped
    read-only, not loaded into the proto (which `numpy_helper.to_array` would do).

    Args:
        tensor: an initializer or attribute tensor.
    """
    if not uses_external_data(tensor):
        return numpy_helper.to_array(tensor)
    info = ExternalDataInfo(tensor)
    if not os.path.isabs(info.location):
        raise LlmcError(f"tensor '{tensor.name}': its external data was not loaded")
    dtype = _NUMPY_TYPES.get(tensor.data_type)
    if dtype is None or not math.prod(tensor.dims):  # np.memmap cannot map nothing
        import onnx_ir as ir  # see the module docstring

        return ir.serde.deserialize_tensor(tensor).numpy()
    return np.memmap(info.location, dtype, "r", info.offset or 0, tuple(tensor.dims))


def make_initializer(value: np.ndarray, name: str, *, external: bool) -> onnx.TensorProto:
    """`numpy_helper.from_array`, except that with `external` (a pass working on a model loaded
    from a file) a tensor of `EXTERNAL_MIN_BYTES` or more is written straight to the scratch file:
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
    with open(_scratch_file(), "ab") as out:
        # The array itself, not `tobytes()`: a merged weight (92 MB on the 1B checkpoint) copied
        # once more would set the compile's peak memory.
        set_external(tensor, str(_scratch_file()), _append_aligned(out, data), data.nbytes)
    return tensor


def spill(model: onnx.ModelProto) -> int:
    """Move the model's inline tensors of `EXTERNAL_MIN_BYTES` or more, integers aside, to the
    scratch file; returns the bytes moved."""
    moved = 0
    with open(_scratch_file(), "ab") as out:
        for tensor in _get_all_tensors(model):
            if (uses_external_data(tensor) or tensor.data_type in (onnx.TensorProto.STRING, *SHAPE_DATA_TYPES)
                    or tensor_bytes(tensor) < EXTERNAL_MIN_BYTES):
                continue
            data = tensor_data(tensor)
            set_external(tensor, str(_scratch_file()), _append_aligned(out, data), len(data))
            moved += len(data)
    return moved


def tensor_bytes(tensor: onnx.TensorProto) -> int:
    # Raw bytes are sized from the dims: upb sizes a message by encoding it (80 ms a 25M-parameter model).
    if uses_external_data(tensor):
        return external_length(tensor)
    if tensor.HasField("raw_data") and tensor.data_type != onnx.TensorProto.STRING:
        return _values_bytes(tensor)
    return tensor.ByteSize()


def external_length(tensor: onnx.TensorProto) -> int:
    length = ExternalDataInfo(tensor).length
    return int(length) if length is not None else _values_bytes(tensor)


def _values_bytes(tensor: onnx.TensorProto) -> int:
    count = math.prod(tensor.dims)
    if tensor.data_type in _NUMPY_TYPES:
        return _NUMPY_TYPES[tensor.data_type].itemsize * count
    import onnx_ir as ir  # see the module docstring

    return math.ceil(ir.DataType(tensor.data_type).bitwidth * count / 8)


def tensor_data(tensor: onnx.TensorProto) -> bytes:
    """A tensor's values as `raw_data` holds them, read from where they are."""
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    import onnx_ir as ir  # typed fields, external data: onnx-ir encodes every type (module docstring)

    return ir.serde.deserialize_tensor(tensor).tobytes()


def engine_weights(*models: onnx.ModelProto) -> list[bytes | FileRange]:
    """Reference the models' tensors of 1 KiB or more as an engine's "model.onnx.data" section
    (as `engine_file.bind_weights` expects) and return that section's parts: each tensor's bytes
    where they are (inline, or a range of its external file), aligned; `write_engine` streams
    them. The graphs then hold no weights, whatever their size. Graphs made from one model (a
    paged engine's and its single-sequence graph) share each tensor of the same name."""
    parts: list[bytes | FileRange] = []
    placed: dict[str, tuple[int, int]] = {}
    size = 0
    for tensor in (tensor for model in models for tensor in _get_all_tensors(model)):
        if tensor.name not in placed:
            if uses_external_data(tensor):
                info = ExternalDataInfo(tensor)
                data: bytes | FileRange = FileRange(Path(info.location), info.offset or 0, external_length(tensor))
            elif tensor.data_type != onnx.TensorProto.STRING and tensor_bytes(tensor) >= EXTERNAL_MIN_BYTES:
                data = tensor_data(tensor)
            else:
                continue
            offset = -(-size // ALIGN) * ALIGN
            parts += [bytes(offset - size), data]
            size = offset + (data.length if isinstance(data, FileRange) else len(data))
            if not tensor.name:
                set_external(tensor, WEIGHTS_LOCATION, offset, size - offset, engine=True)
                continue
            placed[tensor.name] = (offset, size - offset)
        set_external(tensor, WEIGHTS_LOCATION, *placed[tensor.name], engine=True)
    return parts


def set_external(tensor: onnx.TensorProto, location: str, offset: int, length: int, *, engine: bool = False) -> None:
    """Reference `length` bytes of `location` from `offset`; an engine's reference writes the
    offset at the fixed width `engine_file.bind_weights` rewrites in place."""
    for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        tensor.ClearField(name)
    del tensor.external_data[:]
    offset_text = str(offset).zfill(OFFSET_DIGITS if engine else 0)
    for key, value in (("location", location), ("offset", offset_text), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)
    tensor.data_location = onnx.TensorProto.EXTERNAL


def set_location(tensor: onnx.TensorProto, location: str) -> None:
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location


def set_inline(tensor: onnx.TensorProto, data: bytes) -> None:
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = data


def inlined(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, or a copy of it holding its external tensors' bytes (a model under 2 GB is one file)."""
    if not any(uses_external_data(t) for t in _get_all_tensors(model)):
        return model
    inline = onnx.ModelProto()
    inline.CopyFrom(model)
    for tensor in _get_all_tensors(inline):
        if uses_external_data(tensor):
            set_inline(tensor, tensor_data(tensor))
    return inline


def _append_aligned(out, data) -> int:
    offset = -(-out.tell() // ALIGN) * ALIGN
    out.write(b"\0" * (offset - out.tell()))
    out.write(data)
    return offset


def weightless_shell(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its inline weights (tensors of `EXTERNAL_MIN_BYTES` or more, integers aside)
    as external references to nothing, as a loaded model's weights already are."""
    shell = onnx.ModelProto()
    _copy_fields(model, shell, skip="graph")
    _copy_fields(model.graph, shell.graph, skip="initializer")
    for tensor in model.graph.initializer:
        if (uses_external_data(tensor) or tensor.data_type in SHAPE_DATA_TYPES
                or tensor_bytes(tensor) < EXTERNAL_MIN_BYTES):
            shell.graph.initializer.append(tensor)
            continue
        stub = shell.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims,
                                           data_location=onnx.TensorProto.EXTERNAL)
        stub.external_data.add(key="location", value=_SHELL_LOCATION)
    return shell


def is_stub(tensor: onnx.TensorProto) -> bool:
    return bool(tensor.external_data) and tensor.external_data[0].value == _SHELL_LOCATION


def with_weights_of(model: onnx.ModelProto, shell: onnx.ModelProto) -> onnx.ModelProto:
    """`shell` (a transform's result on `weightless_shell(model)`) holding `model`'s weights again."""
    originals = {t.name: t for t in model.graph.initializer}
    tensors = [originals[t.name] if is_stub(t) and t.name in originals else t for t in shell.graph.initializer]
    del shell.graph.initializer[:]
    shell.graph.initializer.extend(tensors)
    return shell


def _copy_fields(source, destination, *, skip: str) -> None:
    # Not ListFields(): it would read the skipped field too (a weight's bytes, copied).
    for field in source.DESCRIPTOR.fields:
        value = getattr(source, field.name)
        if field.name == skip or (not value if field.is_repeated else not source.HasField(field.name)):
            continue
        if field.is_repeated:
            getattr(destination, field.name).extend(value)
        elif field.message_type:
            getattr(destination, field.name).CopyFrom(value)
        else:
            setattr(destination, field.name, value)


_scratch_dir: tempfile.TemporaryDirectory | None = None


def _scratch_file() -> Path:
    """This process's scratch data file (in TMPDIR; removed at exit)."""
    global _scratch_dir
    if _scratch_dir is None:
        _scratch_dir = tempfile.TemporaryDirectory(prefix="llmc-weights-")
    return Path(_scratch_dir.name) / "spilled.data"

