"""The TensorRT path end to end, on a machine with an NVIDIA GPU and TensorRT 11 (run by
scripts/gpu_check.sh after the Triton kernel check).

Checks, one line each (PASS / FAIL / SKIP with the reason), then a summary; exit 1 on any FAIL:

1. tiny-llama (random weights): `llmc compile --backend tensorrt` builds, and its greedy tokens
   equal the onnxruntime engine's for the same prompts;
2. the trained model (data/pystdlib-llama): the same at fp32, then `llmc check` (the accuracy
   gate against the ONNX export, on data/pystdlib-text/heldout) passes for a --fp16 and an
   --int8-calib engine;
3. `llmc bench` on the trained model's TensorRT engine: throughput and TTFT/TPOT p50/p99, and
   single-request latency (--batch 1);
4. TensorRT's layer profiler on tiny-llama's engine, as `llmc profile` reads it: an `Engine` made
   with a `Timeline` records layer times inside every engine call, adding up to no more than
   the calls' time.

Every command is the CLI a user runs; work files go to a temporary folder (or --work-dir).
Without TensorRT (the machines this project is lent have a GPU, torch and Triton but no TensorRT)
the checks are one SKIP line and exit 0: scripts/gpu_check.py has checked what runs without it.
--require-tensorrt makes a missing TensorRT a failure; --skip skips on purpose.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("def fibonacci(", "import os\n", "class Stack:")
NEW_TOKENS = 24
MAX_PPL_INCREASE = 3.0


class Checks:
    def __init__(self):
        self.results: list[tuple[str, str, str]] = []

    def record(self, status: str, name: str, detail: str) -> None:
        self.results.append((status, name, detail))
        print(f"{status:<4} {name}: {detail}", flush=True)


def llmc(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmc.cli", *args], capture_output=True, text=True, timeout=timeout)


def greedy_tokens(engine: Path) -> list[list[int]]:
    args = ["run", str(engine), "--max-new-tokens", str(NEW_TOKENS), "--json"]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    done = llmc(*args)
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    return [json.loads(line)["token_ids"] for line in done.stdout.splitlines() if line.startswith("{")]


def same_tokens(checks: Checks, name: str, onnx: Path, work: Path, *compile_options: str) -> Path | None:
    """Compile `onnx` for both backends; PASS when TensorRT's greedy tokens equal onnxruntime's."""
    cpu, gpu = work / f"{name}-onnxruntime.plan", work / f"{name}-tensorrt.plan"
    for engine, backend in ((cpu, "onnxruntime"), (gpu, "tensorrt")):
        start = time.perf_counter()
        done = llmc("compile", str(onnx), "-o", str(engine), "--backend", backend, *compile_options, timeout=900)
        if done.returncode:
            checks.record("FAIL", f"{name}: compile --backend {backend}", done.stderr.strip().splitlines()[-1])
            return None
        if backend == "tensorrt":
            checks.record("PASS", f"{name}: compile --backend tensorrt", f"{time.perf_counter() - start:.0f} s, "
                          f"{engine.stat().st_size / 2**20:.1f} MiB")
    try:
        expected, got = greedy_tokens(cpu), greedy_tokens(gpu)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        checks.record("FAIL", f"{name}: llmc run on the TensorRT engine", str(exc))
        return None
    agree = sum(e == g for e, g in zip(expected, got))
    status = "PASS" if expected == got else "FAIL"
    checks.record(status, f"{name}: greedy tokens, TensorRT vs onnxruntime", f"{agree}/{len(PROMPTS)} prompts identical "
                  f"over {NEW_TOKENS} tokens")
    return gpu


def gate(checks: Checks, onnx: Path, work: Path, precision: list[str], label: str) -> None:
    engine = work / f"trained-{label}-tensorrt.plan"
    done = llmc("compile", str(onnx), "-o", str(engine), "--backend", "tensorrt", *precision, timeout=900)
    if done.returncode:
        checks.record("FAIL", f"trained {label}: compile --backend tensorrt", done.stderr.strip().splitlines()[-1])
        return
    accuracy(checks, engine, onnx, f"trained {label}")


def accuracy(checks: Checks, engine: Path, onnx: Path, name: str) -> None:
    """`llmc check` against the ONNX export on the held-out text, as a CI job gates an engine."""
    done = llmc("check", str(engine), "--reference", str(onnx), "--data", str(ROOT / "data/pystdlib-text/heldout"),
                "--max-ppl-increase", str(MAX_PPL_INCREASE), "--json")
    try:
        report = json.loads(done.stdout)
        detail = (f"perplexity {report['ppl_increase_pct']:+.2f}% against the fp32 export (limit {MAX_PPL_INCREASE}%), "
                  f"top-1 agreement {report['top1_agreement']:.3f}")
    except json.JSONDecodeError:
        detail = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
    checks.record("PASS" if done.returncode == 0 else "FAIL", f"{name}: llmc check", detail)


def bench(checks: Checks, engine: Path, requests: int = 64) -> None:
    for label, options in ((f"offline {requests} requests", ["--requests", str(requests)]),
                           ("single request", ["--batch", "1", "--requests", str(min(8, requests))])):
        done = llmc("bench", str(engine), "--json", *options)
        if done.returncode:
            checks.record("FAIL", f"llmc bench, {label}", done.stderr.strip().splitlines()[-1])
            continue
        r = json.loads(done.stdout)
        pick = {k: r[k] for k in r if any(s in k for s in ("tok_s", "p50", "p99"))}
        checks.record("PASS", f"llmc bench, {label}", ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                                 for k, v in pick.items()))


def layer_profile(checks: Checks, engine: Path) -> None:
    """Generate on `engine` with a timeline; PASS when `layer_profile_problem` finds none."""
    from llmc.runtime.engine import Engine
    from llmc.runtime.sampling_params import SamplingParams
    from llmc.runtime.timeline import Timeline

    timeline = Timeline()
    try:
        llm = Engine(engine, timeline=timeline)
        for prompt in PROMPTS:
            llm.add_request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS))
        while llm.has_unfinished():
            failed = next((output.error for output in llm.step() if output.error is not None), None)
            if failed is not None:
                raise failed
    except Exception as exc:  # any failure is this check's FAIL line
        checks.record("FAIL", "layer profile", f"{type(exc).__name__}: {exc}")
        return
    problem, detail = layer_profile_problem(timeline.spans)
    checks.record("FAIL" if problem else "PASS", "layer profile", problem or detail)


def layer_profile_problem(spans) -> tuple[str | None, str]:
    """(what is wrong, or None; a summary) of the TensorRT spans of a timeline: layer spans exist,
    each inside an engine call, and their total is at most the calls' total."""
    from llmc.runtime.timeline import TENSORRT

    calls = [s for s in spans if s.track == TENSORRT and s.name == "engine call"]
    layers = [s for s in spans if s.track == TENSORRT and s.args.get("kind") == "layer"]
    outside = [s for s in layers if not any(c.start_ns <= s.start_ns and s.end_ns <= c.end_ns for c in calls)]
    layer_ms, call_ms = sum(s.duration_ns for s in layers) / 1e6, sum(s.duration_ns for s in calls) / 1e6
    totals: dict[str, float] = {}
    for span in layers:
        totals[span.name] = totals.get(span.name, 0.0) + span.duration_ns / 1e6
    slowest = ", ".join(f"{name} {ms:.2f} ms" for name, ms in sorted(totals.items(), key=lambda x: -x[1])[:3])
    detail = (f"{len(layers)} layer times ({len(totals)} layers) in {len(calls)} engine calls: {layer_ms:.1f} ms of "
              f"{call_ms:.1f} ms; slowest {slowest}")
    if not calls:
        return "no engine call recorded", detail
    if not layers:
        return "TensorRT's profiler reported no layer", detail
    if outside:
        return f"{len(outside)} layer spans lie outside their engine call ({outside[0].name})", detail
    if layer_ms > call_ms:
        return f"the layers take {layer_ms:.2f} ms, more than the engine calls' {call_ms:.2f} ms", detail
    return None, detail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", help="keep the engines here (default: a temporary folder)")
    parser.add_argument("--require-tensorrt", action="store_true", help="a missing TensorRT fails the run")
    parser.add_argument("--skip", action="store_true", help="skip the TensorRT checks (gpu_check.sh --no-tensorrt)")
    args = parser.parse_args(argv)
    checks = Checks()
    if args.skip:
        checks.record("SKIP", "tensorrt", "--no-tensorrt")
        return summary(checks)
    try:
        import tensorrt

        checks.record("PASS", "tensorrt importable", f"TensorRT {tensorrt.__version__}")
    except (ImportError, OSError) as exc:  # OSError: the package without its libraries
        checks.record("FAIL" if args.require_tensorrt else "SKIP", "tensorrt",
                      f"not installed, nothing built ({exc}; pip install 'llmc[tensorrt]')")
        return summary(checks)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="llmc-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for name, source in (("tiny-llama", "tiny-llama"), ("trained", str(ROOT / "data/pystdlib-llama"))):
            onnx = work / f"{name}.onnx"
            done = llmc("export", source, "-o", str(onnx), timeout=900)
            if done.returncode:
                checks.record("FAIL", f"{name}: export", done.stderr.strip().splitlines()[-1])
                continue
            engine = same_tokens(checks, name, onnx, work)
            if name == "tiny-llama" and engine is not None:
                layer_profile(checks, engine)
            if name == "trained":
                gate(checks, onnx, work, ["--fp16"], "fp16")
                gate(checks, onnx, work, ["--int8-calib", str(ROOT / "data/pystdlib-text/calib")], "int8")
                if engine is not None:
                    bench(checks, engine)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    return summary(checks)


def summary(checks: Checks) -> int:
    counts = {s: sum(r[0] == s for r in checks.results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"tensorrt checks: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
