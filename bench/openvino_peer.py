"""OpenVINO GenAI as a benchmark peer: its venv, its exported models and a worker that measures them.

optimum-intel 2.2 (the exporter) pins transformers < 5.6 and the project runs transformers 5.x, so
the peer lives in a venv of its own, built by tests/optimum_venv.py's `helper_python` over the
running environment (its torch CPU build is reused, not downloaded again) and cached under
``$LLMC_TEST_CACHE`` (default ``~/.cache/llmc-bench``). pip pulls torchvision in for optimum-intel;
PyPI's wheel is a CUDA build that does not load beside the CPU torch and a text export never
imports it, so it is removed.

`export(checkpoint, weights)` runs ``optimum-cli export openvino --task text-generation-with-past``
on a Hugging Face folder in the venv: ``fp32`` (weights as they are) or ``int4`` (asymmetric,
group 32; optimum-intel keeps the tied embedding / lm_head in int8 per channel), cached by a hash
of the folder's files.

`run_worker(job)` measures one exported model in a fresh process of the venv
(``python bench/openvino_peer.py worker < JOB.json`` prints one JSON line); `start_worker(job)`
loads it there and leaves each measurement for the caller to step, in turn with another system's
(bench/stepped.py; ``openvino_peer.py serve``). On the CPU at
``job["threads"]`` threads (the CPU plugin's INFERENCE_NUM_THREADS), with OpenVINO's default
compute precision (bf16 on CPUs with avx512_bf16 or AMX) or ``job["hint"]`` as its
INFERENCE_PRECISION_HINT ("f32" to compare like for like), and ``job["properties"]``' other CPU
properties where a probe sets them (KV_CACHE_PRECISION, ...). Prompts are token ids (the caller
tokenizes), greedy, EOS ignored (min_new_tokens = max_new_tokens). What a job may ask, each optional;
decode, long, ttft and batch give their prompts for each take of the step (bench/stepped.py), a list:

  decode     a prompt through `LLMPipeline.generate` (OpenVINO's own scheduler behind it: paged
             attention, whole prompt in one step, prefix caching) after a 4-token warm-up on
             ``warmup``; a streamer's calls time the tokens: ``ttft_ms`` from the call to the
             first token, ``decode_tok_s`` = the tokens after the first ÷ their time
  long       prompts run one at a time for one token each: ``ttft_long_cold_ms`` (the first
             take's first) and ``ttft_long_ms`` (a take's last)
  ttft       a take's prompts run one at a time for one token each, through the same pipeline:
             ``ttft_ms`` becomes the median of their first tokens' times
  batch      a take's prompts added together to a `ContinuousBatchingPipeline` (SchedulerConfig's
             defaults, or ``job["scheduler"]``'s fields), stepped to the end:
             ``batch_decode_tok_s`` = tokens made after every request has its first ÷ the time
             from then to the last (latency_bench's rule), ``batch_ttft_ms`` the first request's
  workload   requests ``{"prompt", "output_len", "arrival_s"}`` (runtime/bench.py's BenchRequest
             fields) through the same continuous batching, each added once its arrival time
             has passed: per request its first-token and finish times (s from the start),
             ``wall_s`` and ``throughput_tok_s`` (requested tokens ÷ wall time)

Every figure comes with ``cpu_per_wall`` (process CPU time ÷ wall time over the measurements: the
cores it really used) and the packages' versions.

    python bench/openvino_peer.py run [--checkpoint DIR] [--threads 2] [--quick] [--json]

measures SmolLM2-135M-Instruct (tests/smollm2.py), or another local folder, at fp32 with the
default precision, at fp32 with f32 compute and at int4 with the default, each in its own worker:
batch-1 decode and TTFT at 128 tokens, TTFT at 2,048, a static batch of 16 (64 new tokens) and an
offline mixed workload (serving_bench's: 64 requests, prompts 16-512, outputs 16-128, all at
t=0); prompts are real text, Python's source cut from data/pystdlib-text/heldout.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
CACHE = Path(os.environ.get("LLMC_TEST_CACHE", Path.home() / ".cache" / "llmc-bench"))
REQUIREMENTS = ("optimum-intel[openvino]==2.2.0", "openvino-genai==2026.4.1.0")
EXPORT_ARGS = {"fp32": ["--weight-format", "fp32"],
               # optimum-cli's int4 is asymmetric unless --sym is given
               "int4": ["--weight-format", "int4", "--group-size", "32"]}
WARMUP_TOKENS = 4


# --- the venv and the exports (the running environment) ---------------------------------------


def peer_python() -> Path:
    """The python of the OpenVINO GenAI venv, built on first use (raises ExporterUnavailable)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from optimum_venv import helper_python

    # The running torch, so that pip keeps it and picks the torchvision made for it.
    torch = f"torch=={importlib.metadata.version('torch').split('+')[0]}"
    return helper_python("openvino", [*REQUIREMENTS, torch], CACHE, unwanted=("torchvision",))


def checkpoint_hash(checkpoint: Path) -> str:
    """A hash of every file in the folder (names and contents, links followed)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in checkpoint.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()[:16]


def export(checkpoint: Path, weights: str, python: Path | None = None) -> Path:
    """The OpenVINO IR folder of a Hugging Face checkpoint folder, exported on first use.

    Args:
        checkpoint: config.json + safetensors + tokenizer files.
        weights: "fp32" or "int4" (asymmetric, group 32).
        python: the venv's python (default: `peer_python()`).
    """
    if weights not in EXPORT_ARGS:
        raise ValueError(f"weights: {weights!r} is not one of {', '.join(EXPORT_ARGS)}")
    if not (checkpoint / "config.json").is_file():
        raise ValueError(f"{checkpoint}: no config.json, not a Hugging Face checkpoint folder")
    python = python or peer_python()
    key = f"{checkpoint_hash(checkpoint)}-{weights}-{hashlib.sha256(' '.join(REQUIREMENTS).encode()).hexdigest()[:6]}"
    folder = CACHE / "openvino-models" / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "openvino_model.xml").is_file():
            return folder
        partial = folder.with_name(key + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        done = subprocess.run([str(python.parent / "optimum-cli"), "export", "openvino", "--model", str(checkpoint),
                               "--task", "text-generation-with-past", *EXPORT_ARGS[weights], str(partial)],
                              capture_output=True, text=True)
        if done.returncode:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"optimum-cli export openvino ({weights}) of {checkpoint} failed: {tail}")
        partial.rename(folder)
    return folder


def run_worker(job: dict[str, Any], python: Path | None = None) -> dict[str, Any]:
    """`worker(job)` in a fresh process of the venv; its result. The job goes on stdin (prompts
    can pass the argument length limit)."""
    done = subprocess.run([str(python or peer_python()), str(Path(__file__).resolve()), "worker"],
                          input=json.dumps(job), text=True, stdout=subprocess.PIPE)
    if done.returncode:
        raise RuntimeError(f"openvino worker exited with {done.returncode} (its error is above)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def source_prompts(checkpoint: Path, lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of exactly `lengths` tokens: Python's source from a random line of the held-out
    text, tokenized with the checkpoint's tokenizer (no chat template, no BOS)."""
    import numpy as np

    from llmc.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(checkpoint)
    lines = (ROOT / "data" / "pystdlib-text" / "heldout" / "heldout.txt").read_text().splitlines(keepends=True)
    rng = np.random.default_rng(seed)
    prompts = []
    for length in lengths:
        at = int(rng.integers(0, len(lines)))
        # source code runs ~3 characters a token: 8 a token is ample; past the end, wrap around
        text = ""
        for line in (lines[at:] + lines[:at]):
            if len(text) >= 8 * length:
                break
            text += line
        ids = tokenizer.encode(text)
        if len(ids) < length:
            raise ValueError(f"heldout.txt: {len(ids)} tokens from line {at}, {length} asked")
        prompts.append(ids[:length])
    return prompts


# --- the worker (the venv: numpy, openvino and openvino_genai) --------------------------------


def _greedy(og, new_tokens: int):
    config = og.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = new_tokens
    config.do_sample = False
    return config


def _stream(og, ov, np, pipe, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
    """The call's start and each token's time, from a streamer (LLMPipeline streams batch 1 only)."""

    class Times(og.StreamerBase):
        def __init__(self):
            super().__init__()
            self.times: list[float] = []

        def write(self, token):
            now = time.perf_counter()
            self.times += [now] * (len(token) if isinstance(token, list) else 1)
            return og.StreamingStatus.RUNNING

        def end(self):
            pass

    streamer = Times()
    start = time.perf_counter()
    pipe.generate(ov.Tensor(np.array([prompt], dtype=np.int64)), _greedy(og, new_tokens), streamer)
    if len(streamer.times) != new_tokens:
        raise RuntimeError(f"openvino streamed {len(streamer.times)} tokens, asked for {new_tokens}")
    return start, streamer.times


def _drive(og, ov, np, pipe, requests: list[dict[str, Any]]) -> tuple[float, list[list[float]]]:
    """Requests through a ContinuousBatchingPipeline, each added once its arrival time has
    passed; the start and each request's token times (a token's time: the end of its step)."""
    pending = sorted(range(len(requests)), key=lambda i: requests[i].get("arrival_s", 0.0))
    handles, times = {}, [[] for _ in requests]

    def collect(now: float) -> None:
        for i, handle in handles.items():
            if handle.can_read():
                for output in handle.read().values():
                    times[i] += [now] * len(output.generated_ids)

    start = time.perf_counter()
    while pending or pipe.has_non_finished_requests():
        while pending and requests[pending[0]].get("arrival_s", 0.0) <= time.perf_counter() - start:
            i = pending.pop(0)
            handles[i] = pipe.add_request(i, ov.Tensor(np.array([requests[i]["prompt"]], dtype=np.int64)),
                                          _greedy(og, requests[i]["output_len"]))
        if pipe.has_non_finished_requests():
            pipe.step()
            collect(time.perf_counter())
        elif pending:
            time.sleep(max(0.0, start + requests[pending[0]].get("arrival_s", 0.0) - time.perf_counter()))
    collect(time.perf_counter())
    made = [len(t) for t in times]
    if made != [r["output_len"] for r in requests]:
        raise RuntimeError(f"openvino made {made} tokens, asked for {[r['output_len'] for r in requests]}")
    return start, times


def start(job: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One exported model loaded (see the module docstring for `job`): its load figures, and its
    measurements as stepped.STEPS (the batch's continuous batching replaces the single-request
    pipeline, so it comes after every step that needs that one)."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og
    import stepped

    properties = {"INFERENCE_NUM_THREADS": job["threads"]}
    if job.get("hint"):
        properties["INFERENCE_PRECISION_HINT"] = job["hint"]
    properties.update(job.get("properties", {}))  # a probe's other settings (KV_CACHE_PRECISION, ...)
    ready: dict[str, Any] = {"versions": {name: importlib.metadata.version(name)
                                          for name in ("openvino", "openvino-genai")}}
    cpu0, wall0 = sum(os.times()[:2]), time.perf_counter()
    pipe = og.LLMPipeline(job["model"], "CPU", **properties)
    ready["load_s"] = round(time.perf_counter() - wall0, 3)
    ready["huge_pages_after_load_mib"] = stepped.huge_pages_mib()

    batching = None  # the continuous batching pipeline, once the batch step has made it

    def warmup(take: int) -> dict[str, Any]:
        if job.get("warmup"):
            _stream(og, ov, np, pipe, job["warmup"], WARMUP_TOKENS)
        return {}

    def decode(take: int) -> dict[str, Any]:
        if not job.get("decode"):
            return {}
        start, times = _stream(og, ov, np, pipe, job["decode"][take], job["new_tokens"])
        return {"ttft_ms": round((times[0] - start) * 1e3, 2),
                "decode_tok_s": round((len(times) - 1) / (times[-1] - times[0]), 2)}

    def long(take: int) -> dict[str, Any]:
        out = {}
        for n, prompt in enumerate(job["long"][take] if job.get("long") else []):
            start, times = _stream(og, ov, np, pipe, prompt, 1)
            out["ttft_long_cold_ms" if take == 0 and n == 0 else "ttft_long_ms"] = round((times[0] - start) * 1e3, 2)
        return out

    def ttft(take: int) -> dict[str, Any]:
        firsts = [_stream(og, ov, np, pipe, prompt, 1) for prompt in job["ttft"][take]] if job.get("ttft") else []
        return {"ttft_ms": round(float(np.median([(times[0] - start) * 1e3 for start, times in firsts])), 2)} \
            if firsts else {}

    def batch(take: int) -> dict[str, Any]:
        nonlocal pipe, batching
        if not (job.get("batch") or job.get("workload")):
            return {}
        out: dict[str, Any] = {}
        if batching is None:
            pipe = None  # its memory back before the continuous batching's model loads
            scheduler = og.SchedulerConfig()
            for field, value in job.get("scheduler", {}).items():
                setattr(scheduler, field, value)
            out["scheduler"] = {field: getattr(scheduler, field) for field in ("max_num_batched_tokens", "max_num_seqs",
                                                                               "dynamic_split_fuse", "enable_prefix_caching")}
            batching = og.ContinuousBatchingPipeline(job["model"], scheduler, "CPU", properties)
            if job.get("warmup"):
                _drive(og, ov, np, batching, [{"prompt": job["warmup"], "output_len": WARMUP_TOKENS}])
        if job.get("batch"):
            start, times = _drive(og, ov, np, batching,
                                  [{"prompt": p, "output_len": job["new_tokens"]} for p in job["batch"][take]])
            first, last = max(t[0] for t in times), max(t[-1] for t in times)
            after = sum(1 for t in times for x in t if x > first)
            out["batch_ttft_ms"] = round((times[0][0] - start) * 1e3, 2)
            out["batch_decode_tok_s"] = round(after / (last - first), 2) if last > first else None
        if job.get("workload"):
            start, times = _drive(og, ov, np, batching, job["workload"])
            wall = max(t[-1] for t in times) - start
            out["workload"] = {"first_token_s": [round(t[0] - start, 4) for t in times],
                               "finish_s": [round(t[-1] - start, 4) for t in times], "wall_s": round(wall, 3),
                               "throughput_tok_s": round(sum(len(t) for t in times) / wall, 2)}
        return out

    def done(take: int) -> dict[str, Any]:
        return {"cpu_per_wall": round((sum(os.times()[:2]) - cpu0) / (time.perf_counter() - wall0), 2)}

    return ready, {"warmup": warmup, "decode": decode, "long": long, "ttft": ttft, "batch": batch, "done": done}


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """`start(job)`'s every step in turn: one measurement run, its figures together."""
    import stepped

    ready, steps = start(job)
    for step in stepped.STEPS:
        ready.update(steps[step](0) if step in steps else {})
    return ready


def start_worker(job: dict[str, Any], python: Path | None = None):
    """`start(job)` in a fresh process of the venv, loaded, for the caller to step (bench/stepped.py)."""
    import stepped

    return stepped.Worker([str(python or peer_python()), str(Path(__file__).resolve()), "serve"],
                          {"system": "openvino", **job})


# --- one run of the three settings (the running environment) ----------------------------------


SETTINGS = (("fp32", None), ("fp32", "f32"), ("int4", None))  # (weights, INFERENCE_PRECISION_HINT)


def jobs(checkpoint: Path, quick: bool, threads: int) -> dict[str, Any]:
    """The measurements' prompts and sizes (fresh text for every prompt; none shares a prefix)."""
    from llmc.runtime.bench import WorkloadSpec, make_workload

    prompt, long_prompt, batch, new_tokens = (32, 256, 4, 16) if quick else (128, 2048, 16, 64)
    spec = (WorkloadSpec(requests=8, prompt_len=16, prompt_len_max=64, output_len=4, output_len_max=16) if quick else
            WorkloadSpec(requests=64, prompt_len=16, prompt_len_max=512, output_len=16, output_len_max=128))
    requests = make_workload(spec, vocab_size=1)  # its lengths and arrivals; the text replaces its ids
    texts = source_prompts(checkpoint, [prompt, prompt, long_prompt, long_prompt] + [prompt] * batch
                           + [len(r.prompt) for r in requests], seed=0)
    return {"threads": threads, "new_tokens": new_tokens, "warmup": texts[0], "decode": [texts[1]],
            "long": [texts[2:4]], "batch": [texts[4:4 + batch]],
            "workload": [{"prompt": text, "output_len": int(r.output_len), "arrival_s": float(r.arrival_s)}
                         for text, r in zip(texts[4 + batch:], requests)]}


def render(results: dict[str, dict[str, Any]]) -> str:
    rows = [("decode b1 tok/s", "decode_tok_s"), ("decode b16 tok/s", "batch_decode_tok_s"),
            ("TTFT 128 ms", "ttft_ms"), ("TTFT long ms", "ttft_long_ms"), ("cores used", "cpu_per_wall")]
    lines = ["| setting | " + " | ".join(name for name, _ in rows) + " | mixed tok/s | mixed p50 TTFT s |",
             "|---|" + "---:|" * (len(rows) + 2)]
    for name, r in results.items():
        firsts = sorted(r["workload"]["first_token_s"])
        lines.append(f"| {name} | " + " | ".join(str(r.get(key)) for _, key in rows)
                     + f" | {r['workload']['throughput_tok_s']} | {firsts[len(firsts) // 2]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("worker", help="run the job JSON on stdin (in the venv); print one JSON line")
    commands.add_parser("serve", help="load the job on stdin's first line (in the venv); answer the steps on its "
                                      "next lines (bench/stepped.py)")
    run = commands.add_parser("run", help="measure a checkpoint in the three settings")
    run.add_argument("--checkpoint", type=Path, help="a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    run.add_argument("--threads", type=int, default=2)
    run.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    run.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = parser.parse_args(argv)
    if args.command == "worker":
        print(json.dumps(worker(json.loads(sys.stdin.read()))))
        return 0
    if args.command == "serve":
        import stepped

        stepped.serve(start)
        return 0
    checkpoint = args.checkpoint
    if checkpoint is not None and not (checkpoint / "config.json").is_file():
        parser.error(f"--checkpoint {checkpoint}: no config.json, not a Hugging Face checkpoint folder")
    if checkpoint is None:
        sys.path.insert(0, str(ROOT / "tests"))
        sys.path.insert(0, str(BENCH_DIR))
        from latency_bench import plain_checkpoint
        from smollm2 import smollm2_folder

        checkpoint = plain_checkpoint(smollm2_folder(), CACHE / "smollm2-plain")
    python = peer_python()
    job = jobs(checkpoint, args.quick, args.threads)
    results = {}
    for weights, hint in SETTINGS:
        name = f"{weights}, {'compute ' + hint if hint else 'defaults'}"
        print(f"openvino: {name}", file=sys.stderr, flush=True)
        results[name] = run_worker({**job, "model": str(export(checkpoint, weights, python)), "hint": hint}, python)
    print(json.dumps(results) if args.json else render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
