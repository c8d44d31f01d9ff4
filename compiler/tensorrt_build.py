"""Build a TensorRT 11 engine from the final graph (`llmc compile --backend tensorrt`).

The graph (compiler/tensorrt_network.py has mapped its paged-attention nodes to the
``llmc::paged_attention`` plugin) is written to a temporary folder with its weights beside it and
parsed from there: TensorRT's parser reads external weights relative to the file. Networks are
strongly typed in TensorRT 11 (precision comes from the graph's types and Q/DQ nodes), so the
config sets no precision flags.

The plugin's ahead-of-time implementation (a Triton kernel compiled to PTX while building) is what
the engine stores: the network is created with PREFER_AOT_PYTHON_PLUGINS, so running the engine
needs neither Python plugin code nor Triton. Polygraphy's loaders build the config and the engine
(`CreateConfig`, `EngineBytesFromNetwork`); the network is created here because Polygraphy's
`NetworkFromOnnxPath` has no way to pass that creation flag.

A failed build is one line: Polygraphy raises its own exception when TensorRT's builder returns
nothing, so the builder's logger records TensorRT's errors, and the line names the first layer
an error names (the parser names a layer after its ONNX node) with that error.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import onnx

from llmc.compiler.tensorrt_network import PLUGIN_VERSION, PLUGINS, TensorRTOptions
from llmc.errors import LlmcError
from llmc.plugins.cuda_device import current_gpu
from llmc.formats.onnx_io import save_onnx

MIN_VERSION = 11


def require_tensorrt():
    """The tensorrt module, or a one-line error saying what to install."""
    try:
        import tensorrt as trt
    except ImportError as exc:  # also raised when the bindings are there but libnvinfer is not
        raise LlmcError("--backend tensorrt: TensorRT is not installed here (pip install 'llmc[tensorrt]' on a "
                        "machine with an NVIDIA GPU and driver); --dry-run checks the graph without it "
                        f"({exc})") from None
    if int(trt.__version__.split(".")[0]) < MIN_VERSION:
        raise LlmcError(f"--backend tensorrt: TensorRT {trt.__version__} is installed; llmc needs TensorRT "
                        f"{MIN_VERSION} (pip install 'llmc[tensorrt]')")
    if importlib.util.find_spec("polygraphy") is None:  # the build's loaders
        raise LlmcError("--backend tensorrt: Polygraphy is not installed (pip install 'llmc[tensorrt]')")
    return trt


def build_engine(model: onnx.ModelProto, profile: dict[str, tuple[tuple[int, ...], ...]],
                 options: TensorRTOptions, progress: Callable[[str], None] = lambda message: None
                 ) -> tuple[bytes, dict[str, Any]]:
    """Serialized engine bytes and the manifest's "tensorrt" entry.

    Args:
        model: the final graph, plugin nodes mapped (tensorrt_network.map_plugin_nodes).
        profile: each input's (min, opt, max) shape (tensorrt_network.optimization_profile).
        options: the build options.
        progress: called with a line per build phase.
    """
    trt = require_tensorrt()
    gpu = current_gpu()  # before minutes of building: the engine is for this GPU
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, Profile
    from polygraphy.exception import PolygraphyException

    from llmc.plugins.tensorrt_plugin import register_plugin, set_ptx_target

    register_plugin()
    # A hardware-compatible engine runs on any GPU from Ampere on: its kernel's PTX must target sm_80.
    set_ptx_target(hardware_compatible=options.hardware_compatible)
    logger = _recording_logger(trt)
    shapes = Profile()
    for name, (low, opt, high) in profile.items():
        shapes.add(name, min=low, opt=opt, max=high)
    config = CreateConfig(
        profiles=[shapes],
        builder_optimization_level=options.optimization_level,
        load_timing_cache=options.timing_cache if options.timing_cache and os.path.exists(options.timing_cache) else None,
        memory_pool_limits=({trt.MemoryPoolType.WORKSPACE: int(options.workspace_mb * 2**20)}
                            if options.workspace_mb else None),
        hardware_compatibility_level=(trt.HardwareCompatibilityLevel.AMPERE_PLUS if options.hardware_compatible
                                      else None),
        version_compatible=options.version_compatible or None,
        profiling_verbosity=trt.ProfilingVerbosity.DETAILED,  # `llmc inspect` shows layers
        progress_monitor=_progress_monitor(trt, progress))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llmc-trt-") as folder:
        path = Path(folder) / "model.onnx"
        save_onnx(model, path)  # weights beside it when past 2 GB; the parser finds them by path
        builder = trt.Builder(logger)
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS))
        parser = trt.OnnxParser(network, logger)
        progress("parsing the graph into a TensorRT network")
        if not parser.parse_from_file(str(path)):
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise LlmcError(f"--backend tensorrt: TensorRT's parser rejected the graph: {errors[0] if errors else '?'}"
                            + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
        progress("building the TensorRT engine (minutes: the builder times kernels for each layer)")
        try:
            engine = EngineBytesFromNetwork((builder, network, parser), config=config,
                                            save_timing_cache=options.timing_cache)()
        except PolygraphyException as exc:
            layers = [network.get_layer(i).name for i in range(network.num_layers)]
            raise LlmcError(build_failure(logger.errors, layers, str(exc))) from None
    return bytes(engine), describe(trt, gpu, options, time.perf_counter() - start)


def build_failure(errors: list[str], layers: list[str], fallback: str) -> str:
    """One line for a failed build: the first layer TensorRT's errors name, and that error.

    Args:
        errors: TensorRT's logged errors, in order.
        layers: the network's layer names.
        fallback: what to say when TensorRT logged no error (Polygraphy's message).
    """
    by_length = sorted(set(layers), key=len, reverse=True)  # "/a/MatMul_1" before "/a/MatMul"
    for error in errors:
        layer = next((name for name in by_length if name and name in error), None)
        if layer is not None:
            return f"--backend tensorrt: TensorRT refused layer {layer}: {_one_line(error)}"
    first = _one_line(errors[0]) if errors else _one_line(fallback)
    return f"--backend tensorrt: the TensorRT build failed: {first}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def describe(trt: Any, gpu: dict[str, str], options: TensorRTOptions, seconds: float) -> dict[str, Any]:
    """What an engine needs at load: TensorRT version, GPU, plugins, build options."""
    return {"version": trt.__version__, "gpu": gpu["name"], "compute_capability": gpu["compute_capability"],
            "plugins": {plugin_id: PLUGIN_VERSION for plugin_id in PLUGINS.values()},
            "hardware_compatible": options.hardware_compatible, "version_compatible": options.version_compatible,
            "optimization_level": options.optimization_level, "max_num_tokens": options.max_num_tokens,
            "build_s": round(seconds, 1)}


def _recording_logger(trt: Any):
    """A trt.ILogger that prints warnings and errors, as trt.Logger(WARNING) does, and keeps the
    errors for the one-line failure."""
    shown = {trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR, trt.ILogger.Severity.WARNING}
    failures = {trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR}

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity in failures:
                self.errors.append(msg)
            if severity in shown:
                print(f"TensorRT: {msg}", file=sys.stderr)

    return Logger()


def _progress_monitor(trt: Any, progress: Callable[[str], None]):
    """A trt.IProgressMonitor that reports each top-level build phase as it starts."""

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:
                progress(f"TensorRT: {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name, step):
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            pass

    return Monitor()
