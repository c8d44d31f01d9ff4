"""The machine's limits and what work costs against them: "at 71% of the memory bound".

A step or an operator reads at least some bytes and does some arithmetic; on this machine the
bytes take at least bytes ÷ bandwidth and the arithmetic FLOPs ÷ peak. `bound` says which of the
two is larger and what share of the measured time it is, which says how much faster the work
could run at best, and whether fewer bytes (int4 weights, a smaller KV dtype) or fewer FLOPs
would help.

- `measure_limits` measures the bandwidth and the peak with the kernels llmc's engines run
  (onnxruntime's MLAS, fp32), with the engine's threading.
- `step_cost` is one step of a model; `operator_cost` one operator that onnxruntime's profiler
  reported, its weights from `graph_weights` (the profiler leaves out prepacked weights).

A cost counts what the work must touch and compute once: each weight and cached key or value
read once (a lower bound on the traffic), and an operator's activations read and written (they
may stay in the caches instead, so an operator whose activations outweigh its weights may run
faster than its memory bound says).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError, first_line
from llmc.formats.engine_file import EngineFile, read_engine
from llmc.formats.manifest import Geometry
from llmc.formats.sessions import session_options

MIN_STREAMED_BYTES = 256 << 20  # past most last-level caches; four times the cache where that is larger
COMPUTE_SHAPE = (256, 2048, 2048)  # M, K, N: MLAS at its peak, small enough to measure in a second
_REPETITIONS = 3  # at least, after one to warm up

# Element sizes of the types onnxruntime's profiler names in `input_type_shape`.
PROFILER_DTYPE_BYTES = {"float": 4, "double": 8, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
                        "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "bool": 1}
# Operators whose weight is a matrix the work multiplies by, and the input that holds it.
LINEAR_OPS = {"MatMul": 1, "Gemm": 1, "MatMulNBits": 1, "MatMulInteger": 1, "DynamicQuantizeMatMul": 1}
ATTENTION_OPS = {"GroupQueryAttention"}


@dataclass(frozen=True)
class MachineLimits:
    """What this machine sustains, as measured by `measure_limits`."""

    memory_bytes_per_s: float  # streaming a large fp32 weight once (a 1-row MatMul)
    flops_per_s: float  # fp32 MatMul at a compute-bound size
    threads: int  # intra-op threads: as asked, else onnxruntime's default (one per physical core)

    def as_dict(self) -> dict:
        return {"memory_bytes_per_s": self.memory_bytes_per_s, "flops_per_s": self.flops_per_s,
                "threads": self.threads}


def measure_limits(threads: int | None = None, seconds: float = 1.0) -> MachineLimits:
    """Measure the memory bandwidth and the fp32 arithmetic peak with onnxruntime's CPU kernels.

    Each is a MatMul in an onnxruntime session with llmc's session options (so the threading is
    an engine's: `threads` threads, or the shared pool where `share_threads` made one), its weight
    an initializer prepacked as an engine's are; the best of the repetitions that fit in about
    `seconds` (at least three):

    - bandwidth: [1, K] x [K, N] over an fp32 weight of 256 MiB, or four times the last-level
      cache where that is larger: the weight is read once from memory per run, the arithmetic is
      negligible. It is the bandwidth MLAS's fp32 kernel reaches; the int4/int8 kernels
      (MatMulNBits) unpack as they read and may reach less.
    - peak: [256, 2048] x [2048, 2048], where MLAS's fp32 kernel runs at its best. fp32 only: the
      int8 (VNNI) and bf16/fp16 peaks some CPUs have are not measured, so a quantized product can
      read as above 100% of this peak.

    Needs onnx (llmc[compile]) to build the two graphs.
    """
    if seconds <= 0:
        raise LlmcError(f"seconds: must be positive, got {seconds}")
    k = 8192
    n = max(_streamed_bytes() // (4 * k), 64) // 64 * 64
    streaming = _matmul_seconds(1, k, n, threads, seconds)
    m, k2, n2 = COMPUTE_SHAPE
    computing = _matmul_seconds(m, k2, n2, threads, seconds)
    return MachineLimits(memory_bytes_per_s=4 * (k + k * n + n) / streaming,
                         flops_per_s=2 * m * k2 * n2 / computing, threads=threads or _physical_cores())


def _streamed_bytes() -> int:
    """The weight the bandwidth is measured over: four times the last-level cache, at least 256 MiB."""
    return max(MIN_STREAMED_BYTES, 4 * _last_level_cache_bytes())


def _physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (Linux's topology), else all CPUs."""
    cores = set()
    for cpu in os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ():
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        if not (topology / "core_id").is_file():
            return len(os.sched_getaffinity(0))
        cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
    return len(cores) or os.cpu_count() or 1


def _last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (one instance of it), 0 where it reports none."""
    sizes = [0]
    for level in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = level.read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes)


def _matmul_seconds(m: int, k: int, n: int, threads: int | None, seconds: float) -> float:
    """The best time of a [m, k] x [k, n] fp32 MatMul whose weight is a prepacked initializer."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    weight = TensorProto(name="weight", data_type=TensorProto.FLOAT, dims=[k, n],
                         data_location=TensorProto.EXTERNAL)
    # The bytes come from memory (`add_external_initializers`), not from this placeholder file:
    # the graph stays a few hundred bytes however large the weight.
    weight.external_data.add(key="location", value="weight.bin")
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "weight"], ["y"], name="matmul")], "roofline",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    values = np.full((k, n), 0.5, np.float32)
    options = session_options(threads)
    options.add_external_initializers(["weight"], [ort.OrtValue.ortvalue_from_numpy(values)])
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"a": np.full((m, k), 0.25, np.float32)}
    session.run(None, feeds)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < _REPETITIONS or time.perf_counter() < deadline:
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return min(times)


@dataclass(frozen=True)
class Cost:
    """What some work must move and compute at least."""

    bytes: float  # read or written
    flops: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.bytes + other.bytes, self.flops + other.flops)


def attended_positions(tokens: int, context_tokens: int, sequences: int) -> float:
    """Key positions the query tokens of a step attend, summed over the tokens, under causal
    attention: `tokens` new tokens split evenly over `sequences` sequences whose lengths after
    the step add up to `context_tokens` (exact for a decode step, one token per sequence, and for
    one sequence's prefill chunk; an approximation for steps that mix them)."""
    if sequences <= 0 or tokens < sequences:
        raise LlmcError(f"sequences: {sequences} sequences cannot hold {tokens} tokens")
    # Per sequence, s tokens ending at length t attend s*t - s*(s-1)/2 positions.
    return tokens * context_tokens / sequences - tokens * (tokens / sequences - 1) / 2


def step_cost(weight_bytes: int, geometry: Geometry, tokens: int, context_tokens: int, kv_element_bytes: int,
              *, params: int | None = None, sequences: int | None = None, attended: int | None = None,
              head_params: int = 0, logit_rows: int | None = None) -> Cost:
    """One step of the model.

    Bytes: every weight read once, the keys and values of the `context_tokens` positions the
    step's sequences attend read once per layer, the step's new keys and values written.
    Activations, logits and the rotary tables are left out (small beside the weights at these
    sizes); so are sliding windows (each layer is taken to read every position).
    FLOPs: 2 per parameter of the linear layers per token (the LM head's per logits row only: a
    prompt chunk asks for its last row's), and attention's 4 * heads * head_dim per attended
    position per token per layer (QKᵀ and the weighted sum of V); norms, rotary embedding and
    softmax are left out.

    Args:
        weight_bytes: the weights as stored (an int4 engine's packed bytes and scales); see
            `model_weights`.
        geometry: the manifest's geometry (layers, heads, head_dim).
        tokens: tokens the step runs.
        context_tokens: the step's sequences' lengths after the step, added up.
        kv_element_bytes: bytes of one cached key or value element (the pool's dtype).
        params: the linear layers' parameters; None: `weight_bytes` over 4 (fp32 weights, the
            embedding table counted as a linear layer).
        sequences: sequences in the step; None: one per token (a decode step).
        attended: the positions the step's tokens attend, summed over its tokens, where known
            exactly (`StepPlan.attended_positions`); None: `attended_positions` of the above.
        head_params: the LM head's parameters among `params` (`head_parameters`).
        logit_rows: the rows the LM head runs on; None: every token's.
    """
    sequences = tokens if sequences is None else sequences
    params = weight_bytes / 4 if params is None else params
    kv_per_position = 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim * kv_element_bytes
    if attended is None:
        attended = attended_positions(tokens, context_tokens, sequences)
    rows = tokens if logit_rows is None else logit_rows
    linear = 2 * (params - head_params) * tokens + 2 * head_params * rows
    return Cost(bytes=weight_bytes + kv_per_position * (context_tokens + tokens),
                flops=linear + 4 * geometry.num_heads * geometry.head_dim * attended * geometry.num_layers)


def model_weights(weights: dict[str, dict]) -> tuple[int, int]:
    """(bytes a step reads of the weights, parameters of the linear layers) from `graph_weights`:
    each initializer counted once however many graphs or nodes read it; an embedding table
    (a Gather's) is not read whole, so it is not counted."""
    read: dict[str, int] = {}
    params = 0
    for node in weights.values():
        if node["op"] == "Gather":
            continue
        read.update(zip(node["weight_names"], node["weight_sizes"]))
        if node["op"] in LINEAR_OPS and (matrix := _weight_matrix(node)):
            params += matrix[0] * matrix[1]
    return sum(read.values()), params


def head_parameters(weights: dict[str, dict], vocab_size: int) -> int:
    """The LM head's parameters from `graph_weights`: the linear layers whose output is a logit
    per vocabulary entry (once each, as in `model_weights`)."""
    heads: dict[str, int] = {}
    for node in weights.values():
        matrix = _weight_matrix(node) if node["op"] in LINEAR_OPS else None
        if matrix is not None and matrix[1] == vocab_size:
            heads[node["weight_names"][0]] = matrix[0] * matrix[1]
    return sum(heads.values())


def _weight_matrix(node: dict) -> tuple[int, int] | None:
    """(K, N) of a linear node's weight, None when its weight is not an initializer."""
    attrs = node["attrs"]
    if node["op"] == "MatMulNBits":
        return attrs["K"], attrs["N"]
    position = LINEAR_OPS[node["op"]]
    if position not in node["weight_inputs"]:
        return None
    shape = node["weight_shapes"][node["weight_inputs"].index(position)]
    if len(shape) != 2:
        return None
    return (shape[1], shape[0]) if node["op"] == "Gemm" and attrs.get("transB", 0) else (shape[0], shape[1])


def operator_cost(op_type: str, input_shapes: list, weights: dict | None, *,
                  context_tokens: int | None = None) -> Cost | None:
    """The cost of one operator run as onnxruntime's profiler reported it; None for operators not
    costed here (anything but MatMul, Gemm, MatMulNBits, MatMulInteger, DynamicQuantizeMatMul and
    GroupQueryAttention), or without what it needs.

    Args:
        op_type: the profiler's `op_name`.
        input_shapes: the profiler's `input_type_shape` ([{"float": [1, 7, 576]}, ...]): the
            activations, without the prepacked weights (which it leaves out).
        weights: the node's entry of `graph_weights` (its weights and attributes); None or {}
            when the graph has none for it.
        context_tokens: for GroupQueryAttention, the lengths of the batch's sequences after the
            call, added up: its past buffers' shapes are their capacity, not what is read, so
            without it the attention is not costed.
    """
    inputs = [_profiled(entry) for entry in input_shapes]
    if not inputs or None in inputs:
        return None
    if op_type in LINEAR_OPS:
        return _linear_cost(op_type, inputs, weights)
    if op_type in ATTENTION_OPS and weights and context_tokens is not None:
        return _attention_cost(inputs, weights["attrs"], context_tokens)
    return None


def _profiled(entry: dict) -> tuple[int, list[int]] | None:
    """(element bytes, shape) of one profiler input entry, None for a type not in the table."""
    ((dtype, shape),) = entry.items()
    size = PROFILER_DTYPE_BYTES.get(dtype)
    return None if size is None else (size, list(shape))


def _linear_cost(op_type: str, inputs: list, weights: dict | None) -> Cost | None:
    (a_size, a_shape) = inputs[0]
    matrix = weights and _weight_matrix(weights)
    if not matrix:  # both operands are activations: the profiler lists both
        if op_type != "MatMul" or len(inputs) < 2:
            return None
        (b_size, b_shape) = inputs[1]
        if len(a_shape) < 2 or len(b_shape) < 2 or a_shape[-1] != b_shape[-2]:
            return None
        batch = np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2]))
        m, k, n = math.prod(batch) * a_shape[-2], a_shape[-1], b_shape[-1]
        return Cost(bytes=a_size * math.prod(a_shape) + b_size * math.prod(b_shape) + a_size * m * n,
                    flops=2 * m * k * n)
    k, n = matrix
    trans_a = op_type == "Gemm" and weights["attrs"].get("transA", 0)
    if (a_shape[0] if trans_a else a_shape[-1]) != k:
        return None
    m = math.prod(a_shape) // k
    if op_type in ("MatMul", "Gemm"):
        # Both operands of an onnxruntime MatMul have one type: a weight stored in fp16 beside
        # float activations was cast to float when the session was built, and is read as that.
        weight_bytes = sum(math.prod(shape) * a_size for shape in weights["weight_shapes"])
    else:
        weight_bytes = sum(weights["weight_sizes"])
    out_size = 4 if op_type == "MatMulInteger" else a_size  # int32 accumulators, else A's type
    return Cost(bytes=a_size * m * k + weight_bytes + out_size * m * n, flops=2 * m * k * n)


def _attention_cost(inputs: list, attrs: dict, context_tokens: int) -> Cost | None:
    """GroupQueryAttention: the query (packed with the new keys and values, or beside them), the
    past buffers [batch, kv heads, capacity, head_dim] read up to each sequence's length."""
    activations = [(size, shape) for size, shape in inputs if len(shape) == 3]
    past = [(size, shape) for size, shape in inputs if len(shape) == 4]
    heads, kv_heads = attrs.get("num_heads"), attrs.get("kv_num_heads")
    if not activations or not heads or not kv_heads:
        return None
    size, (batch, tokens, width) = activations[0]
    packed = len(activations) == 1
    head_dim = past[0][1][3] if past else width // (heads + 2 * kv_heads if packed else heads)
    kv_size = past[0][0] if past else size
    new_kv = tokens * batch * 2 * kv_heads * head_dim
    read = context_tokens * 2 * kv_heads * head_dim * kv_size
    io = size * batch * tokens * (heads + 2 * kv_heads) * head_dim + size * batch * tokens * heads * head_dim
    attended = attended_positions(batch * tokens, context_tokens, batch)
    return Cost(bytes=io + read + new_kv * kv_size, flops=4 * heads * head_dim * attended)


def graph_weights(engine_file: str | Path | EngineFile) -> dict[str, dict]:
    """The weights and attributes of the nodes of an engine's onnxruntime graphs (the paged
    segments, the attentions' dense forms, the single-sequence graph, or a contiguous engine's
    model), by node name, which is the name onnxruntime's profiler gives their operators.

    Each entry: {"op", "weight_names", "weight_inputs" (input positions), "weight_shapes",
    "weight_sizes" (bytes as stored: an int4 weight's packed bytes), "weight_bytes" (their sum),
    "attrs" (int, float and string attributes), "sections"}, for every named node that reads an
    initializer or is an attention (whose attributes `operator_cost` needs). Unnamed nodes are
    left out (the profiler cannot be matched to them), and so is a name that stands for different
    nodes in different graphs. No weight is loaded: the graphs reference them. A TensorRT engine
    has no such graphs ({}).

    Needs onnx (llmc[compile]) to parse the graphs.
    """
    import onnx
    from google.protobuf.message import DecodeError
    from onnx import helper

    engine = engine_file if isinstance(engine_file, EngineFile) else read_engine(engine_file, verify=False)
    found: dict[str, dict] = {}
    ambiguous: set[str] = set()
    for section in _graph_sections(engine.manifest):
        try:
            graph = onnx.load_model_from_string(bytes(engine.sections[section])).graph
        except DecodeError as exc:
            raise LlmcError(f"{engine.path}: section '{section}' is not an ONNX graph: {first_line(exc)}") from None
        initializers = {tensor.name: tensor for tensor in graph.initializer}
        for node in graph.node:
            positions = [i for i, name in enumerate(node.input) if name in initializers]
            if not node.name or not (positions or node.op_type in ATTENTION_OPS):
                continue
            tensors = [initializers[node.input[i]] for i in positions]
            sizes = [_stored_bytes(tensor) for tensor in tensors]
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            entry = {"op": node.op_type, "weight_names": [t.name for t in tensors], "weight_inputs": positions,
                     "weight_shapes": [list(t.dims) for t in tensors], "weight_sizes": sizes,
                     "weight_bytes": sum(sizes),
                     "attrs": {name: value.decode() if isinstance(value, bytes) else value
                               for name, value in attrs.items() if isinstance(value, (int, float, bytes))}}
            if node.name in found:
                known = {k: v for k, v in found[node.name].items() if k != "sections"}
                if known != entry:
                    ambiguous.add(node.name)
                found[node.name]["sections"].append(section)
            else:
                found[node.name] = {**entry, "sections": [section]}
    return {name: entry for name, entry in found.items() if name not in ambiguous}


def _graph_sections(manifest) -> list[str]:
    if manifest.backend == "tensorrt":
        return []
    if manifest.paged is None:
        return ["model.onnx"]
    paged = manifest.paged
    names = [name for s in paged.segments for name in (s.section, s.attention and s.attention.dense) if name]
    return list(dict.fromkeys(names + ([paged.single_sequence] if paged.single_sequence else [])))


def _stored_bytes(tensor) -> int:
    from onnx import TensorProto, helper

    count = math.prod(tensor.dims)
    if tensor.data_type in (TensorProto.INT4, TensorProto.UINT4):
        return (count + 1) // 2
    return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def bound(cost: Cost, limits: MachineLimits, seconds: float) -> dict:
    """How `seconds` of measured time compare with the machine's bounds for `cost`: the time the
    bytes take at the measured bandwidth, the time the FLOPs take at the measured peak, which is
    larger (what bounds the work) and its share of `seconds` (1.0: as fast as this machine can)."""
    if seconds <= 0:
        raise LlmcError(f"seconds: must be positive, got {seconds}")
    memory_s, compute_s = cost.bytes / limits.memory_bytes_per_s, cost.flops / limits.flops_per_s
    limiting = "memory" if memory_s >= compute_s else "compute"
    return {"memory_s": memory_s, "compute_s": compute_s, "bound": limiting,
            "fraction": max(memory_s, compute_s) / seconds}


def describe(b: dict) -> str:
    """`bound`'s result in words: "at 71% of the memory bound", "compute-bound at 38% of peak".
    Past 100%, the limit was measured low (the machine busier then than during the run) or the
    work is not what the cost model counts (an int8 product against the fp32 peak): flagged."""
    text = (f"at {b['fraction']:.0%} of the memory bound" if b["bound"] == "memory"
            else f"compute-bound at {b['fraction']:.0%} of peak")
    return text + (" (above the measured limit)" if b["fraction"] > 1 else "")
