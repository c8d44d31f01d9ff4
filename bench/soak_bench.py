"""Soak benchmark: many short requests through one Engine, watching resident memory.

tiny-llama (random weights) is exported and compiled with the default paged options, then N
requests (default 10,000; prompts of 8-32 random token ids, 4-8 output tokens, EOS ignored,
seeded) run through ONE `Engine`, fed in waves so that 32 are in flight. Resident memory (VmRSS)
is sampled every 500 finished requests. After a warm-up of 1,000 requests the engine's pools,
sessions and caches have their steady size: RSS should stay flat from there, and any growth is a
leak per request (an entry left in a dict, a cache without a bound).

    python bench/soak_bench.py [--requests 10000] [--in-flight 32] [--threads 2] [--json] [--save-json PATH]
                               [--tracemalloc] [--work-dir DIR]

The table goes to stderr; with --json, stdout gets one JSON object. --tracemalloc also prints the
Python allocations that grew most between the warm-up and the end (slow: for hunting a leak).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

from llmc.compiler.build import compile_model
from llmc.compiler.export import export
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams

SAMPLE_EVERY = 500
WARM_UP = 1_000


def rss_mib() -> float:
    """This process's resident memory (VmRSS) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_engine(work_dir: Path) -> Path:
    onnx, plan = work_dir / "tiny-llama.onnx", work_dir / "tiny-llama.plan"
    if not plan.exists():
        export("tiny-llama", onnx)
        compile_model(onnx, plan)
    return plan


def soak(plan: Path, requests: int, in_flight: int, threads: int | None, trace: bool, seed: int = 0) -> dict:
    """Run the requests through one Engine; returns RSS samples and figures."""
    engine = Engine(plan, threads=threads)
    rng = random.Random(seed)
    vocab = engine.tokenizer.vocab_size
    samples: list[tuple[int, float]] = [(0, rss_mib())]
    added = finished = tokens = 0
    snapshot = None
    start = time.perf_counter()
    warm_time = None
    while finished < requests:
        while added < requests and added - finished < in_flight:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(8, 32))]
            engine.add_request(prompt, SamplingParams(max_new_tokens=rng.randint(4, 8), ignore_eos=True))
            added += 1
        for output in engine.step():
            if output.error is not None:
                raise output.error
            tokens += len(output.new_token_ids)
            if not output.finished:
                continue
            finished += 1
            if finished % SAMPLE_EVERY == 0:
                samples.append((finished, rss_mib()))
                log(f"  {finished:>6} requests  RSS {samples[-1][1]:8.1f} MiB  "
                    f"{finished / (time.perf_counter() - start):6.1f} req/s")
            if finished == WARM_UP:
                warm_time = time.perf_counter()
                if trace:
                    tracemalloc.start(8)
                    snapshot = tracemalloc.take_snapshot()
    elapsed = time.perf_counter() - start
    growth = None
    if trace and snapshot is not None:
        stats = tracemalloc.take_snapshot().compare_to(snapshot, "traceback")
        growth = [{"size_diff_kib": round(s.size_diff / 1024, 1), "count_diff": s.count_diff,
                   "where": [f"{f.filename}:{f.lineno}" for f in s.traceback][-4:]} for s in stats[:10]]
        tracemalloc.stop()
    after = [rss for done, rss in samples if done >= WARM_UP] or [samples[-1][1]]
    warm, end = after[0], after[-1]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.has_unfinished()
    return {
        "requests": requests, "in_flight": in_flight, "threads": threads, "tokens": tokens,
        "seconds": round(elapsed, 1), "requests_per_s": round(requests / elapsed, 1),
        "after_warm_up_s": round(time.perf_counter() - warm_time, 1) if warm_time else None,
        "rss_start_mib": round(samples[0][1], 1), "rss_warm_up_mib": round(warm, 1),
        "rss_end_mib": round(end, 1), "rss_max_mib": round(max(after), 1),
        "growth_pct": round(100 * (end - warm) / warm, 2),
        "samples": [[done, round(rss, 1)] for done, rss in samples],
        "preemptions": engine.scheduler.preemptions, "tracemalloc_top": growth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="backend threads (default: every core)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--save-json", metavar="PATH", help="also write the JSON object to PATH")
    parser.add_argument("--tracemalloc", action="store_true", help="top Python allocation growth after warm-up")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the exported model here")
    args = parser.parse_args()
    if args.requests <= WARM_UP:
        parser.error(f"--requests must exceed the warm-up of {WARM_UP}")
    began = record.begin()

    with tempfile.TemporaryDirectory() as scratch:
        work_dir = args.work_dir or Path(scratch)
        work_dir.mkdir(parents=True, exist_ok=True)
        log("exporting and compiling tiny-llama ...")
        plan = build_engine(work_dir)
        log(f"soak: {args.requests} requests, {args.in_flight} in flight")
        result = soak(plan, args.requests, args.in_flight, args.threads, args.tracemalloc)
    result = {"benchmark": "soak", **result, "record": record.finish(began)}
    if args.save_json:
        record.write_json(args.save_json, result)

    log(f"\n{'requests':>9} {'RSS MiB':>9}")
    for done, rss in result["samples"]:
        log(f"{done:>9} {rss:>9.1f}" + ("  (warm-up)" if done == WARM_UP else ""))
    log(f"\n{result['requests']} requests in {result['seconds']} s ({result['requests_per_s']} req/s), "
        f"{result['tokens']} tokens, {result['preemptions']} preemptions")
    log(f"RSS: start {result['rss_start_mib']} MiB, after warm-up {result['rss_warm_up_mib']} MiB, "
        f"end {result['rss_end_mib']} MiB, max {result['rss_max_mib']} MiB, growth {result['growth_pct']:+.2f}%")
    for entry in result["tracemalloc_top"] or []:
        log(f"  {entry['size_diff_kib']:+9.1f} KiB {entry['count_diff']:+7d}  {' <- '.join(reversed(entry['where']))}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
