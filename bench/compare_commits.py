"""Same-run comparison of two llmc trees on serving_bench's llmc scenarios and latency_bench's decode rates.

Each tree (a directory holding an llmc checkout, or a commit that gets a temporary
`git worktree`) is imported through a directory of its own that holds one symlink,
`llmc -> <tree>`, put first on PYTHONPATH; the editable install's finder comes after
PathFinder on sys.meta_path, so that llmc wins, and every worker checks `llmc.__file__`
resolves inside its tree before it measures anything. Each worker imports its tree's own
bench/serving_bench.py and runs that file's functions, so each tree is driven through its own API:

  offline       run_llmc: N requests (default 64; prompts 16-512, outputs 16-128, all at t=0),
                the engine's default seats
  offline-32    the same with 32 seats
  interference  run_interference: 16 short requests alone and with one 3,000-token prompt
  decode-1      latency_bench's batch-1 decode: a 128-token prompt, 128 new tokens, after one
                unmeasured request; tokens after the first ÷ their time, median of 5 requests
  decode-16     latency_bench's static batch: 16 requests of 128 + 128 added at once; tokens made
                after every request has its first ÷ the time from then to the last, median of 5

The ONNX model is exported once, with tree B (`--b`); each tree compiles its
own engine from it (engine formats differ between trees). Prompt ids are drawn from 0-255, not
from the model's 8,192: the Engine refuses prompt ids outside the tokenizer's vocabulary (the
checkpoint's byte-level tokenizer has 258), and the model's cost does not depend on which ids it
reads. B is best a commit (the default, HEAD: a temporary worktree) rather than a live working
tree that others edit: a commit landing between B's compile and its runs can change the engine
format under it. Rounds run A, B, A, B, ..., each
worker in a fresh interpreter, so both trees see the same machine conditions; the table gives
the median over rounds of each figure and the ratio B/A.

    python bench/compare_commits.py --a 5d1f3e5 [--b HEAD] [--rounds 3] [--quick] [--json] [--threads 2]
        [--scenarios offline,offline-32,interference,decode-1,decode-16] [--save-json PATH]

Progress and the table go to stderr; --json prints one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
THIS_TREE = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
import record  # noqa: E402

# (scenario, metric, higher is better)
METRICS = [
    ("offline", "throughput_tok_s", True),
    ("offline", "ttft_ms_p50", False),
    ("offline", "ttft_ms_p99", False),
    ("offline", "tpot_ms_p50", False),
    ("offline-32", "throughput_tok_s", True),
    ("offline-32", "ttft_ms_p50", False),
    ("offline-32", "ttft_ms_p99", False),
    ("interference", "ttft_ms_p50_alone", False),
    ("interference", "ttft_ms_p99_alone", False),
    ("interference", "ttft_ms_p50_with_long", False),
    ("interference", "ttft_ms_p99_with_long", False),
    ("interference", "p99_ratio", False),
    ("decode-1", "tok_s", True),
    ("decode-16", "tok_s", True),
]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- the worker: runs inside a subprocess with one tree's llmc on the path --------------------


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    import llmc  # first: sets OMP_WAIT_POLICY before anything loads libgomp

    tree = Path(job["tree"]).resolve()
    where = Path(llmc.__file__).resolve()
    if tree not in where.parents:
        raise RuntimeError(f"imported llmc from {where}, not from {tree}")
    sys.path.insert(0, str(tree / "bench"))
    import contextlib

    if job["task"] == "export":
        from optimize_bench import ModelSpec, ensure_checkpoint

        spec = ModelSpec(**job["spec"])
        parameters = ensure_checkpoint(Path(job["checkpoint"]), spec)
        from llmc.compiler.export import export

        with contextlib.redirect_stdout(sys.stderr):
            export(job["checkpoint"], job["onnx"], check=False)
        return {"parameters": parameters, "llmc": str(where)}
    if job["task"] == "compile":
        from llmc.compiler.build import compile_model

        start = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            built = compile_model(job["onnx"], job["engine"])
        manifest = getattr(built, "manifest", built)  # the base commit 5d1f3e5 returns the manifest itself
        return {"paged": manifest["paged"], "build_s": round(time.perf_counter() - start, 1), "llmc": str(where)}
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    import dataclasses

    import serving_bench as sb
    from llmc.tokenizer import byte_level_tokenizer

    scale = sb.QUICK if job["quick"] else dataclasses.replace(sb.FULL, requests=job["requests"])
    tokenizer = byte_level_tokenizer()
    special = {tokenizer.bos_id, tokenizer.eos_id}
    # serving_bench draws prompt ids from the model's 8,192; the Engine refuses ids
    # outside the tokenizer's vocabulary (258, byte-level), so both trees get ids below its
    # special tokens (0-255). The model's cost does not depend on which ids it reads.
    sb.SPEC = dataclasses.replace(sb.SPEC, vocab_size=min(special))
    engine = Path(job["engine"])
    threads = job["threads"]
    out: dict[str, Any] = {"llmc": str(where), "loadavg_start": os.getloadavg()[0]}
    workload = sb.offline_workload(scale, job["seed"], special)
    if "offline" in job["scenarios"]:
        out["offline"] = sb.run_llmc(engine, workload, threads)
    if "offline-32" in job["scenarios"]:
        out["offline-32"] = sb.run_llmc(engine, workload, threads, seats=sb.WIDE)
    if "interference" in job["scenarios"]:
        shorts, mixed = sb.interference_workloads(scale, job["seed"], special)
        out["interference"] = sb.run_interference(engine, shorts, mixed, threads)
    for scenario, requests in (("decode-1", 1), ("decode-16", 16)):
        if scenario in job["scenarios"]:
            out[scenario] = {"tok_s": _static_batch_rate(engine, requests, threads, job["seed"])}
    out["loadavg_end"] = os.getloadavg()[0]
    return out


def _static_batch_rate(path: Path, requests: int, threads: int, seed: int, prompt: int = 128, new: int = 128,
                       batches: int = 5) -> float:
    """Decode tokens a second of `requests` requests added at once (after one unmeasured request):
    the tokens made after every request has its first, over the time from then to the last; the
    median over `batches` such batches (a batch-1 decode of 128 tokens lasts a fraction of a second)."""
    import numpy as np

    from llmc.runtime.engine import Engine
    from llmc.runtime.sampling_params import SamplingParams

    engine = Engine(path, threads=threads)
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    rates = []
    for batch in [1] + [requests] * batches:  # the warm-up request, then the measured batches
        pending = {engine.add_request(rng.integers(0, 256, prompt).tolist(), params) for _ in range(batch)}
        start = None
        tokens = 0
        while engine.has_unfinished():
            outputs = engine.step()
            if start is None:
                pending -= {o.request_id for o in outputs}
                start = time.perf_counter() if not pending else None
            else:
                tokens += sum(len(o.new_token_ids) for o in outputs)
        rates.append(tokens / (time.perf_counter() - start))
    return round(statistics.median(rates[1:]), 2)


def worker_main() -> int:
    job = json.loads(sys.stdin.read())
    print(json.dumps(_worker(job), default=str))
    return 0


# --- the driver --------------------------------------------------------------------------------


class Tree:
    """One llmc tree and the directory that makes `import llmc` find it."""

    def __init__(self, label: str, spec: str, scratch: Path):
        self.label, self.spec, self.worktree = label, spec, None
        path = Path(spec)
        if path.is_dir() and (path / "__init__.py").is_file():
            self.path = path.resolve()
        else:  # a commit: a detached worktree of this repository, removed at the end
            self.worktree = scratch / f"tree-{label}"
            subprocess.run(["git", "-C", str(THIS_TREE), "worktree", "add", "--detach", str(self.worktree), spec],
                           check=True, stdout=sys.stderr, stderr=sys.stderr)
            self.path = self.worktree
        self.commit = subprocess.run(["git", "-C", str(self.path), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(self.path), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        self.dirty = bool(dirty)
        self.pkg = scratch / f"pkg-{label}"
        self.pkg.mkdir(parents=True, exist_ok=True)
        (self.pkg / "llmc").symlink_to(self.path)

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.pkg)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"], env=env, text=True,
                              input=json.dumps({**job, "tree": str(self.path)}), stdout=subprocess.PIPE,
                              cwd=str(self.pkg))
        if done.returncode != 0:
            raise RuntimeError(f"{self.label} ({self.spec}) {job['task']} exited with {done.returncode}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        if self.worktree is not None:
            subprocess.run(["git", "-C", str(THIS_TREE), "worktree", "remove", "--force", str(self.worktree)],
                           stdout=sys.stderr, stderr=sys.stderr)


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for scenario, metric, higher in METRICS:
        if scenario not in runs["a"][0]:
            continue
        values = {side: [r[scenario][metric] for r in runs[side]] for side in ("a", "b")}
        medians = {side: statistics.median(v) for side, v in values.items()}
        ratio = medians["b"] / medians["a"] if medians["a"] else None
        rows.append({"scenario": scenario, "metric": metric, "higher_is_better": higher,
                     "a": values["a"], "b": values["b"], "a_median": medians["a"], "b_median": medians["b"],
                     "ratio_b_over_a": None if ratio is None else round(ratio, 3)})
    return rows


def render(result: dict[str, Any]) -> str:
    a, b = result["trees"]["a"], result["trees"]["b"]
    lines = [f"A = {a['spec']} ({a['commit']}{', dirty' if a['dirty'] else ''}), "
             f"B = {b['spec']} ({b['commit']}{', dirty' if b['dirty'] else ''}); "
             f"{result['rounds']} rounds A/B alternating, medians; {'QUICK sizes' if result['quick'] else 'full sizes'}",
             ""]
    rows = [["scenario", "metric", "A (each round)", "B (each round)", "A med", "B med", "B/A", ""]]
    for r in result["rows"]:
        ratio = r["ratio_b_over_a"]
        worse = ratio is not None and (ratio < 1 if r["higher_is_better"] else ratio > 1)
        rows.append([r["scenario"], r["metric"], " ".join(f"{v:g}" for v in r["a"]), " ".join(f"{v:g}" for v in r["b"]),
                     f"{r['a_median']:g}", f"{r['b_median']:g}", "-" if ratio is None else f"{ratio:.3f}",
                     "(worse)" if worse else ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="the baseline: an llmc tree or a commit of this repository")
    parser.add_argument("--b", default="HEAD", help="the candidate: an llmc tree or a commit (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds (default 3)")
    parser.add_argument("--quick", action="store_true", help="serving_bench's --quick sizes (a smoke run)")
    parser.add_argument("--requests", type=int, default=64, help="offline requests (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", default=str(BENCH_DIR / ".work"), help="checkpoint cache (default bench/.work)")
    parser.add_argument("--scenarios", default="offline,offline-32,interference,decode-1,decode-16",
                        help="comma-separated subset of offline, offline-32, interference (default all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object to stdout")
    parser.add_argument("--save-json", metavar="PATH")
    args = parser.parse_args(argv)
    began = record.begin([sys.argv[0], *argv])

    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="llmc-compare-", dir=work))
    trees: dict[str, Tree] = {}
    try:
        trees["a"] = Tree("a", args.a, scratch)
        trees["b"] = Tree("b", args.b, scratch)
        for side, tree in trees.items():
            log(f"{side}: {tree.spec} -> {tree.path} ({tree.commit}{', dirty' if tree.dirty else ''})")
        onnx = scratch / "model.onnx"
        log("export (tree B)")
        exported = trees["b"].run({"task": "export", "spec": {"max_positions": 4096},
                                   "checkpoint": str(work / "hf-llama-32m-4k"), "onnx": str(onnx)})
        builds = {}
        for side, tree in trees.items():
            log(f"compile ({side})")
            builds[side] = tree.run({"task": "compile", "onnx": str(onnx), "engine": str(scratch / f"engine-{side}.plan")})
            log(f"  {builds[side]}")
        runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        job = {"task": "run", "quick": args.quick, "requests": args.requests, "seed": args.seed,
               "threads": args.threads, "scenarios": args.scenarios.split(",")}
        for round_ in range(args.rounds):
            for side in ("a", "b"):
                log(f"round {round_ + 1}/{args.rounds}: {side}")
                out = trees[side].run({**job, "engine": str(scratch / f"engine-{side}.plan")})
                runs[side].append(out)
                if "offline" in out:
                    log(f"  offline {out['offline']['throughput_tok_s']} tok/s, TTFT p50/p99 "
                        f"{out['offline']['ttft_ms_p50']}/{out['offline']['ttft_ms_p99']} ms")
                if "interference" in out:
                    log(f"  interference p99 {out['interference']['ttft_ms_p99_alone']} -> "
                        f"{out['interference']['ttft_ms_p99_with_long']} ms")
        result = {
            "benchmark": "compare_commits",
            "quick": args.quick, "rounds": args.rounds, "scenarios": job["scenarios"], "threads": args.threads, "seed": args.seed,
            "trees": {side: {"spec": t.spec, "path": str(t.path), "commit": t.commit, "dirty": t.dirty}
                      for side, t in trees.items()},
            "model_parameters": exported["parameters"], "builds": builds,
            "rows": summarize(runs), "runs": runs,
            "record": record.finish(began),
        }
    finally:
        for tree in trees.values():
            tree.close()
        shutil.rmtree(scratch, ignore_errors=True)  # the engines and the ONNX: ~370 MB a run
    print(render(result), file=sys.stderr)
    text = json.dumps(result, indent=2, default=str)
    if args.save_json:
        record.write_json(args.save_json, result)
    if args.json:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
