"""Loading, checking and saving ONNX models safely, at any size.

Saves go through a temporary folder beside the destination and rename into place, so a failed
save never leaves a file that looks good. Past the 2 GB protobuf limit, onnx-ir's `ir.save`
writes the weights to one external-data file beside the model, each from where it is.

A model loaded from a file (`load_onnx`), of any size, never holds its weights: they are
external-data references (formats/onnx_weights.py), and onnx's checker and shape inference see
a copy whose weights carry no bytes. Inline weights are read in place and written without a
copy at protobuf's wire level (formats/onnx_wire.py says why onnx-ir does not serve there).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, _get_attribute_tensors, uses_external_data

from llmc.errors import LlmcError, first_line
from llmc.formats.engine_file import EXTERNAL_ROOT
from llmc.formats.onnx_weights import (ALIGN, EXTERNAL_MIN_BYTES, engine_weights, external_length, inlined,  # noqa: F401
                                       make_initializer, pin_locations, set_external, set_inline,
                                       set_location, spill, tensor_array, tensor_bytes, tensor_data,
                                       weightless_shell, with_weights_of)
from llmc.formats.onnx_wire import initializer_parts, parse_leaving_inline_weights

# Protobuf cannot serialize a message of 2 GiB or more; stay clear of it with headroom for the graph.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


def load_onnx(path: str | os.PathLike, *, load_weights: bool = True) -> onnx.ModelProto:
    """Load an ONNX file, its weights referenced where they are (see the module docstring).

    Args:
        path: the .onnx file.
        load_weights: False reads only the graph, leaving external references as the file has them.
    """
    path = Path(path)
    if not path.is_file():
        raise LlmcError(f"{path}: no such file")
    try:
        if not load_weights:
            return onnx.load(str(path), load_external_data=False)
        model, inline_weights = parse_leaving_inline_weights(path, EXTERNAL_MIN_BYTES)
    except Exception as exc:  # protobuf raises several unrelated types on garbage input
        raise LlmcError(f"{path}: not a readable ONNX model ({first_line(exc, 200)})") from None
    try:
        pin_locations(model, path.parent)
    except (OSError, ValueError) as exc:
        raise LlmcError(f"{path}: cannot read its external data ({first_line(exc, 200)})") from None
    for index, offset, length in inline_weights:
        set_external(model.graph.initializer[index], str(path.resolve()), offset, length)
    if not spill(model):
        return model
    weightless = onnx.ModelProto()  # a fresh message: the parsed one's memory still holds the weights
    weightless.ParseFromString(model.SerializeToString())
    return weightless


def has_external_weights(model: onnx.ModelProto) -> bool:
    """Whether the model needs a data file: it is large, or references one (pinned by load_onnx)."""
    # References first: sizing a model tensor by tensor costs ~50 ms at SmolLM2's size, per call.
    return any(uses_external_data(t) for t in _get_all_tensors(model)) or is_large(model)


def is_large(model: onnx.ModelProto) -> bool:
    """Whether the model is too big to be one protobuf message (sized tensor by tensor: protobuf
    cannot size a message past 2 GB)."""
    total = sum(n.ByteSize() for n in model.graph.node)  # Constant nodes may hold tensors
    return total + sum(tensor_bytes(t) for t in model.graph.initializer) > EXTERNAL_DATA_THRESHOLD


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write `model` to `path` atomically; weights go to `<name>.data` when the model is large
    (and the model then references that file), else inline.

    Args:
        model: the model.
        path: the destination .onnx file.
    """
    path = Path(path)
    if not is_large(model):
        with _staging(path) as staging:
            onnx.save_model(inlined(model), str(staging / path.name))
            _publish_inline(staging / path.name, path)
        return
    spill(model)
    # onnx-ir writes initializers to the data file, not attribute tensors: those (Constants, small)
    # go inline, so that no reference is left to a file this save may replace.
    for tensor in _get_attribute_tensors(model):
        if uses_external_data(tensor):
            set_inline(tensor, tensor_data(tensor))
    _save_ir(model, path)
    data_file = str((path.parent / (path.name + ".data")).resolve())
    written = {t.name: t for t in onnx.load(str(path), load_external_data=False).graph.initializer}
    for tensor in model.graph.initializer:  # its source data file may just have been replaced
        if uses_external_data(tensor):
            set_external(tensor, data_file, ExternalDataInfo(written[tensor.name]).offset or 0, external_length(tensor))


def save_ir_model(model, path: str | os.PathLike) -> None:
    """Write an onnx_ir model (what torch.onnx exports) atomically, like `save_onnx`; past 2 GB
    its tensors go straight to the data file, never all copied into one ModelProto.

    Args:
        model: an `onnx_ir.Model`.
        path: the destination .onnx file.
    """
    import onnx_ir as ir  # not at the top: formats/onnx_weights.py says why

    total = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if total <= EXTERNAL_DATA_THRESHOLD:
        save_onnx(ir.serde.serialize_model(model), path)
    else:
        _save_ir(model, path)


def save_with_external_data(model: bytes, tensors: Sequence[tuple[onnx.TensorProto, memoryview]],
                            path: str | os.PathLike, *, metadata: dict[str, str]) -> None:
    """Write a serialized ModelProto without weights, with `tensors` (headers and bytes, as
    `save_serialized` takes them) as its initializers in `<name>.data` beside it and `metadata`
    as its metadata_props, atomically; each tensor is written from where its bytes are."""
    import onnx_ir as ir  # not at the top: formats/onnx_weights.py says why

    proto = onnx.load_from_string(model)
    interface = len(proto.graph.input)
    # Declared as inputs for the deserializer, each weight is one value its readers share; a name
    # it finds in no scope it logs as an invalid model (a line a weight) and gives each reader its own.
    proto.graph.input.extend(onnx.helper.make_tensor_value_info(header.name, header.data_type, list(header.dims))
                             for header, _ in tensors)
    graph = ir.serde.deserialize_model(proto)
    weights = list(graph.graph.inputs)[interface:]
    del graph.graph.inputs[interface:]
    for value, (header, data) in zip(weights, tensors):
        dtype = ir.DataType(header.data_type)
        array = np.frombuffer(data, dtype.numpy()).reshape(header.dims)
        value.const_value = ir.Tensor(array, dtype=dtype, name=header.name)
        graph.graph.register_initializer(value)
    graph.metadata_props.update(metadata)
    _save_ir(graph, path)


def _save_ir(model, path: Path) -> None:
    """Write an onnx_ir model or a ModelProto (whose weights then become onnx-ir tensors in place)."""
    import onnx_ir as ir  # not at the top: formats/onnx_weights.py says why

    model = ir.serde.deserialize_model(model) if isinstance(model, onnx.ModelProto) else model
    path = Path(path)
    data_name = path.name + ".data"
    with _staging(path) as staging:
        ir.save(model, staging / path.name, external_data=data_name, size_threshold_bytes=EXTERNAL_MIN_BYTES - 1,
                alignment=ALIGN, align_threshold=0)
        os.replace(staging / data_name, path.parent / data_name)
        os.replace(staging / path.name, path)


def save_serialized(model: bytes, tensors: Sequence[tuple[onnx.TensorProto, memoryview]], path: str | os.PathLike,
                    *, metadata: dict[str, str]) -> None:
    """Write a serialized ModelProto with `tensors` (TensorProto headers and their bytes) as inline
    initializers (under 2 GB) and `metadata` as its metadata_props, atomically, without parsing it
    or gathering it into one buffer: protobuf merges concatenated messages, so the tensors and the
    metadata follow the model's bytes as messages of their own (see formats/onnx_wire.py).

    Args:
        model: the serialized model.
        tensors: initializers to add, written from where their bytes are.
        path: the destination .onnx file (a stale `<name>.data` beside it is removed).
        metadata: key/value pairs for metadata_props.
    """
    path = Path(path)
    extra = onnx.ModelProto()
    for key, value in metadata.items():
        extra.metadata_props.add(key=key, value=value)
    with _staging(path) as staging:
        with open(staging / path.name, "wb") as f:
            for part in [model, *initializer_parts(tensors), extra.SerializeToString()]:
                f.write(part)
        _publish_inline(staging / path.name, path)


@contextlib.contextmanager
def _staging(path: Path):
    """A temporary folder beside `path` to write its files in before they are renamed into place
    (a reader never sees a partial file); removed afterwards, whatever happened."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".llmc-", dir=path.parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish_inline(staged: Path, path: Path) -> None:
    """Move a model written with its weights inline into place, removing a stale `<name>.data`."""
    (path.parent / (path.name + ".data")).unlink(missing_ok=True)
    os.replace(staged, path)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a text file through a temporary file and a rename."""
    path = Path(path)
    with _staging(path) as staging:
        (staging / path.name).write_text(text)
        os.replace(staging / path.name, path)


def serialize(model: onnx.ModelProto) -> dict[str, bytes]:
    """The model as {"model.onnx": bytes} for `sessions.open_session`: its external weights
    (a loaded model's, any size) referenced where they are, by their paths relative to the root
    folder `open_session` gives onnxruntime — no copy, from any number of files."""
    if not has_external_weights(model):
        return {"model.onnx": model.SerializeToString()}
    spill(model)
    graph = onnx.ModelProto()
    graph.CopyFrom(model)  # cheap: the weights are references
    for tensor in _get_all_tensors(graph):
        if uses_external_data(tensor):
            set_location(tensor, os.path.relpath(ExternalDataInfo(tensor).location, EXTERNAL_ROOT))
    return {"model.onnx": graph.SerializeToString()}


def infer_shapes(model: onnx.ModelProto, **options) -> onnx.ModelProto:
    """onnx shape inference on a model of any size (weights' bytes are not needed for shapes).

    Args:
        model: the model; the returned inferred copy holds the same weights.
        options: passed to `onnx.shape_inference.infer_shapes` (e.g. data_prop, strict_mode).
    """
    return _on_shell(model, lambda shell: onnx.shape_inference.infer_shapes(shell, **options))


def infer_value_info(model: onnx.ModelProto, **options) -> list[onnx.ValueInfoProto]:
    """The main graph's value_info after onnx shape inference (raises what it raises) on
    `weightless_shell(model)`: on the model, it serializes and parses every weight twice.

    Args:
        model: the model; not changed.
        options: passed to `onnx.shape_inference.infer_shapes` (e.g. data_prop, strict_mode).
    """
    return list(onnx.shape_inference.infer_shapes(weightless_shell(model), **options).graph.value_info)


def apply_without_weights(model: onnx.ModelProto, transform: Callable[[onnx.ModelProto], onnx.ModelProto]) -> None:
    """Apply an onnx tool that serializes the model (version conversion) to a model of any size,
    on `weightless_shell(model)`; the result, holding the model's weights, replaces `model`.
    A loaded model's weights are references, so the copy is the graph's structure."""
    model.CopyFrom(_on_shell(model, transform))


def _on_shell(model: onnx.ModelProto, transform: Callable[[onnx.ModelProto], onnx.ModelProto]) -> onnx.ModelProto:
    if has_external_weights(model):  # the result then references the weights, not holds them
        spill(model)
    return with_weights_of(model, transform(weightless_shell(model)))


def check_model(model: onnx.ModelProto) -> None:
    """onnx.checker on a model of any size (raises onnx's own errors).

    The checker takes only relative external locations and checks them against files: a model
    with external weights is written to a temporary folder beside sparse stand-ins of the data
    files it references (same sizes, no bytes; the checker refuses links to the real files).
    """
    if not has_external_weights(model):
        onnx.checker.check_model(model)
        return
    spill(model)
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
                set_location(tensor, aliases[source])
        onnx.save_model(graph, str(Path(folder) / "model.onnx"))
        onnx.checker.check_model(str(Path(folder) / "model.onnx"))


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
