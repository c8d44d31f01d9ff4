"""Serving benchmark: drive an `Engine` with a workload and measure latency and throughput.

A workload is a list of requests, each with a prompt, a number of output tokens and an arrival
time: all at t=0 (offline) or Poisson arrivals at a given rate (online). `run_workload` adds each
request when its arrival time comes and steps the engine until every request has finished,
recording when each request arrived, got its first token and finished. Output lengths are
exact (`ignore_eos=True`), so the output token count is known before the run.

TTFT is measured from the request's arrival time, not from when the driver got round to adding
it: a request that arrives while a step runs waits for that step, as it would in a server.
TPOT is (finish - first token) / (output tokens - 1), per request.

`run_workload(..., concurrency=N)` is a closed loop instead: at most N requests are in the engine
at once, the next one added (in workload order, arrival times ignored) when one finishes; TTFT
counts from that moment. N=1 is the single-request view (`llmc bench --batch 1`): each request
alone in the engine, as a chat user or an agent loop sees it.

`profile_workload` runs a workload again on an engine made with a timeline (`llmc bench
--profile`, bench/): where its time went, per kind of step (runtime/profile.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class WorkloadSpec:
    """A synthetic workload: lengths drawn uniformly from [len, len_max], seeded.

    Args:
        requests: how many requests (≥ 1).
        prompt_len: prompt tokens, or the low end of the range (≥ 1).
        prompt_len_max: high end of the prompt range; None means exactly prompt_len.
        output_len: output tokens, or the low end of the range (≥ 1).
        output_len_max: high end of the output range; None means exactly output_len.
        rate: requests per second with Poisson arrivals; None sends all at t=0 (offline).
        seed: seeds lengths, token ids and arrivals.
    """

    requests: int = 64
    prompt_len: int = 128
    prompt_len_max: int | None = None
    output_len: int = 64
    output_len_max: int | None = None
    rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.requests, int) or self.requests < 1:
            raise LlmcError(f"--requests: must be ≥ 1, got {self.requests}")
        for name, low, high in (("prompt-len", self.prompt_len, self.prompt_len_max),
                                ("output-len", self.output_len, self.output_len_max)):
            if not isinstance(low, int) or low < 1:
                raise LlmcError(f"--{name}: must be ≥ 1, got {low}")
            if high is not None and high < low:
                raise LlmcError(f"--{name}-max: must be ≥ --{name} ({low}), got {high}")
        if self.rate is not None and not (self.rate > 0 and np.isfinite(self.rate)):
            raise LlmcError(f"--rate: must be a finite number of requests/s > 0, got {self.rate}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise LlmcError(f"--seed: must be ≥ 0, got {self.seed}")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: token ids, exact output length, arrival (s after the start)."""

    prompt: list[int]
    output_len: int
    arrival_s: float = 0.0
    priority: int = 0


def make_workload(spec: WorkloadSpec, vocab_size: int,
                  prompts: Sequence[list[int]] | None = None) -> list[BenchRequest]:
    """Requests for `spec`: random token ids from [0, vocab_size), or `prompts` in turn.

    Args:
        spec: counts, lengths, rate and seed.
        vocab_size: the engine's vocabulary size (random prompts only).
        prompts: tokenized prompts to use instead of random ones, cycled if fewer than requested.
    """
    rng = np.random.default_rng(spec.seed)
    n = spec.requests

    def lengths(low: int, high: int | None) -> np.ndarray:
        return rng.integers(low, (high or low) + 1, n)

    prompt_lens = lengths(spec.prompt_len, spec.prompt_len_max)
    output_lens = lengths(spec.output_len, spec.output_len_max)
    if spec.rate is None:
        arrivals = np.zeros(n)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, n))
        arrivals -= arrivals[0]  # the first request arrives at t=0
    if prompts:
        ids = [list(prompts[i % len(prompts)]) for i in range(n)]
    else:
        ids = [rng.integers(0, vocab_size, int(length)).tolist() for length in prompt_lens]
    return [BenchRequest(p, int(o), float(a)) for p, o, a in zip(ids, output_lens, arrivals)]


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds after the start of the run."""

    index: int
    prompt_len: int
    output_len: int
    arrival_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None or self.tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.tokens - 1)


@dataclass
class BenchResult:
    """Per-request records, per-step token counts and the engine's counters after the run."""

    records: list[RequestRecord]
    step_end_s: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    duration_s: float = 0.0
    engine_stats: dict = field(default_factory=dict)
    concurrency: int | None = None  # the closed loop's limit; None for arrival-driven runs


def run_workload(engine, workload: Sequence[BenchRequest],
                 progress: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 concurrency: int | None = None) -> BenchResult:
    """Add each request at its arrival time and step `engine` until all have finished.

    A request the engine refuses (LlmcError from add_request) is recorded with its error and
    the run goes on.

    Args:
        engine: an `llmc.runtime.engine.Engine` (anything with add_request/step/has_unfinished/stats).
        workload: the requests, in any order.
        progress: called after every step with the number of output tokens that step produced.
        clock: seconds, monotonic.
        concurrency: keep at most this many requests in the engine, adding the next (in workload
            order, arrival times ignored; its arrival is when it is added) as one finishes;
            None adds each at its arrival time.
    """
    if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
        raise LlmcError(f"--batch: must be ≥ 1, got {concurrency}")
    if concurrency is None:
        order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_s)
    else:
        order = list(range(len(workload)))
    records = [RequestRecord(i, len(r.prompt), r.output_len, r.arrival_s) for i, r in enumerate(workload)]
    pending = deque(order)
    by_id: dict[str, RequestRecord] = {}
    in_flight = 0
    result = BenchResult(records, concurrency=concurrency)
    start = clock()

    def due(now: float) -> bool:
        if concurrency is not None:
            return in_flight < concurrency
        return workload[pending[0]].arrival_s <= now

    while pending or engine.has_unfinished():
        now = clock() - start
        while pending and due(now):
            index = pending.popleft()
            request = workload[index]
            if concurrency is not None:
                records[index].arrival_s = now
            params = SamplingParams(max_new_tokens=request.output_len, ignore_eos=True)
            try:
                by_id[engine.add_request(request.prompt, params, priority=request.priority)] = records[index]
                in_flight += 1
            except LlmcError as exc:
                records[index].error = str(exc).strip().splitlines()[0] if str(exc).strip() else "refused"
        if not engine.has_unfinished():
            if pending and concurrency is None:
                time.sleep(max(0.0, workload[pending[0]].arrival_s - (clock() - start)))
            continue
        outputs = engine.step()
        now = clock() - start
        produced = 0
        for output in outputs:
            record = by_id.get(output.request_id)
            if record is None:
                continue
            if output.new_token_ids and record.first_token_s is None:
                record.first_token_s = now
            record.tokens += len(output.new_token_ids)
            produced += len(output.new_token_ids)
            if output.finished:
                record.finish_s, record.finish_reason = now, output.finish_reason
                in_flight -= 1
        result.step_end_s.append(now)
        result.step_tokens.append(produced)
        if progress is not None:
            progress(produced)
    result.duration_s = max((r.finish_s for r in records if r.finish_s is not None), default=0.0)
    result.engine_stats = dict(engine.stats)
    return result


def _percentiles(values_s: list[float], prefix: str) -> dict[str, float | None]:
    values = np.asarray(values_s, dtype=np.float64) * 1e3
    out: dict[str, float | None] = {}
    for name, q in (("mean", None), ("p50", 50), ("p90", 90), ("p99", 99)):
        if not len(values):
            out[f"{prefix}_{name}"] = None
        else:
            value = values.mean() if q is None else np.percentile(values, q)
            out[f"{prefix}_{name}"] = round(float(value), 3)
    return out


def summarize(result: BenchResult) -> dict:
    """The headline numbers: counts, throughput, TTFT/TPOT/latency percentiles (ms), engine stats;
    for a closed-loop run also its batch and the per-request decode rate (decode_tok_s)."""
    done = [r for r in result.records if r.error is None and r.finish_s is not None]
    errors = [r for r in result.records if r.error is not None]
    output_tokens = sum(r.tokens for r in done)
    duration = result.duration_s
    stats = result.engine_stats
    summary = {
        "requests": len(done),
        "errors": len(errors),
        "unfinished": len(result.records) - len(done) - len(errors),
        "input_tokens": sum(r.prompt_len for r in done),
        "output_tokens": output_tokens,
        "duration_s": round(duration, 3),
        "throughput_tok_s": round(output_tokens / duration, 2) if duration > 0 else 0.0,
        "request_throughput_req_s": round(len(done) / duration, 3) if duration > 0 else 0.0,
        **_percentiles([r.ttft_s for r in done if r.ttft_s is not None], "ttft_ms"),
        **_percentiles([r.tpot_s for r in done if r.tpot_s is not None], "tpot_ms"),
        **_percentiles([r.finish_s - r.arrival_s for r in done], "latency_ms"),
        "kv_utilization": stats.get("kv_utilization"),
        "prefix_hit_rate": stats.get("prefix_hit_rate"),
        "preemptions": stats.get("preemptions"),
        # Guesses made and kept by speculative decoding (random prompts loop, and loops guess well).
        "speculative_tokens": stats.get("speculative_tokens"),
        "speculative_tokens_kept": stats.get("speculative_tokens_kept"),
        "steps": len(result.step_end_s),
    }
    if result.concurrency is not None:
        # Per-request decode speed: the tokens after each first token over the time they took.
        decoding = [r for r in done if r.tpot_s is not None]
        decode_time = sum(r.finish_s - r.first_token_s for r in decoding)
        summary["batch"] = result.concurrency
        summary["decode_tok_s"] = (round(sum(r.tokens - 1 for r in decoding) / decode_time, 2)
                                   if decode_time > 0 else None)
    if errors:
        summary["error_messages"] = sorted({r.error for r in errors})[:5]
    return summary


def render(summary: dict) -> str:
    """A two-column table of the summary."""
    def fmt(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
        return str(value)

    rows = [(key, fmt(value)) for key, value in summary.items() if key != "error_messages"]
    width = max(len(key) for key, _ in rows)
    lines = [f"{key:<{width}}  {value:>12}" for key, value in rows]
    lines += [f"error: {message}" for message in summary.get("error_messages", [])]
    return "\n".join(lines)


def throughput_over_time(result: BenchResult, bins: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """Bin centres (s) and output tokens/s in each bin, from the per-step token counts.

    Bins hold at least 4 steps on average, so that a short run is not a comb of single steps.
    """
    if not result.step_end_s or result.duration_s <= 0:
        return np.zeros(0), np.zeros(0)
    bins = max(1, min(bins, len(result.step_end_s) // 4))
    end = max(result.step_end_s)
    edges = np.linspace(0.0, end, bins + 1)
    counts, _ = np.histogram(result.step_end_s, bins=edges, weights=result.step_tokens)
    width = edges[1] - edges[0]
    return (edges[:-1] + edges[1:]) / 2, counts / width


def require_matplotlib() -> None:
    """Raise LlmcError naming the fix when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LlmcError("--plot needs matplotlib: pip install 'llmc[bench]'") from None


def plot(result: BenchResult, path: str | Path, title: str = "") -> None:
    """Write a PNG: TTFT and TPOT histograms and output throughput over time.

    Needs matplotlib (`pip install -e ".[bench]"`).
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in result.records if r.error is None and r.finish_s is not None]
    ttft = [r.ttft_s * 1e3 for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s * 1e3 for r in done if r.tpot_s is not None]
    centres, rate = throughput_over_time(result)
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, values, label in ((axes[0], ttft, "TTFT (ms)"), (axes[1], tpot, "TPOT (ms)")):
        if values:
            ax.hist(values, bins=min(30, max(5, len(values) // 2)), color="tab:blue", alpha=0.8)
            for q, style in ((50, "--"), (99, ":")):
                ax.axvline(np.percentile(values, q), color="tab:red", linestyle=style, label=f"p{q}")
            ax.legend()
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
    axes[2].plot(centres, rate, color="tab:green")
    axes[2].set_xlabel("time (s)")
    axes[2].set_ylabel("output tokens/s")
    axes[2].set_ylim(bottom=0)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    tmp.replace(path)


def load_engine(engine_path: str | Path, *, max_num_seqs: int | None = None,
                max_num_batched_tokens: int | None = None, threads: int | None = None, concurrent: bool = True,
                speculative_tokens: int | None = None, timeline=None):
    """Load an engine for a benchmark.

    Args:
        engine_path: a file written by `llmc compile`.
        max_num_seqs, max_num_batched_tokens: scheduler limits; None: the engine's.
        threads: CPU threads for the backend; None uses every core.
        concurrent: requests will overlap (not the `--batch 1` view): the engine builds its
            batched path at load, so no measured step waits for it (`Engine`).
        speculative_tokens: `Engine`'s; None: the engine's default.
        timeline: `Engine`'s: a `Timeline` records every step (a profiled run), None records nothing.
    """
    from llmc.runtime.engine import Engine, SchedulerConfig

    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Engine(engine_path, config=config, threads=threads, concurrent=concurrent,
                  speculative_tokens=speculative_tokens, timeline=timeline)


def prepare(engine_path: str | Path, spec: WorkloadSpec, *, prompts: Sequence[str] | None = None,
            **options):
    """Load an engine (`load_engine`'s options) and draw the workload; returns (engine, workload)
    for `run_workload`.

    Args:
        engine_path: a file written by `llmc compile`.
        spec: the workload.
        prompts: text prompts to use instead of random token ids (tokenized with the engine's tokenizer).
    """
    if prompts is not None and not prompts:
        raise LlmcError("--prompts-file: no prompts in the file")
    engine = load_engine(engine_path, **options)
    ids = None if prompts is None else [engine.request(p, request_id=str(i)).prompt_ids
                                        for i, p in enumerate(prompts)]
    return engine, make_workload(spec, engine.manifest.geometry.vocab_size, ids)


def profile_workload(engine_path: str | Path, workload: Sequence[BenchRequest], *, concurrency: int | None = None,
                     progress: Callable[[int], None] | None = None, **options) -> dict:
    """Where `workload`'s time went: the breakdown (runtime/profile.py) of a second run of it on an
    engine loaded as the timed run's (`load_engine`'s options) with a timeline. The profiler slows
    what it measures, so the figures come from the run without it and this gives the shares.

    Args:
        concurrency: as `run_workload`'s.
        progress: as `run_workload`'s.
    """
    from llmc.runtime.profile import profile_run

    return profile_run(lambda timeline: load_engine(engine_path, timeline=timeline, **options),
                       lambda engine: run_workload(engine, workload, progress, concurrency=concurrency),
                       threads=options.get("threads"))
