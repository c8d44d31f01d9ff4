"""The onnxruntime backend: runs one decoder step of an engine's ONNX payload on the CPU."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from llmc.formats.engine_file import EngineFile
from llmc.formats.onnx_io import FileRange
from llmc.formats.sessions import open_session

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
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.log_severity_level = 3
        files = {"model.onnx": engine.sections["model.onnx"]}
        if "model.onnx.data" in engine.sections:  # past 2 GB: onnxruntime reads the weights from the engine
            files["model.onnx.data"] = FileRange(engine.path, engine.offsets["model.onnx.data"])
        self.session = open_session(files, options)
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
