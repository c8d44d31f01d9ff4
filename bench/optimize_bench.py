"""Graph-optimization benchmark: llmc's optimizer against the raw export and the usual alternatives.

One ~32M-parameter Llama-style checkpoint (random seeded weights, written as a Hugging Face
folder with transformers and llmc's byte-level tokenizer) is turned into five graphs, each run
by onnxruntime on the CPU with the same thread count:

  raw               `llmc export` (torch.onnx dynamo), session optimizer off (ORT_DISABLE_ALL)
  ort-session       the same file, onnxruntime's own session optimizer (ORT_ENABLE_ALL)
  ort-transformers  onnxruntime.transformers.optimizer.optimize_model(model_type="gpt2")
  llmc-O2           `llmc optimize --level 2` (compiler.pipeline.optimize_file)
  genai-builder     onnxruntime-genai's model builder (fp32, cpu), run with a plain session

The last four run with ORT_ENABLE_ALL. Shapes: prefill of 128 tokens at batch 1 and 8 (empty
past) and one decode token after a past of 128 at batch 1 and 16. Each shape is warmed up, then
timed in rounds that run every variant once, in a rotating order, so that the load of a shared
machine falls on all variants alike. Reported: median and p90 latency, node counts (the graph
given to the session and the graph the session optimizer leaves), speedups, and whether the
logits agree with raw.

    python bench/optimize_bench.py [--json] [--quick] [--profile] [--save-json PATH] [--work-dir DIR]

Progress goes to stderr; stdout gets the table, or one JSON object with --json.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime as ort

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import record  # noqa: E402

DEFAULT_WORK_DIR = BENCH_DIR / ".work"
AGREEMENT_TOLERANCE = 1e-3
# What the optimizer is held to on the decode shapes: llmc-O2's speed-up over the raw export and
# over onnxruntime's transformers optimizer.
GOALS = {"raw": 1.3, "ort-transformers": 1.1}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The benchmark checkpoint: a Llama-style decoder of about 32M parameters."""

    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    max_positions: int = 1024
    initializer_range: float = 0.02
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True)
class Shape:
    """One timed input shape: `seq` new tokens per sequence after `past` cached ones."""

    name: str
    batch: int
    seq: int
    past: int


SHAPES = [
    Shape("prefill b1 s128", batch=1, seq=128, past=0),
    Shape("prefill b8 s128", batch=8, seq=128, past=0),
    Shape("decode b1 p128", batch=1, seq=1, past=128),
    Shape("decode b16 p128", batch=16, seq=1, past=128),
]
AGREEMENT_SHAPES = ("prefill b1 s128", "decode b1 p128")


@dataclasses.dataclass(frozen=True)
class Timing:
    """How long to time each shape: rounds fill `budget_s`, within [min_rounds, max_rounds]."""

    warmup: int
    budget_s: float
    min_rounds: int
    max_rounds: int


FULL = Timing(warmup=3, budget_s=50.0, min_rounds=10, max_rounds=1500)
QUICK = Timing(warmup=1, budget_s=2.0, min_rounds=3, max_rounds=20)


@dataclasses.dataclass
class Variant:
    """A graph to time and the session optimization level it runs under."""

    name: str
    description: str
    level: ort.GraphOptimizationLevel
    path: Path | None = None
    build_seconds: float | None = None
    error: str | None = None
    session: ort.InferenceSession | None = None
    nodes: int | None = None
    ops: dict[str, int] = dataclasses.field(default_factory=dict)
    passes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    session_nodes: int | None = None
    session_ops: dict[str, int] = dataclasses.field(default_factory=dict)


_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


# --- the checkpoint -------------------------------------------------------------------------


def ensure_checkpoint(folder: Path, spec: ModelSpec) -> int:
    """Write the random-weight HF folder unless a matching one is cached; return its parameter count."""
    stamp = folder / "llmc_bench_spec.json"
    wanted = dataclasses.asdict(spec)
    if stamp.is_file():
        cached = json.loads(stamp.read_text())
        if cached.get("spec") == wanted and (folder / "model.safetensors").is_file():
            log(f"checkpoint: cached in {folder}")
            return int(cached["parameters"])
    import torch
    import transformers

    from llmc.tokenizer import byte_level_tokenizer

    log(f"checkpoint: writing {folder}")
    if folder.exists():
        shutil.rmtree(folder)
    tokenizer = byte_level_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions, rms_norm_eps=1e-5,
        initializer_range=spec.initializer_range, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id,
    )
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    # save_pretrained also writes generation_config.json, which the genai builder reads.
    model.save_pretrained(folder, safe_serialization=True)
    # The byte-level tokenizer covers ids 0..257 of the 8192: enough for the builders, which only
    # copy it; the benchmark feeds token ids directly.
    tokenizer.save(folder)
    stamp.write_text(json.dumps({"spec": wanted, "parameters": parameters}, indent=2) + "\n")
    return parameters


# --- building the variants ------------------------------------------------------------------


def build_variants(checkpoint: Path, spec: ModelSpec, models: Path, cache: Path) -> list[Variant]:
    """Export and optimize every variant into `models`; a failed build is recorded, not raised."""
    O = ort.GraphOptimizationLevel
    variants = [
        Variant("raw", "llmc export (dynamo), session optimizer off", O.ORT_DISABLE_ALL),
        Variant("ort-session", "llmc export, onnxruntime session optimizer", O.ORT_ENABLE_ALL),
        Variant("ort-transformers", "onnxruntime.transformers optimize_model(model_type=gpt2)",
                O.ORT_ENABLE_ALL),
        Variant("llmc-O2", "llmc optimize --level 2", O.ORT_ENABLE_ALL),
        Variant("genai-builder", "onnxruntime-genai model builder, fp32 cpu", O.ORT_ENABLE_ALL),
    ]
    by_name = {v.name: v for v in variants}
    if models.exists():
        shutil.rmtree(models)
    models.mkdir(parents=True)
    raw = models / "raw.onnx"

    def export_raw() -> Path:
        from llmc.compiler.export import export

        export(str(checkpoint), raw, check=False, progress=lambda m: log(f"  {m}"))
        return raw

    def ort_transformers() -> Path:
        from onnxruntime.transformers.optimizer import optimize_model

        out = models / "ort-transformers.onnx"
        optimized = optimize_model(str(raw), model_type="gpt2", num_heads=spec.num_heads,
                                   hidden_size=spec.hidden_size)
        optimized.save_model_to_file(str(out))
        return out

    def llmc_o2() -> Path:
        from llmc.compiler.pipeline import optimize_file

        out = models / "llmc-O2.onnx"
        report = optimize_file(raw, out, level=2, progress=lambda m: log(f"  {m}"))
        keys = ("pass", "matches", "nodes_after", "seconds")
        by_name["llmc-O2"].passes = [{key: entry[key] for key in keys} for entry in report]
        return out

    def genai_builder() -> Path:
        out = models / "genai"
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint),
                   "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(cache)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"exit {done.returncode}: " + " | ".join(tail))
        return out / "model.onnx"

    steps: list[tuple[str, Callable[[], Path]]] = [
        ("raw", export_raw),
        ("ort-transformers", ort_transformers),
        ("llmc-O2", llmc_o2),
        ("genai-builder", genai_builder),
    ]
    for name, step in steps:
        log(f"build: {name}")
        start = time.perf_counter()
        try:
            # Exporters and optimizers print to stdout; keep it for the report.
            with contextlib.redirect_stdout(sys.stderr):
                by_name[name].path = step()
        except Exception as exc:  # any failure of a third-party builder is a result to report
            if name == "raw":
                raise
            by_name[name].error = f"{type(exc).__name__}: {str(exc).strip()}"[:2000]
            log(f"build: {name} FAILED: {by_name[name].error}")
            continue
        by_name[name].build_seconds = round(time.perf_counter() - start, 2)
    by_name["ort-session"].path = raw
    by_name["ort-session"].build_seconds = 0.0
    return variants


# --- sessions, inputs, node counts ----------------------------------------------------------


def session_options(level: ort.GraphOptimizationLevel, threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    # Idle intra-op threads spin by default. Five sessions in one process, run in turn, would
    # then each find the 2 cores busy with the previous session's spinning pool: with 2 threads
    # on 2 cores that inflates a decode step 2-3x (3.4 ms alone, 11 ms interleaved) and swamps the graphs'
    # differences. Without spinning, interleaved and alone agree within the noise.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def op_histogram(path: Path) -> tuple[int, dict[str, int]]:
    graph = onnx.load(str(path), load_external_data=False).graph
    counts = collections.Counter(
        (f"{n.domain}." if n.domain not in ("", "ai.onnx") else "") + n.op_type for n in graph.node)
    return len(graph.node), dict(counts.most_common())


def count_session_graph(variant: Variant, threads: int, scratch: Path) -> None:
    """Node count of the graph the session optimizer leaves (saved through optimized_model_filepath)."""
    options = session_options(variant.level, threads)
    saved = scratch / f"{variant.name}.session.onnx"
    options.optimized_model_filepath = str(saved)
    ort.InferenceSession(str(variant.path), options, providers=["CPUExecutionProvider"])
    variant.session_nodes, variant.session_ops = op_histogram(saved)
    saved.unlink()


def make_inputs(spec: ModelSpec, shape: Shape) -> dict[str, np.ndarray]:
    """Seeded inputs for every name any variant takes; each variant picks the ones it declares."""
    rng = np.random.default_rng(1000 + shape.batch * 7 + shape.seq * 13 + shape.past)
    feeds = {
        "input_ids": rng.integers(0, spec.vocab_size, (shape.batch, shape.seq), dtype=np.int64),
        "attention_mask": np.ones((shape.batch, shape.past + shape.seq), dtype=np.int64),
        "position_ids": np.broadcast_to(np.arange(shape.past, shape.past + shape.seq, dtype=np.int64),
                                        (shape.batch, shape.seq)).copy(),
    }
    cache_shape = (shape.batch, spec.num_kv_heads, shape.past, spec.head_dim)
    for i in range(spec.num_layers):
        for part in ("key", "value"):
            feeds[f"past_key_values.{i}.{part}"] = rng.standard_normal(cache_shape, dtype=np.float32)
    return feeds


def feeds_for(session: ort.InferenceSession, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    missing = [i.name for i in session.get_inputs() if i.name not in inputs]
    if missing:
        raise RuntimeError(f"graph takes inputs the benchmark does not know: {', '.join(missing)}")
    return {i.name: inputs[i.name] for i in session.get_inputs()}


# --- measuring ------------------------------------------------------------------------------


def stats(samples_ms: list[float]) -> dict[str, Any]:
    values = np.asarray(samples_ms)
    return {"median_ms": round(float(np.median(values)), 3),
            "p90_ms": round(float(np.percentile(values, 90)), 3),
            "min_ms": round(float(values.min()), 3), "n": len(samples_ms)}


def time_shape(variants: list[Variant], feeds: dict[str, dict[str, np.ndarray]], timing: Timing,
               shape: Shape) -> dict[str, list[float]]:
    """Warm up, then time rounds of one run per variant, rotating the order every round."""
    round_s = 0.0
    for variant in variants:
        start = time.perf_counter()
        for _ in range(timing.warmup):
            variant.session.run(None, feeds[variant.name])
        round_s += (time.perf_counter() - start) / timing.warmup
    rounds = int(min(timing.max_rounds, max(timing.min_rounds, timing.budget_s / max(round_s, 1e-6))))
    log(f"time: {shape.name}: {rounds} rounds of {len(variants)} variants (~{round_s * rounds:.0f} s)")
    samples: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for variant in order:
            start = time.perf_counter_ns()
            variant.session.run(None, feeds[variant.name])
            samples[variant.name].append((time.perf_counter_ns() - start) / 1e6)
    return samples


def profile_ops(variants: list[Variant], threads: int, feeds: dict[str, dict[str, dict[str, np.ndarray]]],
                runs: dict[str, int], scratch: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Median µs per run in each op type, per variant and shape, from onnxruntime's profiler.

    Every variant gets its own profiling session; the runs are interleaved round-robin, as in
    the timing, so a burst of load on the shared machine does not fall on one variant only.
    """
    sessions, labels = {}, {v.name: [] for v in variants}
    for variant in variants:
        options = session_options(variant.level, threads)
        options.enable_profiling = True
        options.profile_file_prefix = str(scratch / f"profile-{variant.name}")
        sessions[variant.name] = ort.InferenceSession(str(variant.path), options,
                                                      providers=["CPUExecutionProvider"])
    for shape_name, count in runs.items():
        log(f"profile: {shape_name}: {count} rounds of {len(variants)} variants")
        for r in range(count + 1):  # the first round warms up and is not counted
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for variant in order:
                sessions[variant.name].run(None, feeds[variant.name][shape_name])
                labels[variant.name].append(shape_name if r else None)
    result: dict[str, dict[str, dict[str, float]]] = {}
    for variant in variants:
        trace = Path(sessions[variant.name].end_profiling())
        events = json.loads(trace.read_text())
        trace.unlink()
        per_run: dict[str, list[dict[str, float]]] = {s: [] for s in runs}
        pending: dict[str, float] = collections.defaultdict(float)
        run_index = 0
        for event in events:
            if event.get("cat") == "Session" and event.get("name") == "model_run":
                label = labels[variant.name][run_index]
                if label is not None:
                    per_run[label].append(dict(pending))
                pending.clear()
                run_index += 1
            elif event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
                pending[event["args"]["op_name"]] += event["dur"]
        # Median over runs, per op type: a run preempted inside one kernel must not inflate it.
        result[variant.name] = {}
        for shape_name, run_ops in per_run.items():
            ops = {op for r in run_ops for op in r}
            medians = {op: float(np.median([r.get(op, 0.0) for r in run_ops])) for op in ops}
            result[variant.name][shape_name] = {
                op: round(us, 1) for op, us in sorted(medians.items(), key=lambda kv: -kv[1])}
    return result


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))


# --- the run --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = ModelSpec()
    timing = QUICK if args.quick else FULL
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    began = record.begin()

    parameters = ensure_checkpoint(work / "hf-llama-32m", spec)
    variants = build_variants(work / "hf-llama-32m", spec, work / "models", work / "genai-cache")
    scratch = Path(tempfile.mkdtemp(prefix="session-", dir=work))
    try:
        for variant in variants:
            if variant.error:
                continue
            log(f"session: {variant.name}")
            try:
                variant.nodes, variant.ops = op_histogram(variant.path)
                count_session_graph(variant, args.threads, scratch)
                variant.session = ort.InferenceSession(
                    str(variant.path), session_options(variant.level, args.threads),
                    providers=["CPUExecutionProvider"])
            except Exception as exc:  # a graph onnxruntime rejects is a result too
                if variant.name == "raw":
                    raise
                variant.error = f"{type(exc).__name__}: {str(exc).strip()}"[:2000]
                log(f"session: {variant.name} FAILED: {variant.error}")
        live = [v for v in variants if v.session is not None]

        inputs = {shape.name: make_inputs(spec, shape) for shape in SHAPES}
        feeds: dict[str, dict[str, dict[str, np.ndarray]]] = {}
        for variant in list(live):
            try:
                feeds[variant.name] = {s: feeds_for(variant.session, inputs[s]) for s in inputs}
            except RuntimeError as exc:
                variant.error = str(exc)
                live.remove(variant)

        log("agreement: logits vs raw on " + ", ".join(AGREEMENT_SHAPES))
        agreement: dict[str, dict[str, float]] = {}
        warnings: list[str] = []
        raw = live[0]
        for shape_name in AGREEMENT_SHAPES:
            reference = raw.session.run(["logits"], feeds["raw"][shape_name])[0]
            for variant in live:
                logits = variant.session.run(["logits"], feeds[variant.name][shape_name])[0]
                diff = max_abs(logits, reference)
                agreement.setdefault(variant.name, {})[shape_name] = diff
                if not diff <= AGREEMENT_TOLERANCE:
                    warnings.append(f"WARNING: {variant.name} logits differ from raw on {shape_name}: "
                                    f"max abs {diff:.3g} > {AGREEMENT_TOLERANCE:g}")
                    log(warnings[-1])

        latency: dict[str, dict[str, dict[str, Any]]] = {v.name: {} for v in live}
        samples: dict[str, dict[str, list[float]]] = {}
        shape_load: dict[str, list[float]] = {}
        for shape in SHAPES:
            shape_feeds = {v.name: feeds[v.name][shape.name] for v in live}
            load_before = os.getloadavg()[0]
            samples[shape.name] = time_shape(live, shape_feeds, timing, shape)
            shape_load[shape.name] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            for name, values in samples[shape.name].items():
                latency[name][shape.name] = stats(values)

        profiles: dict[str, dict[str, dict[str, float]]] = {}
        if args.profile:
            runs = {s.name: 1 if args.quick else 5 if s.name.startswith("prefill b8") else 15
                    for s in SHAPES}
            profiles = profile_ops(live, args.threads, feeds, runs, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def speedups(baseline: str) -> dict[str, dict[str, float]]:
        if baseline not in latency:
            return {}
        return {v: {s: round(latency[baseline][s]["median_ms"] / latency[v][s]["median_ms"], 3)
                    for s in latency[v]} for v in latency}

    def paired(other: str, mine: str) -> dict[str, float]:
        """Median over rounds of other/mine: each round ran both close together in time."""
        return {s: round(float(np.median(np.asarray(samples[s][other]) / np.asarray(samples[s][mine]))), 3)
                for s in samples}

    llmc_vs = {}
    if "llmc-O2" in latency:
        llmc_vs = {v: {s: round(latency[v][s]["median_ms"] / latency["llmc-O2"][s]["median_ms"], 3)
                       for s in latency[v]} for v in latency if v != "llmc-O2"}
    goals = []
    for baseline, target in GOALS.items():
        for shape in (s for s in SHAPES if s.name.startswith("decode")):
            value = llmc_vs.get(baseline, {}).get(shape.name)
            goals.append({"llmc_vs": baseline, "shape": shape.name, "target": target, "speedup": value,
                          "met": None if value is None else value >= target})

    return {
        "benchmark": "graph-optimization",
        "seconds": round(time.perf_counter() - _START, 1),
        "loadavg_1min_per_shape": shape_load,
        "record": record.finish(began),
        "model": {**dataclasses.asdict(spec), "parameters": parameters},
        "threads": args.threads, "intra_op_spinning": False, "quick": args.quick,
        "timing": dataclasses.asdict(timing),
        "shapes": [dataclasses.asdict(s) for s in SHAPES],
        "variants": [{"name": v.name, "description": v.description,
                      "session_optimization": v.level.name, "build_seconds": v.build_seconds,
                      "error": v.error, "passes": v.passes, "nodes": v.nodes, "session_nodes": v.session_nodes,
                      "ops": v.ops, "session_ops": v.session_ops} for v in variants],
        "latency": latency,
        "speedup_vs_raw": speedups("raw"),
        "speedup_vs_ort_transformers": speedups("ort-transformers"),
        "llmc_speedup": llmc_vs,
        "llmc_speedup_paired": {v: paired(v, "llmc-O2") for v in llmc_vs} if llmc_vs else {},
        "goals": goals,
        "agreement": {"tolerance": AGREEMENT_TOLERANCE, "max_abs_vs_raw": agreement, "warnings": warnings},
        "profile_us_per_run": profiles,
    }


# --- the report for people ------------------------------------------------------------------


def render(result: dict[str, Any]) -> str:
    model, record_ = result["model"], result["record"]
    lines = [
        f"Graph optimization benchmark — Llama-style, {model['parameters'] / 1e6:.1f}M params "
        f"({model['num_layers']} layers, hidden {model['hidden_size']}, {model['num_heads']} heads / "
        f"{model['num_kv_heads']} kv heads, vocab {model['vocab_size']}), fp32",
        f"onnxruntime {record_['versions'].get('onnxruntime')} CPU, {result['threads']} intra-op threads "
        f"(spinning off), "
        f"{record_['machine']['cores']} CPUs ({record_['machine']['cpu']}), load avg "
        f"{record_['machine']['loadavg_start'][0]} → {record_['machine']['loadavg_end'][0]}"
        + (" — QUICK run, numbers are a smoke test" if result["quick"] else ""),
        "",
    ]
    shapes = [s["name"] for s in result["shapes"]]
    latency = result["latency"]
    header = ["variant", "nodes", "session nodes"] + [f"{s} ms" for s in shapes]
    rows = []
    for v in result["variants"]:
        if v["error"]:
            rows.append([v["name"], "-", "-"] + ["failed"] * len(shapes))
            continue
        rows.append([v["name"], str(v["nodes"]), str(v["session_nodes"])]
                    + [f"{latency[v['name']][s]['median_ms']:.2f} (p90 {latency[v['name']][s]['p90_ms']:.2f})"
                       for s in shapes])
    lines += _table(header, rows)
    n = {s: latency["raw"][s]["n"] for s in shapes}
    lines.append("median (p90) latency per call; rounds: " + ", ".join(f"{s} {n[s]}" for s in shapes))
    lines.append("")
    for title, key in (("speedup vs raw (raw / variant)", "speedup_vs_raw"),
                       ("llmc-O2 speedup (variant / llmc-O2)", "llmc_speedup")):
        table = result[key]
        if not table:
            continue
        lines.append(title)
        lines += _table(["variant"] + shapes,
                        [[v] + [f"{table[v][s]:.2f}×" for s in shapes] for v in table])
        lines.append("")
    goal_text = []
    for g in result["goals"]:
        mark = "n/a" if g["met"] is None else ("met" if g["met"] else "MISSED")
        value = "-" if g["speedup"] is None else f"{g['speedup']:.2f}×"
        goal_text.append(f"llmc-O2 vs {g['llmc_vs']} on {g['shape']}: {value} (goal ≥ {g['target']}×) {mark}")
    lines += ["goals:"] + [f"  {t}" for t in goal_text] + [""]
    agreement = result["agreement"]
    lines.append(f"logits max abs vs raw (tolerance {agreement['tolerance']:g}): " + "; ".join(
        f"{v} " + ", ".join(f"{d:.2g}" for d in diffs.values())
        for v, diffs in agreement["max_abs_vs_raw"].items() if v != "raw")
        + f"  [{', '.join(AGREEMENT_SHAPES)}]")
    lines += agreement["warnings"]
    for v in result["variants"]:
        if v["error"]:
            lines.append(f"{v['name']} failed: {v['error']}")
    for v in result["variants"]:
        if v["passes"]:
            lines.append(f"{v['name']} passes: " + ", ".join(
                f"{e['pass']} {e['matches']} (→{e['nodes_after']})" for e in v["passes"]))
    lines.append("")
    lines.append("op histograms (graph given to the session → after the session optimizer):")
    for v in result["variants"]:
        if v["error"] or v["name"] in ("ort-session",):
            continue
        lines.append(f"  {v['name']}: " + _ops(v["ops"]))
        lines.append(f"  {' ' * len(v['name'])}  → " + _ops(v["session_ops"]))
    for variant, per_shape in result["profile_us_per_run"].items():
        lines.append(f"profile {variant} (median µs per run by op type, top 6; interleaved profiling runs):")
        for shape, ops in per_shape.items():
            total = sum(ops.values()) or 1.0
            top = ", ".join(f"{op} {us:.0f} ({us / total:.0%})" for op, us in list(ops.items())[:6])
            lines.append(f"  {shape}: {top}")
    return "\n".join(lines)


def _ops(ops: dict[str, int]) -> str:
    return " ".join(f"{op}:{count}" for op, count in ops.items())


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        cells = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        return "  ".join(cells)

    return [fmt(header), "  ".join("-" * w for w in widths), *[fmt(r) for r in rows]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke run, not a measurement")
    parser.add_argument("--profile", action="store_true",
                        help="also profile each variant and shape with onnxruntime's profiler (time by op type)")
    parser.add_argument("--save-json", metavar="PATH", help="also write the JSON object to PATH")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads (default 2)")
    parser.add_argument("--work-dir", default=str(DEFAULT_WORK_DIR),
                        help="where the checkpoint is cached and graphs are built (default bench/.work)")
    args = parser.parse_args(argv)
    ort.set_default_logger_severity(3)
    logging.getLogger("onnxruntime").setLevel(logging.WARNING)
    result = run(args)
    if args.save_json:
        record.write_json(args.save_json, result)
    print(json.dumps(result, indent=2) if args.json else render(result))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
