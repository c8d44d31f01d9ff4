"""TensorRT's layer profiler under `llmc profile`, on a machine without TensorRT.

The stand-in of TensorRT 11.4 (tests/tensorrt_wheel.py) takes a profiler as the bindings do and
reports each layer of its engine as TensorRT documents it; the engine file is tiny-llama built
through `compile_model(backend="tensorrt")` with it (tests/tensorrt_engines.py), run by the
TensorRT backend on the CPU. An `Engine` made with a `Timeline` must record TensorRT's layers,
each engine call's in order inside it, and attach nothing without one. scripts/gpu_check_tensorrt.py
checks the same on a GPU with TensorRT.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from llmc.formats.engine_file import read_engine
from llmc.runtime.timeline import ENGINE, TENSORRT, Span, Timeline
from tensorrt_engines import attention_free, build, built_engine, trt, wheel  # noqa: F401 (fixtures)
from test_gpu_check_script import load

PLACED = {"kind": "layer", "placed": "end to end from the launch"}
LAYERS = ["first", "node_of_y"]  # `_two_layers`' engine


@pytest.fixture
def on_cpu(trt, monkeypatch):
    """TensorRT engine files load into the TensorRT backend on the CPU, the stand-in computing
    `attention_free`."""
    from llmc.runtime.backends import registry
    from llmc.runtime.backends.tensorrt import TensorRTBackend

    trt.execute = attention_free
    monkeypatch.setitem(registry.BACKENDS, "tensorrt",
                        registry.BackendEntry("tensorrt", functools.partial(TensorRTBackend, device="cpu")))


def _generate(engine, prompts: list[list[int]], new_tokens: int) -> None:
    from llmc.runtime.sampling_params import SamplingParams

    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    while engine.has_unfinished():
        assert all(output.error is None for output in engine.step())


def _layers(path) -> list[str]:
    """The layers the stand-in built, in order (its parser's: the ONNX graph's node names)."""
    return [name for name, _ in json.loads(bytes(read_engine(path).sections["engine.trt"]))["layers"]]


def test_each_engine_call_records_every_layer_inside_it_within_the_step_execute(built_engine, on_cpu, trt):
    from llmc.runtime.engine import Engine

    path, _, _ = built_engine
    layers = _layers(path)
    timeline = Timeline()
    engine = Engine(path, timeline=timeline)
    context = engine.backend._context
    assert isinstance(context.profiler, trt.IProfiler) and not context.enqueue_emits_profile
    loaded = len(timeline.spans)  # the warm-up's call, outside any step
    _generate(engine, [[5, 6, 7, 8, 9], [3, 4]], 3)
    spans = timeline.spans[loaded:]
    executes = [s for s in spans if s.track == ENGINE and s.name == "execute"]
    calls = [s for s in spans if s.track == TENSORRT and s.name == "engine call"]
    recorded = [s for s in spans if s.track == TENSORRT and s.args.get("kind") == "layer"]
    assert len(layers) > 10 and len(executes) == 3 and len(calls) == 3  # a prefill, two decodes of both
    for call in calls:
        inside = sorted((s for s in recorded if call.start_ns <= s.start_ns and s.end_ns <= call.end_ns),
                        key=lambda s: s.start_ns)
        assert [s.name for s in inside] == layers  # each layer once, in the order TensorRT reported them
        assert all(s.args == PLACED for s in inside)
        assert all(a.end_ns == b.start_ns for a, b in zip(inside, inside[1:]))  # end to end
        assert sum(1 for e in executes if e.start_ns <= call.start_ns and call.end_ns <= e.end_ns) == 1
    assert len(recorded) == len(calls) * len(layers)  # none outside a call, none reported twice


def test_a_step_larger_than_the_profile_records_each_piece_as_an_engine_call(built_engine, on_cpu):
    """The engine takes 24 tokens a call: a 40-token prompt runs as two calls, each with its layers."""
    from llmc.runtime.engine import Engine

    path, _, _ = built_engine
    timeline = Timeline()
    engine = Engine(path, timeline=timeline)
    loaded = len(timeline.spans)
    _generate(engine, [list(range(10, 50))], 1)
    calls = [s for s in timeline.spans[loaded:] if s.track == TENSORRT and s.name == "engine call"]
    layers = [s for s in timeline.spans[loaded:] if s.args.get("kind") == "layer"]
    assert [c.args["tokens"] for c in calls] == [24, 16]
    assert len(layers) == 2 * len(_layers(path))
    assert layers[len(layers) // 2].start_ns >= calls[1].start_ns  # the second call's layers in the second call


def test_without_a_timeline_no_profiler_is_attached(built_engine, on_cpu):
    from llmc.runtime.engine import Engine

    path, _, _ = built_engine
    engine = Engine(path)
    context = engine.backend._context
    _generate(engine, [[5, 6, 7]], 2)
    assert context.profiler is None and context.enqueue_emits_profile  # TensorRT's defaults, untouched
    assert not context.report_to_profiler()


def test_the_gpu_scripts_profile_check_passes_on_the_stand_in_and_fails_what_is_wrong(built_engine, on_cpu):
    script = load("gpu_check_tensorrt")
    checks = script.Checks()
    path, _, _ = built_engine
    script.layer_profile(checks, path)
    (status, name, detail), = checks.results
    assert (status, name) == ("PASS", "layer profile") and "engine calls" in detail, detail
    call = Span("engine call", TENSORRT, 0, 100)
    layer = functools.partial(Span, track=TENSORRT, args=PLACED)
    assert script.layer_profile_problem([])[0] == "no engine call recorded"
    assert script.layer_profile_problem([call])[0] == "TensorRT's profiler reported no layer"
    assert "outside their engine call (b)" in script.layer_profile_problem(
        [call, layer("a", start_ns=0, end_ns=60), layer("b", start_ns=60, end_ns=120)])[0]
    assert script.layer_profile_problem([call, layer("a", start_ns=0, end_ns=60)])[0] is None


# --- The stand-in takes a profiler as TensorRT's bindings do ----------------------------------------------

def _two_layers(trt, tmp_path):
    """A context of a two-layer engine (y = x through "first" and an unnamed node, which
    onnx-tensorrt names "node_of_y"), ready to launch, and the buffers it reads and writes."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Identity", ["x"], ["h"], name="first"),
             helper.make_node("Identity", ["h"], ["y"])]
    path = tmp_path / "two_layers.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y])), path)
    class Logger(trt.ILogger):
        def log(self, severity, msg):
            raise AssertionError(msg)

    logger = Logger()
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    assert trt.OnnxParser(network, logger).parse_from_file(str(path))
    plan = builder.build_serialized_network(network, builder.create_builder_config())
    context = trt.Runtime(logger).deserialize_cuda_engine(bytes(plan)).create_execution_context()
    trt.execute = lambda description, inputs: {"y": inputs["x"]}
    buffers = {"x": np.ones(2, np.float32), "y": np.zeros(2, np.float32)}
    for name, array in buffers.items():
        assert context.set_tensor_address(name, array.ctypes.data)
    assert context.set_input_shape("x", (2,))
    return context, buffers


def _recording(trt):
    class Recording(trt.IProfiler):
        def __init__(self):
            trt.IProfiler.__init__(self)
            self.times = []

        def report_layer_time(self, layer_name, ms):
            self.times.append((layer_name, ms))

    return Recording()


def test_layers_are_reported_during_the_launch_or_when_asked(trt, tmp_path):
    """enqueue_emits_profile True (TensorRT's default): enqueue is synchronous and reports; False:
    nothing until report_to_profiler(), which reports the last launch."""
    context, _ = _two_layers(trt, tmp_path)
    assert context.profiler is None and not context.report_to_profiler()  # "profiler not provided"
    profiler = _recording(trt)
    context.profiler = profiler
    assert context.profiler is profiler and context.enqueue_emits_profile
    assert context.execute_async_v3(0)
    assert [name for name, _ in profiler.times] == LAYERS and all(ms >= 0 for _, ms in profiler.times)
    profiler.times.clear()
    context.enqueue_emits_profile = False
    assert context.execute_async_v3(0) and profiler.times == []
    assert context.report_to_profiler() and [name for name, _ in profiler.times] == LAYERS


def test_the_stand_in_refuses_what_is_not_an_iprofiler(trt, tmp_path):
    context, _ = _two_layers(trt, tmp_path)

    class Lookalike:
        def report_layer_time(self, layer_name, ms):
            pass

    with pytest.raises(TypeError, match="incompatible function arguments.*arg0: tensorrt.IProfiler"):
        context.profiler = Lookalike()

    class Uninitialized(trt.IProfiler):
        def __init__(self):
            self.times = []  # without IProfiler.__init__

        def report_layer_time(self, layer_name, ms):
            pass

    with pytest.raises(TypeError, match=r"tensorrt.IProfiler.__init__\(\) must be called when overriding __init__"):
        Uninitialized()
    with pytest.raises(TypeError, match="takes a bool"):
        context.enqueue_emits_profile = 0
    assert context.profiler is None


def test_a_profiler_without_report_layer_time_or_that_raises_is_reported_on_stderr(trt, tmp_path, capfd):
    """The bindings' trampoline finds no override (or catches what it raised) and prints it: the
    layer's time is lost and the launch goes on."""
    context, _ = _two_layers(trt, tmp_path)

    class Silent(trt.IProfiler):
        def __init__(self):
            trt.IProfiler.__init__(self)

    class Raising(trt.IProfiler):
        def __init__(self):
            trt.IProfiler.__init__(self)

        def report_layer_time(self, layer_name, ms):
            raise ValueError(f"no room for {layer_name}")

    context.profiler = Silent()
    assert context.execute_async_v3(0)
    assert capfd.readouterr().err.splitlines() == [
        '[ERROR] Exception caught in report_layer_time(): Tried to call pure virtual function '
        '"IProfiler::report_layer_time"'] * 2
    context.profiler = Raising()
    assert context.execute_async_v3(0)
    assert capfd.readouterr().err.splitlines() == [
        f"[ERROR] Exception caught in report_layer_time(): ValueError: no room for {name}" for name in LAYERS]
