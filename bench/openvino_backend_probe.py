"""Can OpenVINO's CPU plugin run llmc's compiled graphs faster than onnxruntime, and is bf16
compute where OpenVINO GenAI's lead on batches and prefill comes from? A probe, run before any
OpenVINO backend is built.

    pip install openvino   # the runtime wheel alone; no llmc extra installs it (a probe, not the product)
    python bench/openvino_backend_probe.py ENGINE [--optimized OPT.onnx] [--rounds 5] [--groups ...]

ENGINE is a paged fp32 engine (`llmc export DIR -o m.onnx; llmc compile m.onnx -o m.plan`),
OPT.onnx the same model through `llmc optimize` (level 2: Attention-23 over past/present inputs).
Each system is a worker process of its own with 2 threads (onnxruntime: llmc's shared spinning
pool; OpenVINO: INFERENCE_NUM_THREADS 2, one stream, LATENCY), each holding the same graphs and
inputs; the parent alternates them (rotating who goes first) and reports each case's median
call time and its ratio to onnxruntime in the same run. Groups:

  whole     the engine's single-sequence section (GroupQueryAttention over KV rows): a 128-token
            prompt (logits of the last row) and a batch-1 decode at context 128. onnxruntime runs
            it as the runtime does (IOBinding, past and present one buffer); OpenVINO gets the
            past at its exact length and returns a fresh present, its only form (below).
  segments  the engine's 31 segments, chained, the paged attention between them replaced by
            fixed random values: the linear work of a 16-sequence decode step (16 tokens) and of
            a 128-token prompt chunk, without attention.
  optimized OPT.onnx, attention included, KV concatenated as past/present tensors: a decode step
            of 16 sequences at context 128, and a 128-token prompt.
  matmul    SmolLM2's linear layers alone, 30 x (x[M,576] @ [576,960] -> SiLU -> @ [960,576] ->
            +x -> @ [576,3072] -> SiLU-gate -> @ [1536,576] -> +x), M = 16 and 128, weights
            random: the GEMMs with none of the rest.
Outputs are checked against onnxruntime (max abs difference of the logits, or of the final
activations for `matmul`, and top-1 agreement of the logit rows).

Findings, SmolLM2-135M-Instruct fp32, openvino 2026.4.1, onnxruntime 1.32, AMD EPYC with
AVX-512 + avx512_bf16 + VNNI (no AMX), 2 threads, a machine shared with other work (figures move
±30% between runs; the ratios are what to read):

- Everything llmc writes converts and compiles (`core.read_model` of the ONNX): the raw export
  (opset 20, 7,508 nodes), the optimized graph (RMSNormalization-23, RotaryEmbedding-23,
  Attention-23), every segment and the dense-attention section, and the single-sequence graph:
  OpenVINO's ONNX front end has com.microsoft GroupQueryAttention (to its internal op, decomposed
  to ScaledDotProductAttention in the CPU plugin). RMSNormalization becomes ReduceMean/Sqrt/Power
  (fused again by the plugin). No refusal; MatMulNBits was not tried (fp32 engine).
- GroupQueryAttention runs in OpenVINO for one sequence only: 16 sequences fail at inference,
  `[CPU] Reshape node with name 'Reshape_…' Check 'minusOneCount <= 1 && inputProduct ==
  outputProduct' failed …: the shape of input data (16) conflicts with the reshape pattern (1)`
  (its decomposition reshapes seqlens_k to [1]: "Only consider batch is 1"). It ignores
  total_sequence_length, and with a dynamic past its present is Concat(past[:seqlens_k+1-new],
  new): a fresh tensor, the whole context copied per layer per step; llmc's shared-buffer mode
  (past bound as present, appended in place) does not exist there. So the whole graph can serve
  OpenVINO only for batch-1 steps, and its KV would have to be handed over at its exact length.
- Making llmc's optimized graph OpenVINO-paged as GenAI does (`apply_make_stateful_transformation`
  with past→present names: 60 states, fine; then `paged_attention_transformation`) fails:
  `Model references undeclared parameters: opset1::Parameter attention_mask` (the transformation
  drops attention_mask, which llmc's mask subgraph before Attention-23 still reads). The raw
  export has no SDPA at all: `No ScaledDotProductAttention operation observed in the graph`.
- CPU plugin defaults here: INFERENCE_PRECISION_HINT bf16, KV_CACHE_PRECISION u8. Under bf16
  every FullyConnected (the 121 MatMuls) runs in bf16, under f32 in f32.

Time per call, OpenVINO ÷ onnxruntime in the same run (two runs; < 1 is OpenVINO faster):

| case (run 1 / run 2)                   | OV f32      | OV bf16     | bf16 max abs diff |
|----------------------------------------|-------------|-------------|-------------------|
| linear layers only, 16 rows            | 0.84 / 0.87 | 0.59 / 0.60 | 4e-4 (f32: 5e-6)  |
| linear layers only, 128 rows           | 0.98 / 0.95 | 0.53 / 0.52 | 5e-4 (f32: 5e-6)  |
| segments, 16-token decode step         | 0.96 / 1.06 | 0.76 / 0.78 | 2.3               |
| segments, 128-token prompt             | 1.06 / 0.94 | 0.66 / 0.61 | 0.29              |
| optimized graph, prompt 128 (+attn)    | 1.03 / 1.01 | 0.60 / 0.57 | 0.22              |
| optimized graph, decode 16 seqs @128   | 1.61 / 1.70 | 1.12 / 1.18 | 0.41              |
| whole graph (GQA), prompt 128          | 1.86 / 0.99 | 0.94 / 0.59 | 0.28              |
| whole graph (GQA), decode 1 seq @128   | 1.70 / 1.30 | 1.05 / 1.05 | 0.30              |
(onnxruntime, run 2: linear 27 / 151 ms, segments 38 / 173 ms, optimized 192 / 48 ms, whole
167 / 22 ms. `python bench/openvino_backend_probe.py smol.plan --optimized smol.opt.onnx
--rounds 3`, each case 3 rounds x 8 calls (decode) or x 3 (prompt).)
OpenVINO f32 against onnxruntime: max abs logit difference 4e-5 to 2e-4, top-1 identical.
bf16: logits move by 0.2-0.4 (2.3 in the segments, whose attention inputs are random), top-1
still identical on these rows; it would need llmc's accuracy gate like any precision option.

What this says:
- Prefill's gap is bf16, not kernels: at f32 OpenVINO's products are as fast as onnxruntime's
  on 128 rows (0.95-1.06 in every form), bf16 makes them 1.6-1.9x faster (vdpbf16ps doubles
  the peak; bf16 weights halve the traffic). This matches the issue's TTFT rows (GenAI f32 194
  ms = llmc's 199; bf16 107).
- The 16-row step's gap is only partly bf16: the segments' linear work gains 1.3x (0.76-0.78),
  f32 kernels are level (0.96-1.06). The issue's GenAI f32 row (382 tok/s against llmc's 174)
  shows the rest is outside the linear layers: the segments alone take 38-42 ms for 16 tokens
  (~400 tok/s), so llmc's attention kernel, per-segment calls and step overhead are where a
  16-row step loses most; profile those (the issue's third direction).
- OpenVINO is slower than onnxruntime wherever attention over a cache runs in its graph: its
  GQA decomposition (the past concatenated, a mask built per call) makes a batch-1 decode
  1.3-1.7x slower at f32, Attention-23 over concatenated KV at 16 sequences 1.6-1.7x; bf16 only
  brings these back to about parity.
Recommendation: an OpenVINO backend would pay only as segments (the linear work between llmc's
own attention kernel, which keeps reading the pool in place), compiled with bf16 where the CPU
has avx512_bf16 (or AMX) and the accuracy check passes: ~1.3x on a 16-row step's linear work
and ~1.5-1.6x on prompt chunks, attention unchanged. Batch-1 decode would not gain (GQA batch 1
only, KV copied per call, 1.05 at best): the onnxruntime whole graph stays for it. Before adding
a second runtime, measure whether onnxruntime gives the same bf16 gain (bf16 MatMul, or a bf16
GEMM for the segments' linear layers). KV through OpenVINO's own PagedAttentionExtension would
need llmc's optimized graph without its attention_mask subgraph; unmeasured.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

THREADS = 2
CONTEXT = 128  # cached positions of a decode step
PROMPT = 128
SEQUENCES = 16
SYSTEMS = ("onnxruntime", "openvino f32", "openvino bf16")
# calls of each case per round: decode steps are short, prompts long
REPS = {"decode": 8, "prefill": 3}


# ---- the graphs and inputs each case runs, built alike in every worker ----------------------

def _kv_names(names):
    return [n for n in names if n.startswith("past_key_values.")]


def _present(past_name: str) -> str:
    return past_name.replace("past_key_values.", "present.")


def prompt_ids(engine_path: str) -> np.ndarray:
    """PROMPT + SEQUENCES tokens of real text (Python's own source), so that logits are a real
    model's and top-1 agreement means something: the prompt, then each decoding sequence's token."""
    import json as source

    from llmc.formats.engine_file import read_engine
    from llmc.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_json(bytes(read_engine(engine_path, verify=False).sections["tokenizer.json"]).decode())
    ids = tokenizer.encode(Path(source.__file__).read_text())
    return np.array(ids[:PROMPT + SEQUENCES], np.int64)


def _whole_inputs(kind: str, ids: np.ndarray):
    """The single-sequence graph's inputs (pasts apart): the prompt, or a decode after it."""
    tokens, past = (ids[None, :PROMPT], 0) if kind == "prefill" else (ids[None, PROMPT:PROMPT + 1], PROMPT)
    total = past + tokens.shape[1]
    return {"input_ids": tokens, "position_ids": np.arange(past, total)[None],
            "seqlens_k": np.array([total - 1], np.int32), "total_sequence_length": np.array(total, np.int32),
            "logits_rows": np.array([tokens.shape[1] - 1], np.int64)}


def _optimized_inputs(kind: str, ids: np.ndarray, pasts: dict):
    """The prompt (`pasts` empty), or a decode step of SEQUENCES sequences that all hold the
    prompt's keys and values (`pasts`, the prompt's presents) and each decode another token."""
    if kind == "prefill":
        tokens = ids[None, :PROMPT]
    else:
        tokens = ids[PROMPT:PROMPT + SEQUENCES, None]
        pasts = {name: np.repeat(past, SEQUENCES, axis=0) for name, past in pasts.items()}
    batch, count = tokens.shape
    past = next(iter(pasts.values())).shape[2]
    return {"input_ids": tokens, "attention_mask": np.ones((batch, past + count), np.int64),
            "position_ids": np.broadcast_to(np.arange(past, past + count), (batch, count)).copy(), **pasts}


def matmul_model(path: Path, layers: int = 30, hidden: int = 576, qkv: int = 960, ffn: int = 1536) -> None:
    """SmolLM2's per-layer linear shapes, chained with the cheap elementwise ops between them (so
    that no two weights can be folded into one)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    nodes, weights, x = [], [], "x"

    def weight(name, rows, cols):
        values = rng.standard_normal((rows, cols)) * 0.1 / np.sqrt(rows)  # small: 60 residual adds stay finite
        weights.append(numpy_helper.from_array(values.astype(np.float32), name))
        return name

    def op(kind, inputs, output, **attrs):
        nodes.append(helper.make_node(kind, inputs, [output], **attrs))
        return output

    for i in range(layers):
        h = op("MatMul", [x, weight(f"w.qkv{i}", hidden, qkv)], f"h{i}")
        h = op("Mul", [h, op("Sigmoid", [h], f"hs{i}")], f"ha{i}")
        a = op("MatMul", [h, weight(f"w.o{i}", qkv, hidden)], f"a{i}")
        x = op("Add", [x, a], f"r{i}")
        gu = op("MatMul", [x, weight(f"w.gu{i}", hidden, 2 * ffn)], f"gu{i}")
        nodes.append(helper.make_node("Split", [gu], [f"g{i}", f"u{i}"], axis=-1, num_outputs=2))
        g = op("Mul", [f"g{i}", op("Sigmoid", [f"g{i}"], f"gs{i}")], f"gg{i}")
        m = op("MatMul", [op("Mul", [g, f"u{i}"], f"m{i}"), weight(f"w.d{i}", ffn, hidden)], f"d{i}o")
        x = op("Add", [x, m], f"x{i + 1}")
    graph = helper.make_graph(nodes, "linear_chain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["rows", hidden])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)


# ---- onnxruntime --------------------------------------------------------------------------

class OrtCases:
    def __init__(self, group: str, ids: np.ndarray, engine_path: str, optimized: str | None, matmul: str | None):
        import onnxruntime as ort

        from llmc.formats.engine_file import FileRange, read_engine
        from llmc.formats.sessions import open_session, session_options, share_threads

        share_threads(THREADS)
        self.cases = {}
        if group in ("whole", "segments"):
            engine = read_engine(engine_path, verify=False)
            geometry, paged = engine.manifest.geometry, engine.manifest.paged
            data = {"model.onnx.data": FileRange(engine.path, engine.offsets["model.onnx.data"])}

            def opened(section):
                return open_session({"model.onnx": engine.sections[section], **data}, session_options(THREADS))
        if group == "whole":
            session = opened(paged.single_sequence)
            # As the runtime runs it: one buffer per layer and part, bound as past and present,
            # which the prompt fills and the decode appends to.
            buffers = {name: np.zeros((1, geometry.num_kv_heads, CONTEXT + PROMPT, geometry.head_dim), np.float32)
                       for name in _kv_names(i.name for i in session.get_inputs())}
            values = {name: ort.OrtValue.ortvalue_from_numpy(buffer) for name, buffer in buffers.items()}
            for kind in ("prefill", "decode"):
                feeds = _whole_inputs(kind, ids)
                binding = session.io_binding()
                binding.bind_output("logits")  # first: get_outputs()[0]
                for name, value in values.items():
                    binding.bind_ortvalue_input(name, value)
                    binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), value)
                for name, array in feeds.items():
                    binding.bind_cpu_input(name, array)

                def run(binding=binding, kept=(buffers, values, feeds)):  # the binding reads these arrays
                    session.run_with_iobinding(binding)
                    return binding.get_outputs()[0].numpy()[0]
                self.cases[f"whole {kind}"] = run
            self.cases["whole prefill"]()  # the decode's past
        elif group == "segments":
            sessions = [s.section and opened(s.section) for s in paged.segments]
            for kind, tokens in (("decode", SEQUENCES), ("prefill", PROMPT)):
                self.cases[f"segments {kind}"] = _segment_chain(paged.segments, sessions, tokens, geometry,
                                                                lambda s, names, feeds: s.run(names, feeds))
        elif group == "optimized":
            session = ort.InferenceSession(optimized, session_options(THREADS), providers=["CPUExecutionProvider"])
            names = _kv_names(i.name for i in session.get_inputs())
            _, heads, _, dim = session.get_inputs()[3].shape
            prompt = _optimized_inputs("prefill", ids, {n: np.zeros((1, heads, 0, dim), np.float32) for n in names})
            presents = dict(zip(names, session.run([_present(n) for n in names], prompt)))
            for kind, feeds in (("prefill", prompt), ("decode", _optimized_inputs("decode", ids, presents))):
                self.cases[f"optimized {kind}"] = lambda feeds=feeds: session.run(["logits"], feeds)[0][:, -1]
        else:
            session = ort.InferenceSession(matmul, session_options(THREADS), providers=["CPUExecutionProvider"])
            for kind, rows in (("decode", SEQUENCES), ("prefill", PROMPT)):
                x = np.random.default_rng(4).standard_normal((rows, 576)).astype(np.float32)
                self.cases[f"matmul {kind}"] = lambda x=x: session.run(None, {"x": x})[0]

    def info(self):
        return ""


def _segment_chain(segments, sessions, tokens: int, geometry, call):
    """A step through every segment, each attention's output a fixed random stand-in."""
    rng = np.random.default_rng(5)
    decode = tokens == SEQUENCES
    start = {"input_ids": rng.integers(0, 49152, (1, tokens)),
             "position_ids": (np.full(tokens, CONTEXT) if decode else np.arange(tokens))[None],
             "logits_rows": np.arange(tokens) if decode else np.array([tokens - 1])}
    for segment in segments:
        if segment.attention is not None:
            shape = (tokens, geometry.num_heads, geometry.head_dim)
            start[segment.attention.output] = rng.standard_normal(shape).astype(np.float32)

    def run():
        values = dict(start)
        for segment, session in zip(segments, sessions):
            if session is not None:
                outputs = call(session, list(segment.outputs), {name: values[name] for name in segment.inputs})
                values.update(zip(segment.outputs, outputs))
        return values["logits"][0]
    return run


# ---- OpenVINO -------------------------------------------------------------------------------

class OvCases:
    def __init__(self, group: str, precision: str, ids: np.ndarray, engine_path: str, optimized: str | None,
                 matmul: str | None):
        import openvino as ov

        core = ov.Core()
        config = {"INFERENCE_NUM_THREADS": THREADS, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY",
                  "INFERENCE_PRECISION_HINT": precision}
        self.compiled, self.cases = [], {}

        def compiled(path_or_model):
            model = core.compile_model(path_or_model, "CPU", config)
            self.compiled.append(model)
            return model

        def caller(model):
            request, outputs = model.create_infer_request(), list(model.outputs)

            def call(names, feeds):
                result = request.infer(feeds, share_inputs=True, share_outputs=True)
                by_name = {name: result[port] for port in outputs for name in port.get_names()}
                return [by_name[name] for name in names]
            return call

        if group in ("whole", "segments"):
            from llmc.formats.engine_file import FileRange, bind_weights, read_engine

            engine = read_engine(engine_path, verify=False)
            geometry, paged = engine.manifest.geometry, engine.manifest.paged
            data = FileRange(engine.path, engine.offsets["model.onnx.data"])

            def opened(section):
                # The bound graph names the weights relative to the engine's folder: read it from there.
                fd, path = tempfile.mkstemp(suffix=".onnx", dir=engine.path.parent)
                try:
                    os.write(fd, bind_weights(engine.sections[section], data))
                    os.close(fd)
                    return compiled(core.read_model(path))
                finally:
                    os.unlink(path)
        if group == "whole":
            model = opened(paged.single_sequence)
            call = caller(model)
            # Its only form: the past at its exact length, a fresh present (the prompt's, here).
            names = _kv_names(n for port in model.inputs for n in port.get_names())
            empty = {n: np.zeros((1, geometry.num_kv_heads, 0, geometry.head_dim), np.float32) for n in names}
            prompt = {**_whole_inputs("prefill", ids), **empty}
            presents = [np.array(a) for a in call([_present(n) for n in names], prompt)]
            decode = {**_whole_inputs("decode", ids), **dict(zip(names, presents))}
            for kind, feeds in (("prefill", prompt), ("decode", decode)):
                self.cases[f"whole {kind}"] = lambda feeds=feeds: call(["logits"], feeds)[0][0]
        elif group == "segments":
            calls = [s.section and caller(opened(s.section)) for s in paged.segments]
            for kind, tokens in (("decode", SEQUENCES), ("prefill", PROMPT)):
                self.cases[f"segments {kind}"] = _segment_chain(paged.segments, calls, tokens, geometry,
                                                                lambda c, names, feeds: c(names, feeds))
        elif group == "optimized":
            model = compiled(core.read_model(optimized))
            call = caller(model)
            shape = model.input("past_key_values.0.key").get_partial_shape()
            heads, dim = shape[1].get_length(), shape[3].get_length()
            names = _kv_names(n for port in model.inputs for n in port.get_names())
            prompt = _optimized_inputs("prefill", ids, {n: np.zeros((1, heads, 0, dim), np.float32) for n in names})
            presents = dict(zip(names, (np.array(a) for a in call([_present(n) for n in names], prompt))))
            for kind, feeds in (("prefill", prompt), ("decode", _optimized_inputs("decode", ids, presents))):
                self.cases[f"optimized {kind}"] = lambda feeds=feeds: call(["logits"], feeds)[0][:, -1]
        else:
            model = compiled(core.read_model(matmul))
            call, output = caller(model), next(iter(model.outputs[0].get_names()))
            for kind, rows in (("decode", SEQUENCES), ("prefill", PROMPT)):
                x = np.random.default_rng(4).standard_normal((rows, 576)).astype(np.float32)
                self.cases[f"matmul {kind}"] = lambda x=x: call([output], {"x": x})[0]

    def info(self) -> str:
        """How many of the compiled graphs' matrix products run in each precision."""
        counts = {}
        for model in self.compiled:
            for op in model.get_runtime_model().get_ordered_ops():
                info = op.get_rt_info()
                kind = info["layerType"].astype(str)
                if kind in ("FullyConnected", "MatMul", "ScaledDotProductAttention"):
                    key = f"{kind} {info['runtimePrecision'].astype(str)}"
                    counts[key] = counts.get(key, 0) + 1
        return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


# ---- the worker processes and the alternation ------------------------------------------------

def worker(conn, system: str, group: str, ids: np.ndarray, engine: str, optimized: str | None,
           matmul: str | None) -> None:
    try:
        if system == "onnxruntime":
            cases = OrtCases(group, ids, engine, optimized, matmul)
        else:
            cases = OvCases(group, system.split()[1], ids, engine, optimized, matmul)
        for run in cases.cases.values():  # first calls: allocations, OpenVINO's shape-specific plans
            run(), run()
        conn.send(("ready", list(cases.cases), cases.info()))
    except Exception as error:  # reported by the parent, the other systems go on
        conn.send(("failed", f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}", ""))
        return
    while True:
        command = conn.recv()
        if command[0] == "stop":
            return
        if command[0] == "output":
            conn.send(np.array(cases.cases[command[1]](), np.float32, copy=True))
            continue
        _, name, reps = command
        run, times = cases.cases[name], []
        for _ in range(reps):
            begin = time.perf_counter()
            run()
            times.append(time.perf_counter() - begin)
        conn.send(times)


def measure(group: str, args) -> list[dict]:
    context = mp.get_context("spawn")
    workers = {}
    for system in SYSTEMS:  # one at a time: building two at once would time nothing but slow both
        parent, child = context.Pipe()
        process = context.Process(target=worker, args=(child, system, group, args.ids, args.engine,
                                                       args.optimized, args.matmul))
        process.start()
        status, detail, info = parent.recv()
        if status == "failed":
            print(f"{group}: {system} failed: {detail}", flush=True)
            process.join()
            continue
        print(f"{group}: {system} ready{' (' + info + ')' if info else ''}", flush=True)
        workers[system] = (process, parent, detail)
    if "onnxruntime" not in workers:
        return []
    cases = workers["onnxruntime"][2]
    times = {(system, case): [] for system in workers for case in cases}
    order = list(workers)
    for round_ in range(args.rounds):
        for system in order[round_ % len(order):] + order[:round_ % len(order)]:
            _, conn, own = workers[system]
            for case in cases:
                if case in own:
                    conn.send(("time", case, REPS[case.split()[-1]]))
                    times[system, case] += conn.recv()
    reference = {}
    for case in cases:
        workers["onnxruntime"][1].send(("output", case))
        reference[case] = workers["onnxruntime"][1].recv()
    rows = []
    for case in cases:
        base = statistics.median(times["onnxruntime", case])
        for system, (_, conn, own) in workers.items():
            if case not in own:
                continue
            median = statistics.median(times[system, case])
            conn.send(("output", case))
            output, ref = conn.recv(), reference[case]
            diff = float(np.abs(output - ref).max())
            top1 = float((output.argmax(-1) == ref.argmax(-1)).mean()) if case.split()[0] != "matmul" else None
            rows.append({"case": case, "system": system, "median_ms": median * 1e3, "ratio": median / base,
                         "max_abs_diff": diff, "top1_agree": top1})
    for process, conn, _ in workers.values():
        conn.send(("stop",))
        process.join()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", help="a paged fp32 engine file (llmc compile)")
    parser.add_argument("--optimized", help="the same model's `llmc optimize` output (optimized group)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", default="whole,segments,optimized,matmul")
    args = parser.parse_args()
    groups = args.groups.split(",")
    unknown = set(groups) - {"whole", "segments", "optimized", "matmul"}
    if unknown:
        sys.exit(f"--groups: unknown {', '.join(sorted(unknown))} (whole, segments, optimized, matmul)")
    if "optimized" in groups and not args.optimized:
        sys.exit("--optimized: needed for the optimized group")
    args.ids = prompt_ids(args.engine)
    with tempfile.TemporaryDirectory() as folder:
        args.matmul = None
        if "matmul" in groups:
            args.matmul = str(Path(folder) / "linear_chain.onnx")
            matmul_model(Path(args.matmul))
        for group in groups:  # each group's table as soon as it is measured
            print(f"\n{'case':20} {'system':15} {'median ms':>10} {'x ort':>7} {'max abs diff':>13} {'top-1':>6}")
            for row in measure(group, args):
                top1 = "" if row["top1_agree"] is None else f"{row['top1_agree']:.2f}"
                print(f"{row['case']:20} {row['system']:15} {row['median_ms']:10.2f} {row['ratio']:7.2f} "
                      f"{row['max_abs_diff']:13.2e} {top1:>6}", flush=True)


if __name__ == "__main__":
    main()
