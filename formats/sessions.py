"""onnxruntime sessions over serialized models, for the compiler's checks and the runtime alike,
and the one place their threading is set.

Threads: by default each session has its own pool whose threads sleep between calls. A paged
step runs a session per segment and the attention kernel between them, so pools that spun would
fight each other and the kernel (measured: a 16-sequence decode step took 141 ms with spinning
on, 11 ms off). But sleeping threads cost a wake-up per parallel operator, which is much of a
batch-1 decode step. A process that llmc owns (the CLI, a benchmark, a server) calls
`share_threads` first: every llmc session then runs on one process-wide pool whose threads spin,
so there is one spinning worker however many segments (measured on the 25M Llama, batch-1
decode 138 -> 176-193 tok/s; a 16-sequence decode 792 -> 830 tok/s). Not the default, because
onnxruntime then refuses every session in the process that asks for threads of its own,
including one made with default options by code that is not llmc's.
"""

from __future__ import annotations

import onnxruntime as ort

from llmc.errors import LlmcError
from llmc.formats.engine_file import EXTERNAL_ROOT, FileRange, bind_weights

_shared_threads: int | None = None  # the process-wide pool's size once `share_threads` made it


def share_threads(threads: int | None = None) -> None:
    """Run every llmc session created from now on in this process on one spinning thread pool of
    `threads` threads (None: one per physical core). Call it once, before any session, in a
    process llmc owns; a second call must ask for the same size."""
    global _shared_threads
    size = threads or 0
    if _shared_threads is not None:
        if _shared_threads != size:
            raise LlmcError(f"threads: this process already shares a pool of {_shared_threads or 'all'} "
                            f"threads, cannot change it to {threads}")
        return
    ort.set_global_thread_pool_sizes(size, 1)
    _shared_threads = size


def session_options(threads: int | None = None, *, optimize: bool = True, alone: bool = False,
                    once: bool = False, float_weight_products: bool = False) -> ort.SessionOptions:
    """Options for an llmc session: `threads` intra-op threads (None: every core) that sleep
    between calls unless the session runs `alone` (no other session or kernel takes turns with
    it), or the shared pool when `share_threads` made one; `optimize=False` turns onnxruntime's
    graph optimizations off (every value keeps its name); `once` is for a session run once or
    twice (a check): its weights are not prepacked for faster MatMuls, which would cost more than
    it saves (~0.5 s of building SmolLM2-135M's); `float_weight_products` computes a weight-only
    product (DequantizeLinear on the weight → MatMul) with float activations, as TensorRT does,
    where onnxruntime would otherwise fuse it into a MatMulNBits that rounds them to int8."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if once:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if float_weight_products:
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    if _shared_threads is not None:
        options.use_per_session_threads = False
        return options
    if threads:
        options.intra_op_num_threads = threads
    if not alone:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def open_session(files: dict, options: ort.SessionOptions) -> ort.InferenceSession:
    """A CPU session over a serialized model, its external data read where it is (onnxruntime maps
    it; nothing is copied to disk).

    Args:
        files: "model.onnx" bytes: an engine's graph, with "model.onnx.data" the `FileRange` of
            the engine's weights section; or a graph from `onnx_io.serialize`, alone, whose
            external references are relative to `EXTERNAL_ROOT`.
        options: session options. onnxruntime keeps the data folder in them: sessions sharing
            `options` must share it (as a paged engine's segments do).
    """
    graph, data = files["model.onnx"], files.get("model.onnx.data")
    folder = EXTERNAL_ROOT
    if isinstance(data, FileRange):
        graph, folder = bind_weights(graph, data), str(data.path.resolve().parent)
    key = "session.model_external_initializers_file_folder_path"
    if _config_entry(options, key) != folder:
        options.add_session_config_entry(key, folder)
    return ort.InferenceSession(bytes(graph), options, providers=["CPUExecutionProvider"])


def _config_entry(options: ort.SessionOptions, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:
        return None
