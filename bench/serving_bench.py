"""Serving benchmark: llmc's Engine against Hugging Face `generate`, onnxruntime-genai and OpenVINO GenAI.

The checkpoint is optimize_bench's ~32M-parameter Llama (random seeded weights), with 4,096
positions so that a 3,000-token prompt fits. CPU, the same thread count everywhere, each system's
run in a fresh process of its own (not the one that built the models), in `--rounds` rounds
(default 3); each system reports its median round. The systems compared go in pairs, back to back
(PAIRS: llmc and genai, each of llmc's OpenVINO engines and OpenVINO GenAI in the same precision;
`round_order`), and a pair's ratio is the median of its rounds' own ratios:

Scenario 1, offline throughput: N requests (default 64) with prompts of 16-512 random tokens and
outputs of 16-128 tokens (uniform, seeded), all at t=0; exact output lengths (EOS ignored).
Useful output = the requested tokens; tokens a system generates past a request's own length
(padding to the batch's longest) are waste, not output.

  llmc            `llmc export` + `llmc compile` (default paged options: 64 seats), Engine offline:
                  continuous batching, chunked prefill (runtime/bench.py drives it); every llmc
                  engine here is built by latency_bench's `build`, each step through llmc's
                  command line with the options a user types
  hf-static       transformers `generate`, batches of 16 in arrival order, left padding, greedy,
                  max_new_tokens = min_new_tokens = the batch's longest requested output
  hf-single       transformers `generate`, one request at a time
                  (both hf runs: bench/hf_baseline.py in a process of their own, with torch's
                  default OpenMP settings)
  genai           onnxruntime-genai (og.Model/og.Generator over its model builder's output),
                  groups of 16 in arrival order run to completion, left padding, greedy
  llmc-32, genai-32  the same with 32 seats (same engine and pool) and groups of 32: whether
                  the ranking holds when both batch wider
  llmc-kv16       llmc with `--kv-cache-dtype fp16` (weights and activations fp32, the KV pool
                  float16; genai's KV stays fp32): not the same precision, so reported beside
  openvino        OpenVINO GenAI's continuous batching (ContinuousBatchingPipeline, its default
                  scheduler) on `optimum-cli export openvino`'s fp32 model, each request added
                  at its arrival (bench/openvino_peer.py: a venv and a worker process of its own);
                  its default precision: bf16 compute on CPUs with avx512_bf16 or AMX (the
                  machine's AVX-512 and AMX flags are recorded), the KV cache in bf16 (the model
                  asks for f16, which the CPU plugin keeps as bf16 under bf16 compute)
  openvino-f32    the same with f32 compute (INFERENCE_PRECISION_HINT), the KV cache in f16
  llmc-openvino   llmc's engine compiled with `--backend openvino --bf16` (bf16 compute where the
                  CPU has it), and llmc-openvino-f32 with `--backend openvino --kv-cache-dtype fp16`
                  (f32 compute, an f16 cache, as openvino-f32): llmc's scheduler and KV cache
                  over one OpenVINO model a step; each set against OpenVINO GenAI's like
                  (a peer that cannot be installed or exported is recorded with the reason)

llmc's first offline run is followed by the same workload again on an engine with the profiler on:
where its time went per step kind (runtime/profile.py's breakdown), stored beside llmc's figures
(the profiler slows what it times: the figures are the runs' without it).

With `--model smollm2` or `--model llama-1b` (latency_bench's checkpoints: SmolLM2-135M-Instruct,
and a Llama of TinyLlama-1.1B's shape with random weights), scenario 1 runs on that checkpoint with
prompts cut from real text (held-out Python source) and the systems llmc, genai, openvino,
openvino-f32, llmc-openvino and llmc-openvino-f32; llmc's engines
decode one token a step (speculative_tokens=0), so that guessing does not flatter them.

Every run reports the machine's limit for scenario 1 (`workload_limit`: the machine's bandwidth
and fp32 peak measured before and after the runs, the better of each) and each system's share of it.

Scenario 2, interference (llmc only, the 32M Llama): 16 short requests (prompts 32-128, 16 output tokens)
arriving at Poisson times after t=0, alone and with one 3,000-token prompt (64 output tokens)
added at t=0. Reported: the short requests' p99 TTFT in both runs and their ratio.

    python bench/serving_bench.py [--model llama-32m|smollm2|llama-1b] [--json] [--quick] [--save-json PATH]
                                  [--threads 2] [--requests 64] [--rounds 3] [--work-dir DIR]

Progress goes to stderr; stdout gets the table, or one JSON object with --json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import hf_baseline  # noqa: E402
import record  # noqa: E402
import openvino_peer  # noqa: E402
import latency_bench  # noqa: E402
from latency_bench import LLMC_OPENVINO, REAL_MODELS, cpu_flags  # noqa: E402
from optimize_bench import DEFAULT_WORK_DIR, ModelSpec, ensure_checkpoint, log  # noqa: E402

from llmc.runtime.bench import (  # noqa: E402
    BenchRequest, WorkloadSpec, make_workload, profile_workload, run_workload, summarize)

SPEC = ModelSpec(max_positions=4096)
# What the serving design is held to: throughput against each baseline, p99 TTFT with a long
# prompt in flight against alone, and the KV pool's use.
GOALS = {"vs_hf_static": 3.0, "vs_genai": 2.0, "ttft_interference": 2.0, "kv_utilization": 0.96}
GROUP = 16  # static batch size of hf-static and genai (the engine runs its default 64 seats)
# A second, wider setting for both continuous and static batching: llmc with this many seats
# (same engine, same pool) against genai in groups of this many.
WIDE = 32  # onnxruntime-genai refuses batches over 32 ("batch_size (64) must be in [1, 32]")
OPENVINO = {"openvino": None, "openvino-f32": "f32"}  # system name -> INFERENCE_PRECISION_HINT
# The systems compared, each ratio from runs back to back (`round_order`): llmc and genai at both
# widths, each of llmc's OpenVINO engines and OpenVINO GenAI in the same precision.
PAIRS = (("llmc", "genai"), (f"llmc-{WIDE}", f"genai-{WIDE}"),
         *((name, peer) for name, (_, peer) in LLMC_OPENVINO.items()))


@dataclasses.dataclass(frozen=True)
class Scale:
    """Sizes of one run: the full measurement or a smoke run."""

    requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    long_prompt: int
    long_output: int
    shorts: int
    short_prompt: tuple[int, int]
    short_output: int
    short_rate: float  # requests/s
    hf_single: int  # requests run one at a time (a prefix of the workload)


FULL = Scale(requests=64, prompt_len=(16, 512), output_len=(16, 128), long_prompt=3000, long_output=64,
             shorts=16, short_prompt=(32, 128), short_output=16, short_rate=8.0, hf_single=64)
QUICK = Scale(requests=8, prompt_len=(16, 64), output_len=(4, 16), long_prompt=600, long_output=8,
              shorts=4, short_prompt=(16, 32), short_output=4, short_rate=20.0, hf_single=4)


# --- building --------------------------------------------------------------------------------


def build(checkpoint: Path, out: Path) -> dict[str, Any]:
    """latency_bench's fp32 builds (llmc's engines and onnxruntime-genai's folder, each through its own command
    line) and llmc's engine with an fp16 KV cache, beside them as `paths["llmc-kv16"]`."""
    built = latency_bench.build(checkpoint, out, ("fp32",))
    kv16 = out / "kv16.plan"
    built["seconds"]["llmc-kv16_compile"] = latency_bench.timed(
        [*latency_bench.LLMC, "compile", str(out / "model.onnx"), "-o", str(kv16), "--kv-cache-dtype", "fp16"],
        "llmc compile --kv-cache-dtype fp16", built["errors"])
    built["paths"]["llmc-kv16"] = {"fp32": kv16}
    return built


# --- workloads -------------------------------------------------------------------------------


def _plain_tokens(ids: list[int], special: set[int]) -> list[int]:
    """Random ids with the special ones (BOS, EOS = genai's pad) moved off, so no system reads padding."""
    return [t + len(special) if t in special else t for t in ids]


def offline_workload(scale: Scale, seed: int, special: set[int]) -> list[BenchRequest]:
    spec = WorkloadSpec(requests=scale.requests, prompt_len=scale.prompt_len[0], prompt_len_max=scale.prompt_len[1],
                        output_len=scale.output_len[0], output_len_max=scale.output_len[1], seed=seed)
    return [dataclasses.replace(r, prompt=_plain_tokens(r.prompt, special))
            for r in make_workload(spec, SPEC.vocab_size)]


HELDOUT = BENCH_DIR.parent / "data" / "pystdlib-text" / "heldout" / "heldout.txt"


def text_workload(scale: Scale, seed: int, checkpoint: Path) -> list[BenchRequest]:
    """offline_workload's lengths, with windows of real text (held-out Python source, in the
    checkpoint's tokens) for prompts: random ids make a real model's greedy output repeat."""
    from llmc.tokenizer import Tokenizer

    tokens = Tokenizer.from_folder(checkpoint).encode(HELDOUT.read_text())
    rng = np.random.default_rng(seed + 3)
    workload = []
    for request in offline_workload(scale, seed, set()):
        at = int(rng.integers(0, len(tokens) - len(request.prompt)))
        workload.append(dataclasses.replace(request, prompt=tokens[at:at + len(request.prompt)]))
    return workload


def interference_workloads(scale: Scale, seed: int, special: set[int]) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(shorts alone, long + shorts): the shorts arrive at the same Poisson times in both."""
    spec = WorkloadSpec(requests=scale.shorts, prompt_len=scale.short_prompt[0], prompt_len_max=scale.short_prompt[1],
                        output_len=scale.short_output, rate=scale.short_rate, seed=seed + 1)
    first_gap = 1.0 / scale.short_rate  # the first short arrives one mean gap after the long one
    shorts = [dataclasses.replace(r, prompt=_plain_tokens(r.prompt, special), arrival_s=r.arrival_s + first_gap)
              for r in make_workload(spec, SPEC.vocab_size)]
    rng = np.random.default_rng(seed + 2)
    long = BenchRequest(_plain_tokens(rng.integers(0, SPEC.vocab_size, scale.long_prompt).tolist(), special),
                        scale.long_output, 0.0)
    return shorts, [long, *shorts]


# --- the systems -----------------------------------------------------------------------------


def warm_up(engine) -> None:
    """Take every path a measured step may: the whole graph, and the segments with both attention
    forms (the second request arrives while the first decodes, so one step holds a prefill chunk
    and a decode). Else the first mixed step of a fresh process waits for Numba's kernels to
    load (0.4-1.6 s) and builds the dense form's session. Its prompt (byte ids 3-50) starts none
    of the workloads', so the prefix cache holds nothing they can use."""
    prompt = list(range(3, 51))
    run_workload(engine, [BenchRequest(prompt[:16], 8), BenchRequest(prompt[16:], 4, arrival_s=0.001)])


def run_llmc(engine_path: Path, workload: list[BenchRequest], threads: int, seats: int | None = None,
             profile: bool = False, speculative_tokens: int | None = None) -> dict[str, Any]:
    from llmc.formats.sessions import share_threads
    from llmc.runtime.engine import Engine, SchedulerConfig

    share_threads(threads)  # as `llmc bench` does: the benchmark's process is llmc's own
    config = SchedulerConfig(max_num_seqs=seats)  # None: the engine's max batch
    options = {"threads": threads, "concurrent": True, "speculative_tokens": speculative_tokens}
    engine = Engine(engine_path, config, **options)
    warm_up(engine)
    engine = Engine(engine_path, config, **options)  # fresh counters
    done = 0

    def progress(tokens: int) -> None:
        nonlocal done
        done += tokens
        if done // 500 != (done - tokens) // 500:
            log(f"  llmc: {done} tokens")

    result = run_workload(engine, workload, progress)
    summary = summarize(result)
    summary["config"] = dataclasses.asdict(engine.config)
    if profile:
        del engine  # its pool and sessions: the profiled run loads its own
        log("  llmc: the workload again, profiled")
        summary["profile"] = profile_workload(engine_path, workload, max_num_seqs=seats, threads=threads,
                                              concurrent=True)
    return summary


# The command lines `in_fresh_process` runs: this file's `child`, and the transformers baselines.
CHILD = [str(Path(__file__).resolve()), "--child"]
HF_BASELINE = [str(BENCH_DIR / "hf_baseline.py")]


def in_fresh_process(command: list[str], job: dict[str, Any]) -> Any:
    """What `command` (CHILD or HF_BASELINE) prints for `job`, a JSON object on its stdin, run in
    a new interpreter.

    Every system gets one: a process that had just exported and compiled ran llmc's offline
    workload 10-15% slower than a fresh one, and llmc sets
    OpenMP's wait policy to passive when imported (llmc/__init__.py), which slowed transformers'
    generate by about 12%: the baselines run with libgomp's defaults. llmc's runs start with
    malloc's heap on huge pages, as `llmc serve` does (runtime/huge_pages.py)."""
    from llmc.runtime.huge_pages import environment as huge_pages

    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if job["run"] in ("llmc", "interference"):
        environment = huge_pages(environment) or environment
    done = subprocess.run([sys.executable, *command],
                          env=environment, text=True, input=json.dumps(job), stdout=subprocess.PIPE)
    if done.returncode != 0:
        raise RuntimeError(f"{job['run']} exited with {done.returncode} (its error is above)")
    return json.loads(done.stdout)


def child(job: dict[str, Any]) -> Any:
    """One system's run, in the process `in_fresh_process` started; the workloads are made again
    from the seed, so the parent sends only their recipe."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    scale = QUICK if job["quick"] else dataclasses.replace(FULL, requests=job["requests"])
    special = set(job["special"])
    if job["run"] == "interference":
        shorts, mixed = interference_workloads(scale, job["seed"], special)
        return run_interference(Path(job["engine"]), shorts, mixed, job["threads"])
    workload = (text_workload(scale, job["seed"], Path(job["text"])) if job.get("text")
                else offline_workload(scale, job["seed"], special))
    if job["run"] == "llmc":
        return run_llmc(Path(job["engine"]), workload, job["threads"], job.get("seats"), job.get("profile", False),
                        job.get("speculative_tokens"))
    return run_genai(Path(job["folder"]), workload, job["threads"], job["pad"], job["group"])


def run_genai(folder: Path, workload: list[BenchRequest], threads: int, pad: int, group: int = GROUP) -> dict[str, Any]:
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def run_group(group: list[BenchRequest]) -> int:
        width = max(len(r.prompt) for r in group)
        longest = max(r.output_len for r in group)
        ids = np.array([[pad] * (width - len(r.prompt)) + r.prompt for r in group], dtype=np.int32)
        params = og.GeneratorParams(model)
        # min_length keeps EOS from ending a sequence early: every row makes `longest` tokens.
        params.set_search_options(max_length=width + longest, min_length=width + longest, do_sample=False,
                                  batch_size=len(group))
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        steps = 0
        while not generator.is_done():
            generator.generate_next_token()
            steps += 1
        made = len(generator.get_sequence(0)) - width
        if made != longest:
            raise RuntimeError(f"genai: made {made} tokens, asked for {longest}")
        return longest * len(group)

    run_group([BenchRequest(workload[0].prompt[:16], 4)])  # warm-up
    start, generated = time.perf_counter(), 0
    for first in range(0, len(workload), group):
        generated += run_group(workload[first:first + group])
        log(f"  genai: group {first // group + 1} done")
    useful = sum(r.output_len for r in workload)
    return hf_baseline.finish("genai", useful, generated, time.perf_counter() - start, batch=group)


def run_openvino(python: Path, model: Path, workload: list[BenchRequest], threads: int,
                 hint: str | None) -> dict[str, Any]:
    """The workload through OpenVINO GenAI's continuous batching (bench/openvino_peer.py's worker,
    a process of its own), after a warm-up request whose prompt starts none of the workload's
    (warm_up's); figures named as `summarize` names llmc's."""
    job = {"model": str(model), "threads": threads, "hint": hint, "warmup": list(range(3, 19)),
           "workload": [{"prompt": r.prompt, "output_len": r.output_len, "arrival_s": r.arrival_s} for r in workload]}
    out = openvino_peer.run_worker(job, python)
    done = out.pop("workload")
    ttfts = np.array([first - r.arrival_s for first, r in zip(done["first_token_s"], workload)]) * 1e3
    useful = sum(r.output_len for r in workload)  # the worker refuses a count other than the one asked
    log(f"  {'openvino-' + hint if hint else 'openvino'}: {useful} tokens in {done['wall_s']} s → "
        f"{done['throughput_tok_s']} tok/s")
    return {"useful_tokens": useful, "generated_tokens": useful, "seconds": done["wall_s"],
            "throughput_tok_s": done["throughput_tok_s"],
            **{f"ttft_ms_p{q}": round(float(np.percentile(ttfts, q)), 3) for q in (50, 90, 99)}, **out}


def run_interference(engine_path: Path, shorts: list[BenchRequest], mixed: list[BenchRequest],
                     threads: int) -> dict[str, Any]:
    from llmc.runtime.engine import Engine

    def short_ttfts(workload: list[BenchRequest], skip: int) -> tuple[dict[str, Any], list[float]]:
        engine = Engine(engine_path, threads=threads, concurrent=True)
        warm_up(engine)
        result = run_workload(engine, workload)
        records = result.records[skip:]
        if any(r.error for r in result.records):
            raise RuntimeError("interference: " + "; ".join(r.error for r in result.records if r.error))
        ttfts = [r.ttft_s * 1e3 for r in records]
        return result, ttfts

    short_ttfts(shorts, 0)  # untimed: a fresh process's first workload runs colder (p99 47-64 ms against 32)
    _, alone = short_ttfts(shorts, 0)
    result, together = short_ttfts(mixed, 1)
    long = result.records[0]
    p99_alone, p99_together = float(np.percentile(alone, 99)), float(np.percentile(together, 99))
    out = {"shorts": len(shorts), "long_prompt": len(mixed[0].prompt),
           "short_arrivals_s": [round(r.arrival_s, 3) for r in shorts],
           "long_first_token_s": round(long.first_token_s, 3), "long_finish_s": round(long.finish_s, 3),
           "shorts_finished_before_long": sum(r.finish_s <= long.finish_s for r in result.records[1:]),
           "ttft_ms_p50_alone": round(float(np.median(alone)), 2),
           "ttft_ms_p99_alone": round(p99_alone, 2),
           "ttft_ms_p50_with_long": round(float(np.median(together)), 2),
           "ttft_ms_p99_with_long": round(p99_together, 2),
           "p99_ratio": round(p99_together / p99_alone, 2)}
    log(f"interference: short p99 TTFT {out['ttft_ms_p99_alone']} ms alone, {out['ttft_ms_p99_with_long']} ms "
        f"with the {len(mixed[0].prompt)}-token prompt ({out['p99_ratio']}×)")
    return out


# --- the run ---------------------------------------------------------------------------------


def workload_limit(engine: Path, machine: dict[str, float], workload: list[BenchRequest]) -> dict[str, Any]:
    """The most useful tokens a second this machine can give `workload` on `engine`'s model
    (runtime/roofline.py's costs, fp32): every prompt and output token through the model once,
    attention over each token's causal context (compute), and no fewer steps than the longest
    output, each reading every weight (memory); the larger of the two times bounds it. Computing
    in bf16 doubles the peak and halves the bytes, so a bf16 system can pass it."""
    from llmc.runtime.roofline import Cost, MachineLimits, bound, step_cost

    manifest, weight_bytes, params, head = latency_bench.engine_size(engine)
    flops = 0.0
    for request in workload:
        prompt, output = len(request.prompt), request.output_len
        tokens = prompt + output - 1  # the last output token is sampled, never run
        attended = prompt * (prompt + 1) / 2 + sum(range(prompt + 1, prompt + output))
        flops += step_cost(weight_bytes, manifest.geometry, tokens, tokens, 4, params=params, sequences=1,
                           attended=attended, head_params=head, logit_rows=output).flops
    steps = max(request.output_len for request in workload)
    b = bound(Cost(bytes=weight_bytes * steps, flops=flops), MachineLimits(**machine), 1.0)
    useful = sum(request.output_len for request in workload)
    return {"value": round(useful / max(b["memory_s"], b["compute_s"]), 1), "bound": b["bound"]}


def round_order(names: list[str], round_: int) -> list[str]:
    """The order of one round's runs: each of PAIRS that is here back to back, the pairs' order
    rotating from round to round and each pair's alternating, then the other systems, alternating.
    This machine's speed drifts by ±15% within minutes; a pair run back to back sees the same."""
    pairs = [pair if round_ % 2 == 0 else pair[::-1] for pair in PAIRS if all(name in names for name in pair)]
    turn = round_ % len(pairs) if pairs else 0
    ordered = [name for pair in pairs[turn:] + pairs[:turn] for name in pair]
    rest = [name for name in names if name not in ordered]
    return ordered + (rest if round_ % 2 == 0 else rest[::-1])


def openvino_model(checkpoint: Path) -> tuple[Path, Path]:
    """OpenVINO GenAI's venv python and its fp32 export of `checkpoint` (bench/openvino_peer.py)."""
    python = openvino_peer.peer_python()
    return python, openvino_peer.export(checkpoint, "fp32", python)


def builds_dir(args: argparse.Namespace) -> Path:
    """Where a run builds its engines and the peers' models: rebuilt by every run, and deleted after it
    unless --keep-builds (at 1B parameters they take ~21 GB)."""
    return Path(args.work_dir).resolve() / ("serving" if args.model not in REAL_MODELS else f"serving-{args.model}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    scale = QUICK if args.quick else dataclasses.replace(FULL, requests=args.requests)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    began = record.begin()
    errors: dict[str, str] = {}
    recipe: dict[str, Any] = {"quick": args.quick, "requests": args.requests, "seed": args.seed,
                              "threads": args.threads}
    if args.model in REAL_MODELS:
        checkpoint, model = latency_bench.real_checkpoint(args.model, work)
        built = latency_bench.build(checkpoint, builds_dir(args), ("fp32",),
                                    large=args.model == "llama-1b")
        recipe |= {"text": str(checkpoint), "special": [], "speculative_tokens": 0}
        workload = text_workload(scale, args.seed, checkpoint)
        llmc_jobs, genai_groups = ("llmc", *LLMC_OPENVINO), {"genai": GROUP}
    else:
        checkpoint = work / "hf-llama-32m-4k"
        model = {**dataclasses.asdict(SPEC), "parameters": ensure_checkpoint(checkpoint, SPEC)}
        built = build(checkpoint, builds_dir(args))
        from llmc.tokenizer import byte_level_tokenizer

        tokenizer = byte_level_tokenizer()
        pad = tokenizer.eos_id  # the checkpoint's pad token, which the HF baselines pad with
        special = {tokenizer.bos_id, tokenizer.eos_id}
        recipe["special"] = sorted(special)
        workload = offline_workload(scale, args.seed, special)
        llmc_jobs, genai_groups = ("llmc", "llmc-kv16", *LLMC_OPENVINO), {"genai": GROUP, f"genai-{WIDE}": WIDE}
    errors |= built["errors"]
    paths = built["paths"]
    from llmc.formats.engine_file import read_manifest

    engine = {"paged": read_manifest(paths["llmc"]["fp32"])["paged"], "build_s": built["seconds"]["llmc_compile"]}
    jobs = {name: {"run": "llmc", "engine": str(paths[name]["fp32"])} for name in llmc_jobs
            if paths[name]["fp32"].is_file()}
    if args.model not in REAL_MODELS and "llmc" in jobs:
        jobs[f"llmc-{WIDE}"] = {**jobs["llmc"], "seats": WIDE}
    genai_config = paths["genai"]["fp32"] / "genai_config.json"
    if genai_config.is_file():
        genai_pad = json.loads(genai_config.read_text())["model"]["pad_token_id"]
        jobs |= {name: {"run": "genai", "folder": str(genai_config.parent), "pad": genai_pad, "group": group}
                 for name, group in genai_groups.items()}
    log(f"workload: {len(workload)} requests, {sum(len(r.prompt) for r in workload)} prompt tokens, "
        f"{sum(r.output_len for r in workload)} output tokens")
    systems: dict[str, Any] = {}

    def attempt(name: str, thunk) -> Any:
        """thunk()'s result, or None with the error recorded under `name`."""
        log(f"run: {name}")
        try:
            return thunk()
        except Exception as exc:  # a failing system is a result to report, not the end of the run
            errors[name] = f"{type(exc).__name__}: {str(exc).strip()}"[:1000]
            log(f"run: {name} FAILED: {errors[name]}")
            return None

    log("build: OpenVINO GenAI's venv and export (cached)")
    try:
        openvino = openvino_model(checkpoint)
        jobs |= {name: {"run": "openvino", "hint": hint} for name, hint in OPENVINO.items()}
    except Exception as exc:  # no registry, or a failed export: both settings' rows say why
        errors[", ".join(OPENVINO)] = f"install or export: {type(exc).__name__}: {str(exc).strip()}"[:1000]
        log(f"build: OpenVINO GenAI FAILED: {errors[', '.join(OPENVINO)]}")
    limits = [latency_bench.measure_machine(args.threads)]  # again at the end: the larger of each is the limit
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    for round_ in range(args.rounds):
        for name in round_order(list(jobs), round_):
            if jobs[name]["run"] == "openvino" and name in errors:  # failed once: later rounds would alike
                continue
            # llmc's first run profiled again (not at 1B, where a run takes minutes)
            job = {**jobs[name], **recipe, "profile": name == "llmc" and round_ == 0 and args.model != "llama-1b"}
            if job["run"] == "openvino":
                summary = attempt(name, lambda job=job: run_openvino(*openvino, workload, args.threads, job["hint"]))
            else:
                summary = attempt(name, lambda job=job: in_fresh_process(CHILD, job))
            if summary is not None:
                runs[name].append({**summary, "run": round_})
    for name, done in runs.items():
        if done:
            profiles = [summary.pop("profile") for summary in done if "profile" in summary]
            ordered = sorted(done, key=lambda summary: summary["throughput_tok_s"])
            systems[name] = {**ordered[(len(ordered) - 1) // 2],
                             "rounds_tok_s": [summary["throughput_tok_s"] for summary in done],
                             **({"profile": profiles[0]} if profiles else {})}
    interference = None
    if args.model not in REAL_MODELS:
        interference = attempt("interference", lambda: in_fresh_process(
            CHILD, {"run": "interference", "engine": str(paths["llmc"]["fp32"]), **recipe}))
        requests = [(r.prompt, r.output_len) for r in workload]
        common = {"checkpoint": str(checkpoint), "threads": args.threads, "pad": pad}
        for name, job in (("hf-static", {"run": "run_hf_static", "requests": requests, "group_size": GROUP}),
                          ("hf-single", {"run": "run_hf_single", "requests": requests[:scale.hf_single]})):
            summary = attempt(name, lambda job=job: in_fresh_process(HF_BASELINE, {**job, **common}))
            if summary is not None:
                systems[name] = summary

    limits.append(latency_bench.measure_machine(args.threads))
    machine = latency_bench.better_limits(limits)
    # Any of llmc's engines counts the model's weights: each holds the same fp32 checkpoint.
    counted = next((Path(job["engine"]) for job in jobs.values() if job["run"] == "llmc"), None)
    limit = workload_limit(counted, machine, workload) if counted else None
    for system in (systems.values() if limit else ()):
        system["share_of_limit"] = round(system["throughput_tok_s"] / limit["value"], 3)
    ratios = {}
    if "llmc" in systems:
        mine = systems["llmc"]["throughput_tok_s"]
        ratios = {f"llmc_vs_{name}": round(mine / s["throughput_tok_s"], 2)  # PAIRS' ratios come paired, below
                  for name, s in systems.items() if name != "llmc" and ("llmc", name) not in PAIRS}
    if "llmc-kv16" in systems and "genai" in systems:
        ratios["llmc-kv16_vs_genai"] = round(
            systems["llmc-kv16"]["throughput_tok_s"] / systems["genai"]["throughput_tok_s"], 2)
    for name in OPENVINO:  # like for like in precision: llmc-kv16 against OpenVINO's defaults too (u8 KV)
        if "llmc-kv16" in systems and name in systems:
            ratios[f"llmc-kv16_vs_{name}"] = round(
                systems["llmc-kv16"]["throughput_tok_s"] / systems[name]["throughput_tok_s"], 2)
    for mine, theirs in PAIRS:  # each round's own ratio, its median: the pair saw the same drift
        paired = latency_bench.paired_ratio(runs.get(mine, []), runs.get(theirs, []), "throughput_tok_s",
                                            "throughput_tok_s")
        if paired is not None:
            ratios[f"{mine}_vs_{theirs}"] = paired
    finished = record.finish(began)
    finished["machine"]["cpu_flags"] = cpu_flags()
    return {
        "benchmark": "serving", "quick": args.quick, "seed": args.seed, "rounds": args.rounds, "threads": args.threads,
        "model": {"name": args.model, **model}, "speculative_tokens": recipe.get("speculative_tokens"),
        "workload": {"requests": len(workload), "prompt_len": scale.prompt_len, "output_len": scale.output_len,
                     "prompts": "real text" if args.model in REAL_MODELS else "random ids",
                     "prompt_tokens": sum(len(r.prompt) for r in workload),
                     "output_tokens": sum(r.output_len for r in workload)},
        "engine": engine,
        "systems": systems, "ratios": ratios, "interference": interference, "errors": errors,
        "limit": limit, "machine_limits": {"measured": limits, "used": machine}, "goals": GOALS,
        "record": finished,
    }


def render(result: dict[str, Any]) -> str:
    w = result["workload"]
    model = result["model"]
    name = f"{model['parameters'] / 1e6:.1f}M Llama" if "parameters" in model else model["name"]
    lines = [f"Serving benchmark — {name}, fp32, {result['threads']} threads, "
             f"{w['requests']} requests (prompts {w['prompt_len'][0]}-{w['prompt_len'][1]}, outputs "
             f"{w['output_len'][0]}-{w['output_len'][1]}; {w['prompt_tokens']} prompt / {w['output_tokens']} "
             f"output tokens), load avg {result['record']['machine']['loadavg_start'][0]:.2f} → "
             f"{result['record']['machine']['loadavg_end'][0]:.2f}", ""]
    rows = [["system", "useful tok/s", "seconds", "generated", "llmc ×", "rounds (tok/s)"]]
    for name, s in result["systems"].items():
        useful = s.get("output_tokens", s.get("useful_tokens"))
        seconds = s.get("duration_s", s.get("seconds"))
        generated = s.get("generated_tokens", useful)
        ratio = result["ratios"].get(f"llmc_vs_{name}")
        rows.append([name, f"{s['throughput_tok_s']:.1f}", f"{seconds:.1f}", str(generated),
                     f"{ratio:.2f}" if ratio else "-", " ".join(f"{x:.0f}" for x in s.get("rounds_tok_s", [])) or "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(wd) if i == 0 else c.rjust(wd) for i, (c, wd) in enumerate(zip(r, widths)))
              for r in rows]
    llmc = result["systems"].get("llmc")
    limit = result.get("limit")
    if limit:
        lines += ["", f"machine limit: {limit['value']} tok/s ({limit['bound']}, fp32); "
                      + ", ".join(f"{name} {s['share_of_limit']:.0%}" for name, s in result["systems"].items()
                                  if "share_of_limit" in s)]
    if llmc:
        lines += ["", f"llmc: TTFT p50 {llmc['ttft_ms_p50']} ms, p99 {llmc['ttft_ms_p99']} ms; TPOT p50 "
                      f"{llmc['tpot_ms_p50']} ms, p99 {llmc['tpot_ms_p99']} ms; kv_utilization "
                      f"{llmc['kv_utilization']:.3f}; preemptions {llmc['preemptions']}; steps {llmc['steps']}"]
    i = result["interference"]
    if i:
        lines += [f"interference: {i['shorts']} short requests, p99 TTFT {i['ttft_ms_p99_alone']} ms alone, "
                  f"{i['ttft_ms_p99_with_long']} ms with a {i['long_prompt']}-token prompt in flight "
                  f"({i['p99_ratio']}×; p50 {i['ttft_ms_p50_alone']} → {i['ttft_ms_p50_with_long']} ms)"]
    goals = result["goals"]
    checks = []
    if "llmc_vs_hf-static" in result["ratios"]:
        checks.append(f"vs hf-static {result['ratios']['llmc_vs_hf-static']}× (goal ≥ {goals['vs_hf_static']}×)")
    if "llmc_vs_genai" in result["ratios"]:
        checks.append(f"vs genai {result['ratios']['llmc_vs_genai']}× (goal ≥ {goals['vs_genai']}×)")
    if i:
        checks.append(f"TTFT interference {i['p99_ratio']}× (goal ≤ {goals['ttft_interference']}×)")
    if llmc:
        checks.append(f"kv_utilization {llmc['kv_utilization']:.3f} (goal ≥ {goals['kv_utilization']})")
    wide = f"llmc-{WIDE}_vs_genai-{WIDE}"
    if wide in result["ratios"]:
        lines += [f"at {WIDE} seats / groups of {WIDE}: llmc-{WIDE} is {result['ratios'][wide]}× genai-{WIDE}"]
    if "llmc-kv16_vs_genai" in result["ratios"]:
        lines += [f"with a float16 KV pool (genai's stays fp32): llmc-kv16 is {result['ratios']['llmc-kv16_vs_genai']}× genai"]
    lines += ["goals: " + "; ".join(checks)]
    for name in OPENVINO:
        mine, kv16 = result["ratios"].get(f"llmc_vs_{name}"), result["ratios"].get(f"llmc-kv16_vs_{name}")
        if mine:
            lines += [f"against OpenVINO GenAI's continuous batching ({name}): llmc is {mine}×"
                      + (f", llmc-kv16 {kv16}×" if kv16 else "")]
    lines += [f"CPU flags: {' '.join(result['record']['machine'].get('cpu_flags', [])) or 'no avx512*/amx*'}"]
    lines += [f"FAILED {name}: {message}" for name, message in result["errors"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true", help="tiny workload: a smoke run, not a measurement")
    parser.add_argument("--save-json", metavar="PATH", help="also write the JSON object to PATH")
    parser.add_argument("--requests", type=int, default=64, help="offline requests (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for every system (default 2)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="offline runs of each llmc, genai and OpenVINO system, alternating; the median is reported (default 3)")
    parser.add_argument("--model", choices=("llama-32m", *REAL_MODELS), default="llama-32m",
                        help="the 32M Llama (random weights, every system and the interference run), or a real "
                             "checkpoint (real-text prompts; llmc, onnxruntime-genai and the OpenVINO systems, "
                             "llmc one token a step)")
    parser.add_argument("--work-dir", default=str(DEFAULT_WORK_DIR),
                        help="where the checkpoint is cached and models are built (default bench/.work)")
    latency_bench.add_keep_builds(parser)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(child(json.load(sys.stdin))), flush=True)
        return 0
    args = parser.parse_args(argv)
    import onnxruntime as ort

    ort.set_default_logger_severity(3)  # the build's sessions
    with latency_bench.builds_deleted_after(builds_dir(args), args.keep_builds):
        result = run(args)
    text = json.dumps(result, indent=2, default=str)
    if args.save_json:
        record.write_json(args.save_json, result)
    print(text if args.json else render(result))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
