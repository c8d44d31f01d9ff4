"""The decoder of --no-paged engines: one onnxruntime session over the contiguous decoder-with-past graph."""

from __future__ import annotations

import mmap

import numpy as np
import onnxruntime as ort

from llmc.formats.engine_file import EngineFile, FileRange
from llmc.formats.sessions import open_session, session_options

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


class OnnxRuntimeDecoder:
    """One onnxruntime session over the decoder-with-past graph of an engine.

    Args:
        engine: the loaded engine file.
        threads: intra-op threads; None lets onnxruntime use every core.
    """

    def __init__(self, engine: EngineFile, threads: int | None = None):
        manifest = engine.manifest
        self.geometry = manifest.geometry
        self.dtype = _NUMPY_DTYPES[manifest.dtype]
        self.has_position_ids = manifest.has_position_ids
        options = session_options(threads, alone=True)
        files = {"model.onnx": engine.sections["model.onnx"]}
        if "model.onnx.data" in engine.sections:  # onnxruntime maps the weights from the engine file
            files["model.onnx.data"] = FileRange(engine.path, engine.offsets["model.onnx.data"])
        self.session = open_session(files, options)
        release_model_bytes(self.session)
        drop_file_pages(engine)
        layers = range(self.geometry.num_layers)
        self._past_names = [f"past_key_values.{i}.{p}" for i in layers for p in ("key", "value")]
        # Ask for outputs by name: graphs from other exporters may order them differently.
        self._output_names = ["logits"] + [f"present.{i}.{p}" for i in layers for p in ("key", "value")]

    def empty_cache(self, batch: int) -> list[np.ndarray]:
        """A cache holding no tokens: one [batch, kv_heads, 0, head_dim] array per key and value."""
        g = self.geometry
        return [np.zeros((batch, g.num_kv_heads, 0, g.head_dim), self.dtype)] * len(self._past_names)

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
             cache: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Run the graph once; returns logits [batch, seq, vocab] and the grown cache."""
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask,
                 **dict(zip(self._past_names, cache))}
        if self.has_position_ids:
            feeds["position_ids"] = position_ids
        logits, *present = self.session.run(self._output_names, feeds)
        return logits, present


def release_model_bytes(session: ort.InferenceSession | None) -> None:
    """Drop the serialized model onnxruntime's Python class keeps after building a session from
    bytes (its own comment: "bad as we're holding the memory indefinitely"); it only rebuilds
    from them when falling back from a GPU provider. Measured on SmolLM2-135M's 30 segments:
    653 MB of resident memory, as much as the weights."""
    if session is not None and isinstance(getattr(session, "_model_bytes", None), bytes):
        session._model_bytes = None


def drop_file_pages(engine: EngineFile) -> None:
    """Take the engine file's pages out of this process's resident set once the sessions hold
    the weights (reading a section through the memory map counted it there: 620 MB for
    SmolLM2-135M). The pages stay in the page cache, and a later read maps them again."""
    for view in engine.sections.values():
        mapping = view.obj
        if isinstance(mapping, mmap.mmap) and hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_DONTNEED)
            return
