"""Single-request latency, start-up and build time: llmc against onnxruntime-genai and OpenVINO GenAI.

The checkpoint is made by the benchmark: a ~26M-parameter Llama (optimize_bench's ModelSpec with
6 layers and 2,304 positions, random seeded weights), or with `--model smollm2`
SmolLM2-135M-Instruct (tests/smollm2.py; 64 new tokens instead of 128), or with `--model llama-1b`
large_model_bench's 1B Llama (TinyLlama-1.1B's shape, random weights) with 2,304 positions and
32 new tokens, without the profiled runs (at 1B a run takes minutes), and `--force` for llmc's
OpenVINO engines: a reduced precision's accuracy check runs in memory, which 4.4 GB exceed.
Both systems build from it with their own tools, timed as subprocesses: `llmc export` + `llmc compile` (default options:
the paged engine) against onnxruntime-genai's model builder (fp32, cpu); then `llmc compile
--weights int4 --force` against the builder's `-p int4`, and llmc's int4 again in the builder's
scheme (`--weights-symmetric` and lm_head int4 by a --precision-config rule). A failed build is
reported, not fatal (except fp32's).

OpenVINO GenAI runs beside them (bench/openvino_peer.py: a venv of its own, `optimum-cli export
openvino` at fp32 and at int4, asymmetric with groups of 32 as llmc's default int4), in two
settings: its defaults (bf16 compute on CPUs with avx512_bf16 or AMX) and f32 compute
(INFERENCE_PRECISION_HINT), each measuring the rows its worker can: batch-1 decode and TTFT, the
long prompt's TTFT and the static batch (its continuous batching, the requests added together) at
fp32, batch-1 decode at int4 (not the real-text rows: its worker makes a set number of tokens,
EOS ignored). A peer that cannot be installed, exported or run is recorded with the reason and the
benchmark goes on. The machine's AVX-512 and AMX flags are recorded: they
decide OpenVINO's default precision.

Every measurement run is a process of its own, each uses 2 threads (`--threads`). The systems
compared go in pairs (PAIRS: llmc and genai, each of llmc's OpenVINO engines and OpenVINO GenAI in
the same precision), the pairs' order rotating from run to run and precision to precision and each
pair's alternating; a run's systems share its prompts. A pair's two workers load one after the
other and stay loaded side by side (bench/stepped.py); then each row is measured by one and at once
by the other, seconds apart, and the rows that time a request (batch-1 decode, TTFT at 128 and
2,048 tokens, the batch) three times over, alternating, on fresh prompts each time. This
machine's speed drifts by up to 30% within a minute, and the two sides of a take see the same
drift: a ratio is the median of the takes' own ratios over the runs (`paired_ratio`), not of the
medians' ratio. A run:

  load + first token  from the top of the child process (its `import llmc` or
                      `import onnxruntime_genai` included) to the first token of a 16-token prompt
  RSS after load      VmRSS once the engine (llmc: Engine(), with its warm-up) or og.Model is loaded
  decode, batch 1     after one unmeasured warm-up request: a 128-token prompt, 128 new tokens;
                      decode rate = the tokens after the first ÷ their time
  TTFT, 128 tokens    the median of five 128-token prompts, one new token each, one at a time, from
                      adding the request (`ttft_prompts`: the same prompts for every system of a
                      take; a lone first token of ~0.1 s moves by ±10% here)
  TTFT, long prompt   a 2,048-token prompt, one new token, a take; the run's first take times
                      one more before it, cold (kept in the JSON as `ttft_long_cold_ms`)
  decode, batch 16    16 requests of 128 + 128 at once (llmc: added together to one Engine with
                      its default scheduler; genai: one generator of batch 16); rate = tokens made
                      after every request has its first token ÷ the time from then to the last
  int4 runs           the same load, warm-up and batch-1 decode on the int4 builds (genai's int4
                      build beside each of llmc's two; OpenVINO GenAI's beside llmc's OpenVINO
                      engine built with `--bf16 --weights int4 --force`)
  one token a step    llmc's runs repeat the batch-1 decode with speculation off (fp32 engines
                      guess tokens from the sequence's own text by default: runtime/prompt_lookup.py);
                      random prompts make a model loop, which guesses well. An engine whose default
                      is one token a step (weight-only, bf16 compute) is measured once, for both rows
  real text           SmolLM2 only, fp32 and int4 (llmc's default scheme): 12 chat prompts (the model's template) asking about, rewriting
                      or summarizing pieces of Python's source (data/pystdlib-text/heldout) or
                      asking general questions, greedy, up to 128 new tokens, stopping at EOS; one
                      at a time. Decode rate over all of them (tokens after each first ÷ their
                      time), llmc with its default speculation and without; and how many of the 12
                      outputs are token for token genai's.
  where time went     llmc's first fp32 run, after its timed measurements, repeats the batch-1
                      decode, the first token of a prompt alone and the static batch on engines
                      with the profiler on (runtime/profile.py's breakdown per step kind), stored
                      beside those rows' figures; the profiler slows them, so the figures are the
                      runs' without it

Prompts are fresh random token ids in every request, take and run (the same for every system in a
run; ids ≥ 260, no special tokens; no prefix can be cached), EOS ignored (llmc: ignore_eos; genai:
min_length = max_length). Rates and latencies are medians over `--reps` runs (default 3) and their
takes. The machine's load average is recorded at the start and end.

    python bench/latency_bench.py [--model llama-25m|smollm2|llama-1b] [--quick] [--json] [--save-json PATH]
                                  [--reps 3] [--threads 2] [--work-dir DIR]

Progress and the table go to stderr; stdout gets one JSON object with --json.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # the top of a child process: "load + first token" counts from here

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
import record  # noqa: E402
import stepped  # noqa: E402

LOW_ID = 260  # random prompt ids start here: past the byte-level tokenizer's and SmolLM2's special ids
SHORT_PROMPT = 16  # the load + first token prompt
# llmc's int4 builds: its default (asymmetric blocks, int8 lm_head: the accuracy choices of
# precision/weight_only.py), and onnxruntime-genai's scheme (symmetric, lm_head in int4 too), which
# separates the speed comparison from those choices; genai's one int4 build runs beside each.
PRECISIONS = ("fp32", "int4", "int4-sym")
# OpenVINO GenAI's two settings: system name -> INFERENCE_PRECISION_HINT (None: its default).
OPENVINO = {"openvino": None, "openvino-f32": "f32"}
# Its export of each llmc precision: int4 is asymmetric with groups of 32, as llmc's default int4
# (it keeps the tied lm_head in int8 per channel); it has no build in genai's scheme.
OPENVINO_WEIGHTS = {"fp32": "fp32", "int4": "int4"}
# llmc's own OpenVINO backend (--backend openvino): system name -> its extra compile options, and
# the OpenVINO GenAI setting it is compared with. Its fp32 engines and their int4 builds, each beside
# OpenVINO GenAI's int4 with the same compute precision. OpenVINO GenAI's f32 setting keeps its KV
# cache in f16 (its exported model asks for it, and its compiled model reports KV_CACHE_PRECISION f16),
# so llmc's engine compared with it does too; under bf16 compute both keep bf16.
LLMC_OPENVINO = {"llmc-openvino": (["--bf16"], "openvino"),
                 "llmc-openvino-f32": (["--kv-cache-dtype", "fp16"], "openvino-f32")}
# The systems run back to back, each pair a comparison the tables make.
PAIRS = (("llmc", "genai"), *((peer, system) for system, (_, peer) in LLMC_OPENVINO.items()))
TTFT_PROMPTS = 5  # prompts a run's TTFT at 128 tokens is the median of


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Prompt and output lengths of one run: the full measurement or a smoke run."""

    prompt: int
    new_tokens: int
    long_prompt: int
    batch: int
    reps: int
    takes: int  # of the rows that time a request, in a run (stepped.TAKEN_AGAIN)


FULL = Sizes(prompt=128, new_tokens=128, long_prompt=2048, batch=16, reps=3, takes=3)
QUICK = Sizes(prompt=32, new_tokens=16, long_prompt=256, batch=4, reps=2, takes=2)
# SmolLM2 decodes ~5x slower: 64 new tokens keep a run's length near the random Llama's.
FULL_SMOLLM2 = dataclasses.replace(FULL, new_tokens=64)
FULL_1B = dataclasses.replace(FULL, new_tokens=32)
LARGE_POSITIONS = 2304  # the 1B checkpoint's: the 2,048-token prompt and its token fit
TEXT_TOKENS = 128  # new tokens at most per real-text prompt


def _spec(quick: bool):
    from optimize_bench import ModelSpec

    if quick:  # small enough to build in seconds
        return ModelSpec(hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4, num_kv_heads=2,
                         max_positions=512)
    # ~26M parameters; positions for the 2,048-token prompt and room to spare.
    return ModelSpec(num_layers=6, max_positions=2304)


# --- the child: one measurement run in a process of its own -----------------------------------


def _rss_mib(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _prompts(rng, count: int, length: int, vocab: int) -> list[list[int]]:
    return rng.integers(LOW_ID, vocab, (count, length)).tolist()


def _rates(start: float, times: list[list[float]]) -> dict[str, float]:
    """TTFT of the first request and the decode rate over the window where all have a first token."""
    first = max(t[0] for t in times)
    last = max(t[-1] for t in times)
    after = sum(1 for t in times for x in t if x > first)
    return {"ttft_ms": round((times[0][0] - start) * 1e3, 2),
            "decode_tok_s": round(after / (last - first), 2) if last > first else None}


class _LlmcRunner:
    def __init__(self, path: str, threads: int, timeline=None):
        from llmc.formats.sessions import share_threads
        from llmc.runtime.engine import Engine

        share_threads(threads)  # as `llmc run` does: this process is llmc's own
        self.engine = Engine(path, threads=threads, timeline=timeline)
        self.vocab = self.engine.manifest.geometry.vocab_size

    @contextlib.contextmanager
    def one_token_a_step(self):
        """The engine without speculation, its default back afterwards."""
        default, self.engine.speculative_tokens = self.engine.speculative_tokens, 0
        try:
            yield
        finally:
            self.engine.speculative_tokens = default

    def _outputs(self):
        """(time, output) for each request output of each step until the engine is idle; a failed
        request raises."""
        while self.engine.has_unfinished():
            outputs = self.engine.step()
            now = time.perf_counter()
            for output in outputs:
                if output.error is not None:
                    raise RuntimeError(f"llmc request failed: {output.error}")
                yield now, output

    def complete(self, prompt: list[int], new_tokens: int) -> tuple[list[float], list[int]]:
        """One greedy completion stopping at EOS: each token's time, and the tokens."""
        from llmc.runtime.sampling_params import SamplingParams

        self.engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens))
        times, tokens = [], []
        for now, output in self._outputs():
            times += [now] * len(output.new_token_ids)
            tokens += output.new_token_ids
        return times, tokens

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[float]]]:
        from llmc.runtime.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        ids = [self.engine.add_request(p, params) for p in prompts]
        times: dict[str, list[float]] = {i: [] for i in ids}
        for now, output in self._outputs():
            times[output.request_id] += [now] * len(output.new_token_ids)
        if any(len(t) != new_tokens for t in times.values()):
            raise RuntimeError(f"llmc made {[len(t) for t in times.values()]} tokens, asked for {new_tokens}")
        return start, [times[i] for i in ids]


class _GenaiRunner:
    def __init__(self, path: str, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(path)
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)
        self.vocab = json.loads((Path(path) / "genai_config.json").read_text())["model"]["vocab_size"]

    def complete(self, prompt: list[int], new_tokens: int) -> tuple[list[float], list[int]]:
        import numpy as np

        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False, batch_size=1)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        times, tokens = [], []
        while not generator.is_done():
            generator.generate_next_token()
            times.append(time.perf_counter())
            tokens.append(int(generator.get_next_tokens()[0]))
        return times, tokens

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[float]]]:
        import numpy as np

        width = len(prompts[0])
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=width + new_tokens, min_length=width + new_tokens, do_sample=False,
                                  batch_size=len(prompts))
        start = time.perf_counter()
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.array(prompts, dtype=np.int32))
        times = []
        while not generator.is_done():
            generator.generate_next_token()
            times.append(time.perf_counter())
        if len(times) != new_tokens:
            raise RuntimeError(f"genai made {len(times)} tokens, asked for {new_tokens}")
        return start, [times] * len(prompts)


def start(job: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A worker's load and first token (`job` names the system, the model and what to measure), and
    its measurements as stepped.STEPS; each draws its prompts from the job's seed in that order."""
    # Counted from _T0: the runner's `import llmc` / `import onnxruntime_genai` is part of start-up.
    runner = (_LlmcRunner if job["system"].startswith("llmc") else _GenaiRunner)(job["path"], job["threads"])
    loaded = time.perf_counter() - _T0
    import numpy as np

    ready: dict[str, Any] = {"rss_after_load_mib": _rss_mib(), "load_s": round(loaded, 3),
                             "huge_pages_after_load_mib": stepped.huge_pages_mib()}
    rng = np.random.default_rng(job["seed"])
    _, times = runner.generate(_prompts(rng, 1, SHORT_PROMPT, runner.vocab), 1)
    ready["load_first_token_s"] = round(times[0][0] - _T0, 3)
    llmc = job["system"].startswith("llmc")

    def warmup(take: int) -> dict[str, Any]:
        runner.generate(_prompts(rng, 1, job["prompt"], runner.vocab), 4)
        return {}

    def decode(take: int) -> dict[str, Any]:
        out = _rates(*runner.generate(_prompts(rng, 1, job["prompt"], runner.vocab), job["new_tokens"]))
        if llmc and job.get("one_token_a_step"):
            if runner.engine.speculative_tokens:
                with runner.one_token_a_step():
                    start, times = runner.generate(_prompts(rng, 1, job["prompt"], runner.vocab), job["new_tokens"])
                out["plain_decode_tok_s"] = _rates(start, times)["decode_tok_s"]
            else:  # its default is one token a step: the same measurement
                out["plain_decode_tok_s"] = out["decode_tok_s"]
        return out

    def long(take: int) -> dict[str, Any]:
        """The first long prompt of the run is timed cold as well (the runtime meets its shape)."""
        if not job.get("long_prompt"):
            return {}

        def first_token_ms() -> float:
            return _rates(*runner.generate(_prompts(rng, 1, job["long_prompt"], runner.vocab), 1))["ttft_ms"]

        out = {"ttft_long_cold_ms": first_token_ms()} if take == 0 else {}
        out["ttft_long_ms"] = first_token_ms()
        return out

    def ttft(take: int) -> dict[str, Any]:
        firsts = [_rates(*runner.generate([prompt], 1))["ttft_ms"]
                  for prompt in ttft_prompts(job, runner.vocab, take)]
        return {"ttft_ms": _median(firsts)}

    def batch(take: int) -> dict[str, Any]:
        if not job.get("batch"):
            return {}
        start, times = runner.generate(_prompts(rng, job["batch"], job["prompt"], runner.vocab), job["new_tokens"])
        return {"batch_decode_tok_s": _rates(start, times)["decode_tok_s"]}

    steps = {"warmup": warmup, "decode": decode, "long": long, "ttft": ttft, "batch": batch,
             "texts": lambda take: _real_text(runner, job) if job.get("texts") else {},
             "done": lambda take: {"peak_rss_mib": _rss_mib("VmHWM")},  # before the profiled runs' engines load
             "profile": lambda take: {"profiles": _profiles(job, rng)} if job.get("profile") else {}}
    return ready, steps


def _profiles(job: dict[str, Any], rng) -> dict[str, dict]:
    """Where llmc's time went in the fp32 rows, by the rows' keys: each measurement again (fresh
    prompts) on an engine made with a timeline, after the same warm-up (runtime/profile.py's
    breakdown). The profiler slows what it times, so the figures are the runs' above."""
    from llmc.runtime.profile import profile_run
    from llmc.runtime.roofline import measure_limits

    limits = measure_limits(job["threads"])  # once: the three profiles' bounds share one measure

    def profiled(requests: int, new_tokens: int) -> dict:
        runner = None

        def make_engine(timeline):
            nonlocal runner
            runner = _LlmcRunner(job["path"], job["threads"], timeline)
            runner.generate(_prompts(rng, 1, job["prompt"], runner.vocab), 4)  # warm-up, not profiled
            return runner.engine

        return profile_run(make_engine, lambda engine: runner.generate(
            _prompts(rng, requests, job["prompt"], runner.vocab), new_tokens), limits=limits)

    return {"decode_tok_s": profiled(1, job["new_tokens"]), "ttft_ms": profiled(1, 1),
            "batch_decode_tok_s": profiled(job["batch"], job["new_tokens"])}


def _real_text(runner, job: dict[str, Any]) -> dict[str, Any]:
    """The real-text prompts one at a time (llmc: with its default speculation, then without; an
    engine whose default is one token a step runs them once, for both)."""
    out: dict[str, Any] = {}
    llmc = job["system"].startswith("llmc")
    guesses = llmc and runner.engine.speculative_tokens
    passes = [("text", contextlib.nullcontext)] + ([("plain_text", runner.one_token_a_step)] if guesses else [])
    for name, setting in passes:
        made, seconds, outputs = 0, 0.0, []
        with setting():
            for prompt in job["texts"]:
                times, tokens = runner.complete(prompt, job["text_tokens"])
                made, seconds = made + len(times) - 1, seconds + times[-1] - times[0]
                outputs.append(tokens)
        out[f"{name}_decode_tok_s"] = round(made / seconds, 2) if seconds else None
        out[f"{name}_outputs"] = outputs
    if llmc and not guesses:
        out["plain_text_decode_tok_s"], out["plain_text_outputs"] = out["text_decode_tok_s"], out["text_outputs"]
    return out


def text_prompts(checkpoint: Path) -> list[list[int]]:
    """The real-text prompts, in the model's chat template, as token ids (both systems get these)."""
    import numpy as np

    from llmc.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(checkpoint)
    source = (ROOT / "data" / "pystdlib-text" / "heldout" / "heldout.txt").read_text().splitlines()
    rng = np.random.default_rng(1)
    prompts = []
    for task, about_source in (("Explain briefly what this Python code does:", True),
                               ("Rewrite this Python code with clearer variable names:", True),
                               ("Summarize this in two sentences:", True),
                               ("Give three tips for writing readable Python code.", False),
                               ("What is the difference between a list and a tuple in Python?", False),
                               ("Write a short poem about the sea.", False)):
        for _ in range(2):
            at = int(rng.integers(0, len(source) - 30))
            text = task + "\n\n" + "\n".join(source[at:at + 30]) if about_source else task
            prompts.append(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}])))
    return prompts


def ttft_prompts(job: dict[str, Any], vocab: int, take: int) -> list[list[int]]:
    """The prompts whose first tokens give a take's TTFT at `job["prompt"]` tokens, the same for
    every system of the run (drawn from the run's seed and the take alone)."""
    import numpy as np

    return _prompts(np.random.default_rng([job["seed"], TTFT_PROMPTS, take]), TTFT_PROMPTS, job["prompt"], vocab)


def openvino_worker(python: Path, hint: str | None, job: dict[str, Any], vocab: int) -> stepped.Worker:
    """`job`'s measurements on OpenVINO GenAI, loaded (bench/openvino_peer.py's worker, a process
    of its own): fresh random prompts from the job's seed, the same sizes as llmc's run."""
    import numpy as np

    import openvino_peer

    rng = np.random.default_rng(job["seed"])
    takes = range(job["takes"])
    peer = {"model": job["path"], "hint": hint, "threads": job["threads"], "new_tokens": job["new_tokens"],
            "warmup": _prompts(rng, 1, job["prompt"], vocab)[0],
            "decode": [_prompts(rng, 1, job["prompt"], vocab)[0] for _ in takes]}
    if job.get("long_prompt"):  # the first take's first prompt is timed cold, as llmc's
        peer["long"] = [_prompts(rng, 1 if take else 2, job["long_prompt"], vocab) for take in takes]
    if job.get("batch"):
        peer["batch"] = [_prompts(rng, job["batch"], job["prompt"], vocab) for _ in takes]
    peer["ttft"] = [ttft_prompts(job, vocab, take) for take in takes]
    return openvino_peer.start_worker(peer, python)


def openvino_models(checkpoint: Path, errors: dict[str, str]) -> tuple[Path | None, dict[str, Path]]:
    """OpenVINO GenAI's venv python and its exports of `checkpoint` by weights ("fp32", "int4");
    what could not be installed or exported is an entry in `errors`, not the end of the run."""
    import openvino_peer

    log("build: OpenVINO GenAI's venv")
    try:
        python = openvino_peer.peer_python()
    except Exception as exc:  # no registry, or pip refused the pins: the peer's rows stay empty
        errors["OpenVINO GenAI install"] = f"{type(exc).__name__}: {str(exc).strip()}"[:1000]
        log(f"build: OpenVINO GenAI FAILED: {errors['OpenVINO GenAI install']}")
        return None, {}
    models = {}
    for weights in dict.fromkeys(OPENVINO_WEIGHTS.values()):
        log(f"build: optimum-cli export openvino {weights} (cached by the checkpoint's hash)")
        try:
            models[weights] = openvino_peer.export(checkpoint, weights, python)
        except Exception as exc:
            errors[f"OpenVINO GenAI export {weights}"] = f"{type(exc).__name__}: {str(exc).strip()}"[:1000]
            log(f"build: OpenVINO GenAI {weights} FAILED: {errors[f'OpenVINO GenAI export {weights}']}")
    return python, models


def cpu_flags() -> list[str]:
    """The CPU's AVX-512 and AMX flags: OpenVINO computes in bf16 by default where avx512_bf16 or
    AMX is there, and int8 kernels differ with VNNI."""
    from llmc.formats.cpu_features import cpu_flags as all_flags

    return sorted(flag for flag in all_flags() if flag.startswith(("avx512", "amx")))


# Each timed row's machine limit: what the row's work costs (runtime/roofline.py's cost model:
# every weight read once a step, the attended keys and values, 2 FLOPs a parameter a token) at
# the bandwidth and fp32 peak measured in the same run. Rows of one request decoding at a time
# (key: the tokens in a step, sequences, each sequence's context: "prompt" + half of "new").
LIMIT_ROWS = {"decode_tok_s": "decode", "plain_decode_tok_s": "decode", "text_decode_tok_s": "text",
              "plain_text_decode_tok_s": "text", "batch_decode_tok_s": "batch", "ttft_ms": "prompt",
              "ttft_long_ms": "long_prompt"}


def measure_machine(threads: int) -> dict[str, float]:
    """The machine's bandwidth and fp32 peak with `threads` threads (runtime/roofline.py)."""
    from llmc.runtime.roofline import measure_limits

    return measure_limits(threads).as_dict()


def engine_size(engine: Path) -> tuple[Any, int, int, int]:
    """`engine`'s manifest, its weights' stored bytes, its linear layers' parameters and the LM
    head's among them (runtime/roofline.py's counts)."""
    from llmc.formats.engine_file import read_engine
    from llmc.runtime.roofline import graph_weights, head_parameters, model_weights

    manifest = read_engine(engine, verify=False).manifest
    weights = graph_weights(engine)
    weight_bytes, params = model_weights(weights)
    return manifest, weight_bytes, params, head_parameters(weights, manifest.geometry.vocab_size)


def better_limits(measured: list[dict[str, float]]) -> dict[str, float]:
    """Of several `measure_machine` results, the better of each figure: a busy moment measures low."""
    return {key: max(limits[key] for limits in measured) for key in measured[0]}


def row_limits(engine: Path, limits: dict[str, float], sizes: Sizes, text_prompt: float | None) -> dict[str, dict]:
    """By row key: the fastest the row's work can run on this machine ("value": tok/s for a rate,
    ms for a time to first token) and what bounds it ("memory" or "compute"), for `engine`'s
    weights and geometry. A speculating row can pass it: a step then yields several tokens for one
    read of the weights. `text_prompt`: the real-text prompts' mean length (None: no such rows)."""
    from llmc.runtime.roofline import MachineLimits, bound, step_cost

    manifest, weight_bytes, params, head = engine_size(engine)
    kv_bytes = 2 if manifest.paged is not None and manifest.paged.kv_dtype == "float16" else 4
    machine = MachineLimits(**limits)
    shapes = {"decode": (1, 1, sizes.prompt + sizes.new_tokens / 2),
              "batch": (sizes.batch, sizes.batch, sizes.prompt + sizes.new_tokens / 2),
              "prompt": (sizes.prompt, 1, sizes.prompt), "long_prompt": (sizes.long_prompt, 1, sizes.long_prompt)}
    if text_prompt is not None:
        shapes["text"] = (1, 1, text_prompt + TEXT_TOKENS / 2)
    out = {}
    for key, shape in LIMIT_ROWS.items():
        if shape not in shapes:
            continue
        tokens, sequences, context = shapes[shape]
        cost = step_cost(weight_bytes, manifest.geometry, tokens, round(context * sequences), kv_bytes,
                         params=params, sequences=sequences, head_params=head, logit_rows=sequences)
        b = bound(cost, machine, 1.0)
        seconds = max(b["memory_s"], b["compute_s"])
        value = seconds * 1e3 if shape.endswith("prompt") else tokens / seconds
        out[key] = {"value": round(value, 2 if value < 100 else 1), "bound": b["bound"]}
    return out


def share_of_limit(value: float | None, limit: dict | None, higher: bool) -> float | None:
    """How close `value` comes to the row's limit: 1.0 is as fast as the machine allows."""
    if not value or not limit:
        return None
    return round(value / limit["value"] if higher else limit["value"] / value, 3)


def worker(job: dict[str, Any]) -> stepped.Worker:
    """`start(job)` in a fresh interpreter, loaded; OMP_WAIT_POLICY is left for each system to set,
    and llmc's starts with malloc's heap on huge pages, as `llmc serve` does."""
    from llmc.runtime.huge_pages import environment as huge_pages

    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if job["system"].startswith("llmc"):
        environment = huge_pages(environment) or environment
    return stepped.Worker([sys.executable, str(Path(__file__).resolve()), "--worker"], job, environment)


# --- building ---------------------------------------------------------------------------------


LLMC = [sys.executable, "-m", "llmc.cli"]  # each build step runs as a user types it


def timed(command: list[str], what: str, errors: dict[str, str]) -> float | None:
    """Seconds `command` took; None, with the error in `errors[what]`, when it failed (a result too)."""
    log(f"build: {what}")
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = round(time.perf_counter() - start, 2)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        errors[what] = f"exit {done.returncode}: " + " | ".join(tail)
        log(f"build: {what} FAILED: {errors[what]}")
        return None
    log(f"build: {what}: {seconds} s")
    return seconds


def build(checkpoint: Path, out: Path, precisions: tuple[str, ...] = PRECISIONS, large: bool = False) -> dict[str, Any]:
    """Both systems' builds in `precisions` from `checkpoint`, each step timed as a subprocess;
    `large`: past 2 GB of weights, where a reduced precision's accuracy check cannot run (`--force`)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    onnx = out / "model.onnx"
    genai = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-e", "cpu",
             "-c", str(out / "genai-cache")]
    errors: dict[str, str] = {}
    lm_head = out / "int4-lm-head.json"
    lm_head.write_text(json.dumps({"rules": {"lm_head": "int4"}}))
    seconds = {
        "llmc_export": timed([*LLMC, "export", str(checkpoint), "-o", str(onnx)], "llmc export", errors),
        "llmc_compile": timed([*LLMC, "compile", str(onnx), "-o", str(out / "fp32.plan")], "llmc compile", errors),
        "genai_builder": timed([*genai, "-o", str(out / "genai-fp32"), "-p", "fp32"], "genai builder fp32", errors),
    }
    int4 = {
        "llmc_compile_int4": timed([*LLMC, "compile", str(onnx), "-o", str(out / "int4.plan"), "--weights", "int4",
                                    "--force"], "llmc compile --weights int4 --force", errors),
        "genai_builder_int4": timed([*genai, "-o", str(out / "genai-int4"), "-p", "int4"], "genai builder int4",
                                    errors),
    } if "int4" in precisions else {}
    if "int4-sym" in precisions:
        int4["llmc_compile_int4_sym"] = timed([*LLMC, "compile", str(onnx), "-o", str(out / "int4-sym.plan"),
                                               "--weights", "int4", "--weights-symmetric", "--precision-config",
                                               str(lm_head), "--force"],
                                              "llmc compile --weights int4 in genai's scheme", errors)
    seconds.update(int4)
    for system, (options, _) in LLMC_OPENVINO.items():
        options = [*options, "--force"] if large else options  # no check of a reduced precision past 2 GB
        seconds[f"{system}_compile"] = timed([*LLMC, "compile", str(onnx), "-o", str(out / f"{system}.plan"),
                                              "--backend", "openvino", *options], f"llmc compile {system}", errors)
    for system, (options, _) in LLMC_OPENVINO.items() if "int4" in precisions else ():
        seconds[f"{system}_compile_int4"] = timed(
            [*LLMC, "compile", str(onnx), "-o", str(out / f"{system}-int4.plan"), "--backend", "openvino",
             *options, "--weights", "int4", "--force"], f"llmc compile {system} --weights int4", errors)
    shutil.rmtree(out / "genai-cache", ignore_errors=True)
    paths = {"llmc": {"fp32": out / "fp32.plan", "int4": out / "int4.plan", "int4-sym": out / "int4-sym.plan"},
             **{system: {"fp32": out / f"{system}.plan",
                         "int4": out / f"{system}-int4.plan"}
                for system in LLMC_OPENVINO},
             "genai": {"fp32": out / "genai-fp32", "int4": out / "genai-int4", "int4-sym": out / "genai-int4"}}
    built = {p: p in precisions and paths["llmc"][p].is_file() and (paths["genai"][p] / "genai_config.json").is_file()
             for p in PRECISIONS}
    return {"seconds": seconds, "paths": paths, "built": built, "errors": errors}


REAL_MODELS = ("smollm2", "llama-1b")  # the checkpoints `real_checkpoint` makes (the 1B one: real shape, random weights)


def real_checkpoint(name: str, work: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint folder of `name` (one of REAL_MODELS), made or linked under `work`, and its description."""
    if name == "smollm2":
        sys.path.insert(0, str(ROOT / "tests"))
        from smollm2 import smollm2_folder

        checkpoint = plain_checkpoint(smollm2_folder(), work / "smollm2-plain")
        return checkpoint, {"name": "SmolLM2-135M-Instruct", "checkpoint": str(checkpoint)}
    import large_model_bench

    checkpoint = large_model_bench.ensure_checkpoint(work / "hf-llama-1b-2k", positions=LARGE_POSITIONS)
    return checkpoint, {"name": "llama-1b", **large_model_bench.CONFIG, "max_position_embeddings": LARGE_POSITIONS}


def plain_checkpoint(folder: Path, out: Path) -> Path:
    """`folder` linked file by file into `out`, its config.json without the `quantization_config`
    that transformers' GGUF conversion leaves (the weights are dequantized float32): genai's
    builder refuses a checkpoint that names one ("The gguf quantized model is not currently
    supported"). Both systems build from `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for source in folder.iterdir():
        target = out / source.name
        if source.name == "config.json":
            config = json.loads(source.read_text())
            config.pop("quantization_config", None)
            target.write_text(json.dumps(config, indent=2) + "\n")
        elif not target.exists():
            target.symlink_to(source.resolve())
    return out


def pool_mib(engine: Path) -> float:
    from llmc.formats.engine_file import read_engine

    return read_engine(engine).manifest.paged.pool_mb


def weight_mib(checkpoint: Path) -> float:
    return round(sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / 2**20, 1)


# --- the run ----------------------------------------------------------------------------------


_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


def run_ratios(mine: list[dict[str, Any]], theirs: list[dict[str, Any]], key: str, their_key: str) -> list[float]:
    """mine[key] ÷ theirs[their_key], each take's figures against the same run's same take (the
    "run" and "take" fields); one without both is left out."""
    def at(result: dict[str, Any]) -> tuple[int, int]:
        return result["run"], result.get("take", 0)

    by_take = {at(result): result.get(their_key) for result in theirs}
    return [result[key] / by_take[at(result)] for result in mine if result.get(key) and by_take.get(at(result))]


def paired_ratio(mine: list[dict[str, Any]], theirs: list[dict[str, Any]], key: str,
                 their_key: str) -> float | None:
    """The median of the takes' own ratios (`run_ratios`); None where none has both."""
    ratios = run_ratios(mine, theirs, key, their_key)
    return round(_median(ratios), 2) if ratios else None


def _median(values: list) -> float | None:
    import numpy as np

    values = [v for v in values if v is not None]
    return round(float(np.median(values)), 3) if values else None


def builds_dir(args: argparse.Namespace) -> Path:
    """Where a run builds its engines and the peers' models: rebuilt by every run, and deleted after it
    unless --keep-builds (at 1B parameters they take ~25 GB)."""
    return Path(args.work_dir).resolve() / f"latency-{args.model}{'-quick' if args.quick else ''}"


def add_keep_builds(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep-builds", action="store_true",
                        help="keep the run's engines and models in --work-dir (deleted after the run by default)")


@contextlib.contextmanager
def builds_deleted_after(folder: Path, keep: bool):
    """Deletes `folder`, a run's builds, when the block ends, failed or not, unless `keep`."""
    try:
        yield
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(BENCH_DIR))
    from optimize_bench import ensure_checkpoint

    sizes = QUICK if args.quick else {"smollm2": FULL_SMOLLM2, "llama-1b": FULL_1B}.get(args.model, FULL)
    large = args.model == "llama-1b"
    reps = args.reps or sizes.reps
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    began = record.begin()
    if args.model in REAL_MODELS:
        checkpoint, model = real_checkpoint(args.model, work)
    else:
        spec = _spec(args.quick)
        checkpoint = work / ("hf-llama-quick" if args.quick else "hf-llama-25m-2k")
        model = {"name": "llama-25m", **dataclasses.asdict(spec),
                 "parameters": ensure_checkpoint(checkpoint, spec)}
    model["weights_mib"] = weight_mib(checkpoint)
    built = build(checkpoint, builds_dir(args), PRECISIONS, large)
    precisions = [p for p in PRECISIONS if built["built"][p]]
    if "fp32" not in precisions:
        raise RuntimeError("the fp32 builds failed: " + "; ".join(f"{k}: {v}" for k, v in built["errors"].items()))
    model["llmc_pool_mib"] = {p: pool_mib(built["paths"]["llmc"][p]) for p in precisions}
    peer_errors: dict[str, str] = {}  # what OpenVINO GenAI could not do, by what: the reason
    openvino_python, openvino = openvino_models(checkpoint, peer_errors)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]

    limits = [measure_machine(args.threads)]  # again at the end: the larger of each is the limit
    systems = ("llmc", "genai", *OPENVINO, *LLMC_OPENVINO)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {p: [] for p in PRECISIONS} for s in systems}
    profiles: dict[str, dict] = {}  # llmc's fp32 rows' breakdowns, from the first run
    texts = text_prompts(checkpoint) if args.model == "smollm2" and not args.quick else None
    seed = args.seed
    for rep in range(reps):
        for precision in precisions:
            here = ["llmc", "genai"] + [s for s in OPENVINO if OPENVINO_WEIGHTS.get(precision) in openvino
                                        and f"{s} {precision}" not in peer_errors]
            here += [s for s in LLMC_OPENVINO if built["paths"][s].get(precision, Path()).is_file()]
            pairs = [pair[::-1] if rep % 2 else pair for pair in
                     ([system for system in pair if system in here] for pair in PAIRS) if pair]
            turn = (rep + PRECISIONS.index(precision)) % len(pairs)
            seed += 1  # fresh prompts in every run
            for pair in pairs[turn:] + pairs[:turn]:
                starts = []
                for system in pair:
                    path = (openvino[OPENVINO_WEIGHTS[precision]] if system in OPENVINO
                            else built["paths"][system][precision])
                    job = {"system": system, "path": str(path), "threads": args.threads, "seed": seed,
                           "prompt": sizes.prompt, "new_tokens": sizes.new_tokens, "one_token_a_step": True,
                           "takes": sizes.takes}
                    if precision == "fp32":
                        job.update(long_prompt=sizes.long_prompt, batch=sizes.batch,
                                   profile=system == "llmc" and rep == 0 and not large)
                    if system in OPENVINO:
                        starts.append(lambda job=job, hint=OPENVINO[system]: openvino_worker(
                            openvino_python, hint, job, vocab))
                    else:
                        if texts and precision != "int4-sym":
                            job.update(texts=texts, text_tokens=TEXT_TOKENS)
                        starts.append(lambda job=job: worker(job))
                for system, result in zip(pair, stepped.run_pair(starts, sizes.takes)):
                    if isinstance(result, Exception):
                        if system not in OPENVINO:
                            raise result
                        # reported; its later runs in this precision are skipped
                        peer_errors[f"{system} {precision}"] = f"{type(result).__name__}: {str(result).strip()}"[:1000]
                        log(f"run {rep + 1}/{reps} {precision} {system} FAILED: {peer_errors[f'{system} {precision}']}")
                        continue
                    profiles.update(result[0].pop("profiles", {}))
                    for take, figures in enumerate(result):
                        runs[system][precision].append({**figures, "run": rep, "take": take})
                        log(f"run {rep + 1}/{reps} take {take + 1} {precision} {system}: " + ", ".join(
                            f"{k} {v}" for k, v in figures.items()
                            if not k.endswith("_outputs") and k not in ("versions", "scheduler")))

    limits.append(measure_machine(args.threads))
    machine = better_limits(limits)
    text_prompt = sum(map(len, texts)) / len(texts) if texts else None
    ceilings = {p: row_limits(built["paths"]["llmc"][p], machine, sizes, text_prompt) for p in precisions}

    def med(system: str, precision: str, key: str) -> float | None:
        return _median([r.get(key) for r in runs[system][precision]])

    def paired(system: str, peer: str, precision: str, key: str, peer_key: str) -> float | None:
        return paired_ratio(runs[system][precision], runs[peer][precision], key, peer_key)

    rows = [  # (label, key, precision, higher is better, genai's key if not the same)
        ("decode, batch 1, fp32 (tok/s)", "decode_tok_s", "fp32", True),
        ("decode, batch 1, fp32, llmc one token a step (tok/s)", "plain_decode_tok_s", "fp32", True, "decode_tok_s"),
        ("decode, batch 1, int4 weight-only (tok/s)", "decode_tok_s", "int4", True),
        ("decode, batch 1, int4, llmc one token a step (tok/s)", "plain_decode_tok_s", "int4", True, "decode_tok_s"),
        ("decode, batch 1, int4 in genai's scheme: symmetric, int4 lm_head (tok/s)", "decode_tok_s", "int4-sym", True),
        ("decode, batch 1, int4 in genai's scheme, llmc one token a step (tok/s)", "plain_decode_tok_s", "int4-sym",
         True, "decode_tok_s"),
        (f"decode, static batch of {sizes.batch} (tok/s)", "batch_decode_tok_s", "fp32", True),
        (f"time to first token, batch 1, {sizes.prompt}-token prompt (ms)", "ttft_ms", "fp32", False),
        (f"time to first token, batch 1, {sizes.long_prompt}-token prompt (ms)", "ttft_long_ms", "fp32", False),
        ("load + first token (s)", "load_first_token_s", "fp32", False),
        ("resident memory after load, fp32 (MiB)", "rss_after_load_mib", "fp32", False),
    ]
    if texts:
        rows += [row for precision in ("fp32", "int4") for row in (
            (f"decode on real text (chat), batch 1, {precision} (tok/s)", "text_decode_tok_s", precision, True),
            (f"decode on real text (chat), batch 1, {precision}, llmc one token a step (tok/s)",
             "plain_text_decode_tok_s", precision, True, "text_decode_tok_s"))]
    rows = [row for row in rows if row[2] in precisions]
    table = []
    for label, key, precision, higher, *genai_key in rows:
        peer_key = (genai_key or [key])[0]
        mine, theirs = med("llmc", precision, key), med("genai", precision, peer_key)
        ratio = paired("llmc", "genai", precision, key, peer_key)
        limit = ceilings.get(precision, {}).get(key)
        table.append({"measure": label, "key": key, "precision": precision, "llmc": mine, "genai": theirs,
                      "ratio": ratio, "higher_is_better": higher, "limit": limit,
                      "llmc_share_of_limit": share_of_limit(mine, limit, higher)})
        for system in OPENVINO:  # None where its worker does not measure the row
            table[-1] |= {system: med(system, precision, peer_key),
                          f"ratio_{system}": paired("llmc", system, precision, key, peer_key)}
        for system, (_, peer_system) in LLMC_OPENVINO.items():  # its rows beside OpenVINO GenAI's
            ours = med(system, precision, key)
            table[-1] |= {system: ours, f"ratio_{system}": paired(system, peer_system, precision, key, peer_key),
                          f"{system}_share_of_limit": share_of_limit(ours, limit, higher)}
        if precision == "fp32" and key in profiles:
            table[-1]["profile"] = profiles[key]
    agreement = {p: _agreement(runs, p) for p in ("fp32", "int4")} if texts else None
    s = built["seconds"]
    for label, mine, theirs in (
            ("build: llmc export + compile vs genai builder, fp32 (s)",
             s["llmc_export"] + s["llmc_compile"] if s["llmc_export"] and s["llmc_compile"] else None,
             s["genai_builder"]),
            ("build: llmc compile alone vs genai builder, fp32 (s)", s["llmc_compile"], s["genai_builder"]),
            ("build: llmc compile --weights int4 vs genai builder -p int4 (s)", s.get("llmc_compile_int4"),
             s.get("genai_builder_int4"))):
        if mine is None and theirs is None:
            continue  # not built in this run
        ok = mine is not None and theirs is not None
        table.append({"measure": label, "key": "build_s", "precision": "fp32", "llmc": round(mine, 2) if ok else None,
                      "genai": theirs, "ratio": round(mine / theirs, 2) if ok else None, "higher_is_better": False,
                      **{key: None for system in OPENVINO for key in (system, f"ratio_{system}")}})
    versions = next((r["versions"] for s in OPENVINO for p in PRECISIONS for r in runs[s][p] if "versions" in r), None)
    finished = record.finish(began)
    finished["machine"]["cpu_flags"] = cpu_flags()
    return {
        "benchmark": "latency", "quick": args.quick, "threads": args.threads, "reps": reps,
        "seconds": round(time.perf_counter() - _START, 1),
        "sizes": dataclasses.asdict(sizes), "model": model, "build_s": built["seconds"],
        "table": table, "runs": runs, "build_errors": built["errors"], "real_text_agreement": agreement,
        "openvino": {"versions": versions, "settings": OPENVINO, "weights": OPENVINO_WEIGHTS,
                     "models": {w: str(path) for w, path in openvino.items()}},
        "peer_errors": peer_errors,
        "machine_limits": {"measured": limits, "used": machine},
        "record": finished,
    }


def _agreement(runs: dict[str, dict[str, list[dict[str, Any]]]], precision: str) -> dict[str, Any] | None:
    """Of the real-text outputs of the first runs in `precision`: how many are token for token
    genai's, and how many llmc's speculation left as they were one token a step."""
    if not runs["llmc"][precision] or not runs["genai"][precision]:
        return None
    llmc, genai = runs["llmc"][precision][0], runs["genai"][precision][0]
    pairs = list(zip(llmc["text_outputs"], genai["text_outputs"]))
    return {"prompts": len(pairs), "same_as_genai": sum(a == b for a, b in pairs),
            "speculation_unchanged": sum(a == b for a, b in zip(llmc["text_outputs"], llmc["plain_text_outputs"])),
            "llmc_tokens": sum(len(a) for a, _ in pairs), "genai_tokens": sum(len(b) for _, b in pairs)}


def render(result: dict[str, Any]) -> str:
    model, machine = result["model"], result["record"]["machine"]
    size = (f"{model['parameters'] / 1e6:.1f}M-parameter Llama ({model['num_layers']} layers, hidden "
            f"{model['hidden_size']}, {model['max_positions']} positions)" if "parameters" in model else model["name"])
    lines = [f"Latency benchmark — {size}, weights {model['weights_mib']} MiB fp32, llmc pool "
             f"{model['llmc_pool_mib']['fp32']} MiB (fp32 engine) / {model['llmc_pool_mib'].get('int4', '-')} MiB (int4); "
             f"{result['threads']} threads each, medians of {result['reps']} runs per system; "
             f"{result['sizes']['prompt']}-token prompts, {result['sizes']['new_tokens']} new tokens",
             f"load avg {machine['loadavg_start'][0]} → {machine['loadavg_end'][0]} ({machine['cores']} CPUs, "
             f"{machine['cpu']}); {result['seconds']} s in all"
             + (" — QUICK run, numbers are a smoke test" if result["quick"] else ""), ""]

    def fmt(value) -> str:
        if value is None:
            return "-"
        return f"{value:,.1f}" if value >= 10 else f"{value:.3g}" if value < 1 else f"{value:.2f}"

    def versus(ratio, higher: bool) -> str:
        if ratio is None:
            return "-"
        better = ratio > 1 if higher else ratio < 1
        return f"{ratio:.2f}" + ("" if ratio == 1 else " (better)" if better else " (worse)")

    peers = [s for s in OPENVINO if any(s in row for row in result["table"])]
    rows = [["measure", "llmc", "genai", "llmc ÷ genai", *peers, *(f"llmc ÷ {s}" for s in peers)]]
    for row in result["table"]:
        rows.append([row["measure"], fmt(row["llmc"]), fmt(row["genai"]), versus(row["ratio"], row["higher_is_better"]),
                     *(fmt(row.get(s)) for s in peers),
                     *(versus(row.get(f"ratio_{s}"), row["higher_is_better"]) for s in peers)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(rows[0], widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|")
    lines += ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
              + " |" for r in rows[1:]]
    b = result["build_s"]
    lines += ["", "build steps (s): " + ", ".join(f"{step} {seconds}" for step, seconds in b.items())]
    for precision, agreement in (result.get("real_text_agreement") or {}).items():
        if agreement:
            lines.append(f"real text, {precision}: {agreement['same_as_genai']} of {agreement['prompts']} greedy outputs "
                         f"token for token genai's ({agreement['llmc_tokens']} vs {agreement['genai_tokens']} tokens); "
                         f"{agreement['speculation_unchanged']} of {agreement['prompts']} the same as one token a step")
    peak = {s: _median([r.get("peak_rss_mib") for r in result["runs"][s]["fp32"]]) for s in ("llmc", "genai")}
    lines.append(f"peak resident (VmHWM) of an fp32 run (MiB): llmc {peak['llmc']}, genai {peak['genai']}")
    lines += [f"FAILED build: {what}: {error}" for what, error in result["build_errors"].items()]
    lines += [f"OpenVINO GenAI not measured: {what}: {error}" for what, error in result["peer_errors"].items()]
    lines.append(f"CPU flags: {' '.join(result['record']['machine']['cpu_flags']) or 'no avx512*/amx*'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        stepped.serve(start)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("llama-25m", "smollm2", "llama-1b"), default="llama-25m",
                        help="the benchmark's random-weight Llama (default), SmolLM2-135M-Instruct or a random 1B Llama")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not a measurement")
    parser.add_argument("--save-json", metavar="PATH", help="also write the JSON object to PATH")
    parser.add_argument("--reps", type=int, default=None, help="runs per system and precision (default 3; quick 2)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed of the first run (default 0)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for each system (default 2)")
    parser.add_argument("--work-dir", default=str(BENCH_DIR / ".work"),
                        help="where the checkpoint is cached and models are built (default bench/.work)")
    add_keep_builds(parser)
    args = parser.parse_args(argv)
    with builds_deleted_after(builds_dir(args), args.keep_builds):
        result = run(args)
    text = json.dumps(result, indent=2, default=str)
    if args.save_json:
        record.write_json(args.save_json, result)
    print(render(result), file=sys.stderr)
    if args.json:
        print(text)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
