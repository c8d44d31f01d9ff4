"""runtime/roofline.py: costs against figures computed here with NumPy, the graphs' weights against
onnx's own reading of them, and the measured limits against NumPy's own speed."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from llmc.errors import LlmcError
from llmc.formats.engine_file import FileRange, bind_weights, read_engine
from llmc.formats.manifest import Geometry
from llmc.runtime.roofline import (ATTENTION_OPS, LINEAR_OPS, Cost, MachineLimits, bound, describe, graph_weights,
                                   head_parameters, measure_limits, model_weights, operator_cost, step_cost)

MODEL = Path(__file__).resolve().parents[2] / "data" / "pystdlib-llama"


def entry(op: str, weights: dict[int, np.ndarray], **attrs) -> dict:
    """A `graph_weights` entry for a node whose input positions hold these arrays."""
    positions = sorted(weights)
    return {"op": op, "weight_names": [f"w{i}" for i in positions], "weight_inputs": positions,
            "weight_shapes": [list(weights[i].shape) for i in positions],
            "weight_sizes": [weights[i].nbytes for i in positions],
            "weight_bytes": sum(weights[i].nbytes for i in positions), "attrs": attrs}


def test_a_matmul_costs_its_operands_and_result_once_and_two_flops_per_multiply_add():
    a, w = np.zeros((1, 7, 576), np.float32), np.zeros((576, 1536), np.float32)
    y = a @ w
    cost = operator_cost("MatMul", [{"float": [1, 7, 576]}], entry("MatMul", {1: w}))
    assert cost == Cost(bytes=a.nbytes + w.nbytes + y.nbytes, flops=2 * 7 * 576 * 1536)
    # A weight stored in fp16 beside float activations is read as float (onnxruntime casts it).
    cost16 = operator_cost("MatMul", [{"float": [1, 7, 576]}], entry("MatMul", {1: w.astype(np.float16)}))
    assert cost16 == cost


def test_a_matmul_of_two_activations_takes_both_from_the_profiler():
    q, k = np.zeros((2, 4, 7, 64), np.float32), np.zeros((2, 4, 64, 30), np.float32)
    scores = q @ k
    cost = operator_cost("MatMul", [{"float": list(q.shape)}, {"float": list(k.shape)}], {})
    assert cost == Cost(bytes=q.nbytes + k.nbytes + scores.nbytes, flops=2 * 2 * 4 * 7 * 64 * 30)


def test_a_gemm_with_a_transposed_weight_and_a_bias():
    a, w, bias = np.zeros((5, 256), np.float32), np.zeros((512, 256), np.float32), np.zeros(512, np.float32)
    y = a @ w.T + bias
    cost = operator_cost("Gemm", [{"float": [5, 256]}], entry("Gemm", {1: w, 2: bias}, transB=1))
    assert cost == Cost(bytes=a.nbytes + w.nbytes + bias.nbytes + y.nbytes, flops=2 * 5 * 256 * 512)


def test_matmulnbits_reads_its_packed_weight_scales_and_zero_points():
    k, n, block, tokens = 576, 1536, 32, 7
    blocks = k // block
    packed = np.zeros((n, blocks, block // 2), np.uint8)  # two 4-bit weights a byte
    scales = np.zeros(n * blocks, np.float32)
    zero_points = np.zeros(n * math.ceil(blocks / 2), np.uint8)
    a, y = np.zeros((1, tokens, k), np.float32), np.zeros((1, tokens, n), np.float32)
    weights = entry("MatMulNBits", {1: packed, 2: scales, 3: zero_points}, K=k, N=n, bits=4, block_size=block)
    # The profiler lists the scales and zero points (not prepacked) beside the activation: not
    # counted twice.
    shapes = [{"float": [1, tokens, k]}, {"float": [scales.size]}, {"uint8": [zero_points.size]}]
    cost = operator_cost("MatMulNBits", shapes, weights)
    assert cost == Cost(bytes=a.nbytes + packed.nbytes + scales.nbytes + zero_points.nbytes + y.nbytes,
                        flops=2 * tokens * k * n)
    assert packed.nbytes == k * n // 2


def test_integer_matmuls():
    a8, w8 = np.zeros((3, 128), np.uint8), np.zeros((128, 64), np.int8)
    zero_point = np.zeros(64, np.int8)
    accumulators = np.zeros((3, 64), np.int32)
    cost = operator_cost("MatMulInteger", [{"uint8": [3, 128]}, {"uint8": []}],
                         entry("MatMulInteger", {1: w8, 3: zero_point}))
    assert cost == Cost(bytes=a8.nbytes + w8.nbytes + zero_point.nbytes + accumulators.nbytes, flops=2 * 3 * 128 * 64)
    a, scale, y = np.zeros((3, 128), np.float32), np.zeros(64, np.float32), np.zeros((3, 64), np.float32)
    cost = operator_cost("DynamicQuantizeMatMul", [{"float": [3, 128]}],
                         entry("DynamicQuantizeMatMul", {1: w8, 2: scale}))
    assert cost == Cost(bytes=a.nbytes + w8.nbytes + scale.nbytes + y.nbytes, flops=2 * 3 * 128 * 64)


def causal_attended(new: list[int], lengths: list[int]) -> int:
    """Key positions each query token attends, counted from a causal mask, summed."""
    total = 0
    for s, t in zip(new, lengths):
        mask = np.tril(np.ones((t, t), bool))[t - s:]  # the last s query rows
        total += int(mask.sum())
    return total


@pytest.mark.parametrize("batch, tokens, capacity", [(1, 9, 64), (3, 1, 64)])
def test_group_query_attention_reads_the_positions_attended_not_its_buffers(batch, tokens, capacity):
    heads, kv_heads, head_dim = 4, 2, 16
    lengths = [20 + 5 * b for b in range(batch)]
    weights = entry("GroupQueryAttention", {7: np.zeros((capacity, 8), np.float32)}, num_heads=heads,
                    kv_num_heads=kv_heads)
    shapes = [{"float": [batch, tokens, (heads + 2 * kv_heads) * head_dim]},
              {"float": [batch, kv_heads, capacity, head_dim]}, {"float": [batch, kv_heads, capacity, head_dim]},
              {"int32": [batch]}, {"int32": []}, {"float": [capacity, 8]}, {"float": [capacity, 8]}]
    cost = operator_cost("GroupQueryAttention", shapes, weights, context_tokens=sum(lengths))
    attended = causal_attended([tokens] * batch, lengths)
    kv = np.zeros((sum(lengths), 2, kv_heads, head_dim), np.float32)  # every sequence's keys and values
    qkv = np.zeros((batch, tokens, (heads + 2 * kv_heads) * head_dim), np.float32)
    out = np.zeros((batch, tokens, heads * head_dim), np.float32)
    new_kv = np.zeros((batch, tokens, 2, kv_heads, head_dim), np.float32)
    assert cost == Cost(bytes=kv.nbytes + qkv.nbytes + out.nbytes + new_kv.nbytes,
                        flops=4 * heads * head_dim * attended)
    assert operator_cost("GroupQueryAttention", shapes, weights) is None  # no lengths: its buffers say nothing


def test_operators_not_costed_and_types_not_known():
    assert operator_cost("Add", [{"float": [1, 7, 576]}, {"float": [1, 7, 576]}], {}) is None
    assert operator_cost("MatMulNBits", [{"float": [1, 7, 576]}], {}) is None  # no weights from the graph
    assert operator_cost("MatMul", [{"float8e4m3fn": [1, 7, 576]}], entry("MatMul", {1: np.zeros((576, 8))})) is None


GEOMETRY = Geometry(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=2048, max_positions=512)


def expected_step(weight_bytes: int, params: int, new: list[int], lengths: list[int], kv_bytes: int) -> Cost:
    g = GEOMETRY
    cache = np.zeros((g.num_layers, 2, g.num_kv_heads, sum(lengths) + sum(new), g.head_dim), f"f{kv_bytes}")
    attention = 4 * g.num_heads * g.head_dim * causal_attended(new, lengths) * g.num_layers
    return Cost(bytes=weight_bytes + cache.nbytes, flops=2 * params * sum(new) + attention)


@pytest.mark.parametrize("new, lengths, kv_bytes", [([1, 1, 1, 1], [30, 41, 7, 100], 4),  # decode b4
                                                    ([64], [64], 2),  # a prompt's first chunk
                                                    ([32], [96], 4)])  # its next chunk
def test_step_cost_reads_the_weights_and_the_kv_once_and_counts_the_causal_attention(new, lengths, kv_bytes):
    weight_bytes, params = 14_000_000, 3_473_408
    cost = step_cost(weight_bytes, GEOMETRY, sum(new), sum(lengths), kv_bytes, params=params, sequences=len(new))
    assert cost.bytes == expected_step(weight_bytes, params, new, lengths, kv_bytes).bytes
    assert cost.flops == pytest.approx(expected_step(weight_bytes, params, new, lengths, kv_bytes).flops, rel=1e-12)
    exact = step_cost(weight_bytes, GEOMETRY, sum(new), sum(lengths), kv_bytes, params=params,
                      attended=causal_attended(new, lengths))
    assert exact == expected_step(weight_bytes, params, new, lengths, kv_bytes)
    if len(new) == sum(new):  # a decode step: one sequence per token by default, fp32 weights
        assert step_cost(weight_bytes, GEOMETRY, sum(new), sum(lengths), kv_bytes) == \
            expected_step(weight_bytes, weight_bytes / 4, new, lengths, kv_bytes)


def test_the_lm_head_runs_only_on_the_logits_rows():
    weight_bytes, params, head = 14_000_000, 3_473_408, 2048 * 256
    new, lengths = [64], [64]  # a prompt's chunk: the head runs on its last row only
    every_row = step_cost(weight_bytes, GEOMETRY, 64, 64, 4, params=params, sequences=1)
    last_row = step_cost(weight_bytes, GEOMETRY, 64, 64, 4, params=params, sequences=1, head_params=head,
                         logit_rows=1)
    assert last_row.bytes == every_row.bytes
    assert every_row.flops - last_row.flops == 2 * head * 63
    assert last_row.flops == pytest.approx(expected_step(weight_bytes, params - head, new, lengths, 4).flops + 2 * head)


def test_step_cost_refuses_more_sequences_than_tokens():
    with pytest.raises(LlmcError, match="sequences"):
        step_cost(1000, GEOMETRY, 2, 10, 4, sequences=3)


def test_bound_and_its_words():
    limits = MachineLimits(memory_bytes_per_s=1e10, flops_per_s=1e11, threads=2)
    memory = bound(Cost(bytes=7.1e9, flops=1e9), limits, 1.0)
    assert memory == pytest.approx({"memory_s": 0.71, "compute_s": 0.01, "bound": "memory", "fraction": 0.71})
    assert describe(memory) == "at 71% of the memory bound"
    compute = bound(Cost(bytes=1e8, flops=1.9e10), limits, 0.5)
    assert compute["bound"] == "compute" and describe(compute) == "compute-bound at 38% of peak"
    assert json.loads(json.dumps(limits.as_dict())) == {"memory_bytes_per_s": 1e10, "flops_per_s": 1e11, "threads": 2}
    with pytest.raises(LlmcError, match="seconds"):
        bound(Cost(1, 1), limits, 0.0)


@pytest.fixture(scope="module")
def engines(trained_onnx, trained_engine, tmp_path_factory) -> dict[str, Path]:
    """The trained model compiled in fp32 and with int4 weights."""
    from llmc.compiler.build import compile_model
    from llmc.precision.plan import PrecisionOptions

    int4 = tmp_path_factory.mktemp("roofline") / "int4.plan"
    compile_model(trained_onnx, int4, precision=PrecisionOptions(weights="int4", force=True))
    return {"fp32": trained_engine, "int4": int4}


def loaded_graphs(path: Path) -> dict[str, onnx.GraphProto]:
    """Each graph section of an engine, its external weights loaded by onnx itself."""
    engine = read_engine(path)
    graphs = {}
    for section in [s.name for s in engine.manifest.sections if s.name.endswith(".onnx")]:
        model = onnx.load_model_from_string(bind_weights(engine.sections[section],
                                                         FileRange(engine.path, engine.offsets["model.onnx.data"])))
        onnx.external_data_helper.load_external_data_for_model(model, str(engine.path.parent))
        graphs[section] = model.graph
    return graphs


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_graph_weights_are_the_graphs_own_initializers(engines, precision):
    weights = graph_weights(engines[precision])
    nodes = 0
    for section, graph in loaded_graphs(engines[precision]).items():
        arrays = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        for node in graph.node:
            read = [(i, arrays[name]) for i, name in enumerate(node.input) if name in arrays]
            if not node.name or not read:
                continue
            found = weights[node.name]
            assert section in found["sections"] and found["op"] == node.op_type
            assert found["weight_inputs"] == [i for i, _ in read]
            assert found["weight_shapes"] == [list(array.shape) for _, array in read]
            assert found["weight_sizes"] == [array.nbytes for _, array in read]
            assert found["weight_bytes"] == sum(array.nbytes for _, array in read)
            nodes += 1
    assert nodes > 40
    assert graph_weights(read_engine(engines[precision])) == weights  # an engine already read


def test_model_weights_count_the_linear_layers_parameters_of_the_config(engines):
    config = json.loads((MODEL / "config.json").read_text())
    hidden, inter, heads, kv_heads = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                          "num_key_value_heads"))
    head_dim = config["head_dim"]
    per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter
    params = config["num_hidden_layers"] * per_layer + hidden * config["vocab_size"]  # and the LM head
    fp32_bytes, fp32_params = model_weights(graph_weights(engines["fp32"]))
    int4_bytes, int4_params = model_weights(graph_weights(engines["int4"]))
    assert fp32_params == int4_params == params
    assert params * 4 < fp32_bytes < params * 4 * 1.05  # the norms and rotary tables beside them
    assert params / 2 < int4_bytes < params  # 4 bits a weight, then scales and zero points
    for precision in ("fp32", "int4"):
        assert head_parameters(graph_weights(engines[precision]), config["vocab_size"]) == \
            hidden * config["vocab_size"]


def test_graph_weights_refuses_a_file_that_is_no_engine(tmp_path):
    path = tmp_path / "not.plan"
    path.write_bytes(b"not an engine")
    with pytest.raises(LlmcError, match="not.plan"):
        graph_weights(path)


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_profiled_operators_find_their_weights_and_costs(engines, precision):
    from llmc.runtime.engine import Engine
    from llmc.runtime.sampling_params import SamplingParams
    from llmc.runtime.timeline import OPERATOR, Timeline

    timeline = Timeline()
    engine = Engine(engines[precision], threads=1, timeline=timeline, concurrent=True)
    for prompt in ("def fibonacci(n):\n", "import os\nimport sys\n\n\nclass Reader:\n"):
        engine.add_request(prompt, SamplingParams(max_new_tokens=3))
    while engine.has_unfinished():
        engine.step()
    timeline.collect_operators()
    weights = graph_weights(engines[precision])
    arrays = {t.name: numpy_helper.to_array(t) for graph in loaded_graphs(engines[precision]).values()
              for t in graph.initializer}
    operators = [s for s in timeline.spans if s.args.get("kind") == OPERATOR
                 and s.args["op"] in LINEAR_OPS.keys() | ATTENTION_OPS]
    assert {s.args["session"] for s in operators} >= {"single_sequence.onnx", "segment.1.onnx"}
    for span in operators:
        found = weights[span.name]
        assert found["op"] == span.args["op"]
        cost = operator_cost(span.args["op"], span.args["input_shapes"], found, context_tokens=40)
        if span.args["op"] in ATTENTION_OPS:
            assert cost is not None
            continue
        ((_, a_shape),) = span.args["input_shapes"][0].items()
        loaded = [arrays[name] for name in found["weight_names"]]
        n = loaded[0].shape[0] if span.args["op"] == "MatMulNBits" else loaded[0].shape[1]
        m, k = math.prod(a_shape[:-1]), a_shape[-1]
        assert cost == Cost(bytes=4 * m * k + sum(a.nbytes for a in loaded) + 4 * m * n, flops=2 * m * k * n)


def best_seconds(work, repetitions: int = 5) -> float:
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def test_measured_limits_are_not_beaten_by_numpy_by_more_than_twice():
    limits = measure_limits(seconds=0.2)
    assert 0 < limits.memory_bytes_per_s < math.inf and 0 < limits.flops_per_s < math.inf
    assert 1 <= limits.threads <= os.cpu_count()
    a, b = np.full((256, 2048), 0.25, np.float32), np.full((2048, 2048), 0.5, np.float32)
    numpy_flops = 2 * 256 * 2048 * 2048 / best_seconds(lambda: a @ b)
    # The machine is shared: a generous margin, but a peak measured wrong by a unit or a
    # factor of the thread count still fails.
    assert numpy_flops < 2 * limits.flops_per_s, (numpy_flops, limits)
    row, weight = np.full((1, 8192), 0.25, np.float32), np.full((8192, 8192), 0.5, np.float32)  # 256 MiB
    numpy_bandwidth = weight.nbytes / best_seconds(lambda: row @ weight, 3)
    assert numpy_bandwidth < 2 * limits.memory_bytes_per_s, (numpy_bandwidth, limits)
