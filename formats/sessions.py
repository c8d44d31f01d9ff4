"""onnxruntime sessions over serialized models, for the compiler's checks and the runtime alike."""

from __future__ import annotations

import onnxruntime as ort

from llmc.formats.onnx_io import FileRange, point_to_file


def open_session(files: dict, options: ort.SessionOptions) -> ort.InferenceSession:
    """A CPU session over a serialized model, external data included, without copying it to disk.

    Args:
        files: "model.onnx" bytes, plus "model.onnx.data" for models past 2 GB: a `FileRange`
            (onnxruntime reads the file itself and holds the weights once) or bytes-like
            (handed over as an in-memory file; onnxruntime copies it, so resident memory holds
            both until the caller drops it).
        options: session options. onnxruntime keeps the in-memory file (or the data folder) in
            them: sessions sharing `options` must share the data (as a paged engine's segments do).
    """
    graph, data = files["model.onnx"], files.get("model.onnx.data")
    if isinstance(data, FileRange):
        graph = point_to_file(graph, data)
        key, folder = "session.model_external_initializers_file_folder_path", str(data.path.resolve().parent)
        if _config_entry(options, key) != folder:
            options.add_session_config_entry(key, folder)
    elif data is not None:
        try:
            options.add_external_initializers_from_files_in_memory(["model.onnx.data"], [data], [len(data)])
        except RuntimeError as exc:
            if "already been added" not in str(exc):
                raise
    return ort.InferenceSession(bytes(graph), options, providers=["CPUExecutionProvider"])


def _config_entry(options: ort.SessionOptions, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:
        return None
