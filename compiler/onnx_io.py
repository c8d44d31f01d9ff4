"""Loading and saving ONNX models safely.

Saving goes through a temporary folder next to the destination and renames into place, so a
failed or interrupted save never leaves a file that looks good. Models whose tensors exceed the
2 GB protobuf limit are written with their weights in one external-data file beside them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import onnx

from llmc.errors import LlmcError

# Protobuf cannot serialize a message of 2 GiB or more; stay clear of it with headroom for the graph.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


def load_onnx(path: str | os.PathLike, *, load_weights: bool = True) -> onnx.ModelProto:
    """Load an ONNX file, with its external data if any.

    Args:
        path: the .onnx file.
        load_weights: False reads only the graph, leaving external tensors as references.
    """
    path = Path(path)
    if not path.is_file():
        raise LlmcError(f"{path}: no such file")
    try:
        return onnx.load(str(path), load_external_data=load_weights)
    except Exception as exc:  # protobuf raises several unrelated types on garbage input
        raise LlmcError(f"{path}: not a readable ONNX model ({_first_line(exc)})") from None


def save_onnx(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write `model` to `path` atomically; weights go to `<name>.data` when the model is large.

    Args:
        model: the model; its external-data references, if any, must already be loaded.
        path: the destination .onnx file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_name = path.name + ".data"
    external = is_large(model)
    staging = Path(tempfile.mkdtemp(prefix=".llmc-", dir=path.parent))
    try:
        staged = staging / path.name
        onnx.save_model(model, str(staged), save_as_external_data=external,
                        all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        if external:
            # Saving moved the weights out of the in-memory model; bring them back so the
            # caller's model is unchanged.
            onnx.load_external_data_for_model(model, str(staging))
        if external:
            os.replace(staging / data_name, path.parent / data_name)
        elif (path.parent / data_name).exists():
            (path.parent / data_name).unlink()  # a stale data file from an earlier, larger save
        os.replace(staged, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def is_large(model: onnx.ModelProto) -> bool:
    """Whether the model is too big to serialize as one protobuf message."""
    try:
        return model.ByteSize() > EXTERNAL_DATA_THRESHOLD
    except ValueError:  # some protobuf builds refuse even to size a message over 2 GB
        return True


def infer_shapes(model: onnx.ModelProto, **options) -> onnx.ModelProto:
    """onnx shape inference that also works past 2 GB (weights' bytes are not needed for shapes).

    Args:
        model: the model; the returned inferred copy holds the same weights.
        options: passed to `onnx.shape_inference.infer_shapes` (e.g. data_prop, strict_mode).
    """
    return transform_without_weights(model, lambda m: onnx.shape_inference.infer_shapes(m, **options))


def transform_without_weights(model: onnx.ModelProto, transform) -> onnx.ModelProto:
    """Apply an onnx tool that serializes the model (shape inference, version conversion) to a
    model of any size: past 2 GB its large tensors are set aside and put back in the result."""
    with weights_set_aside(model) as stashed:
        result = transform(model)
    for tensor in result.graph.initializer:
        if tensor.name in stashed:
            tensor.raw_data = stashed[tensor.name]
    return result


def check_model(model: onnx.ModelProto) -> None:
    """onnx.checker on a model of any size (raises onnx's own errors).

    Past 2 GB the checker only works on files, so the model is written out first.
    """
    if not is_large(model):
        onnx.checker.check_model(model)
        return
    with tempfile.TemporaryDirectory(prefix="llmc-") as folder:
        save_onnx(model, Path(folder) / "model.onnx")
        onnx.checker.check_model(str(Path(folder) / "model.onnx"))


def serialize(model: onnx.ModelProto) -> dict[str, bytes]:
    """The model as files: {"model.onnx": ...}, plus "model.onnx.data" when past 2 GB."""
    with tempfile.TemporaryDirectory(prefix="llmc-") as folder:
        path = Path(folder) / "model.onnx"
        save_onnx(model, path)
        return {file.name: file.read_bytes() for file in sorted(Path(folder).iterdir())}


def load_model_files(files: dict, folder: str | os.PathLike) -> onnx.ModelProto:
    """The model from `serialize`'s files (e.g. an engine's sections), with its weights loaded;
    past 2 GB the files are written into `folder` first."""
    if "model.onnx.data" not in files:
        return onnx.load_from_string(bytes(files["model.onnx"]))
    for name, data in files.items():
        (Path(folder) / name).write_bytes(data)
    return load_onnx(Path(folder) / "model.onnx")


@contextlib.contextmanager
def weights_set_aside(model: onnx.ModelProto):
    """For a model past 2 GB, temporarily empty its big tensors so it can be serialized."""
    stashed: dict[str, bytes] = {}
    if is_large(model):
        for tensor in model.graph.initializer:
            if len(tensor.raw_data) > 4096:  # small ones may feed shape arithmetic: keep them
                stashed[tensor.name] = tensor.raw_data
                tensor.ClearField("raw_data")
    try:
        yield stashed
    finally:
        for tensor in model.graph.initializer:
            if tensor.name in stashed:
                tensor.raw_data = stashed[tensor.name]


def validate(model: onnx.ModelProto, source: Path) -> None:
    """Reject a malformed graph (checker, strict typed shape inference) naming the file."""
    try:
        check_model(model)
        infer_shapes(model, check_type=True, strict_mode=True)
    except Exception as exc:  # checker and inference raise several types; all mean "invalid graph"
        raise LlmcError(f"{source}: invalid ONNX graph: {_first_line(exc)}") from None


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]
