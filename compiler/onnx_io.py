"""Loading and saving ONNX models safely.

Saving goes through a temporary folder next to the destination and renames into place, so a
failed or interrupted save never leaves a file that looks good. Models whose tensors exceed the
2 GB protobuf limit are written with their weights in one external-data file beside them.
"""

from __future__ import annotations

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
    try:
        external = model.ByteSize() > EXTERNAL_DATA_THRESHOLD
    except ValueError:  # some protobuf builds refuse even to size a message over 2 GB
        external = True
    staging = Path(tempfile.mkdtemp(prefix=".llmc-", dir=path.parent))
    try:
        staged = staging / path.name
        onnx.save_model(model, str(staged), save_as_external_data=external,
                        all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        if external:
            os.replace(staging / data_name, path.parent / data_name)
        elif (path.parent / data_name).exists():
            (path.parent / data_name).unlink()  # a stale data file from an earlier, larger save
        os.replace(staged, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
