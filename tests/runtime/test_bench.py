"""`llmc bench` and runtime/bench.py on tiny-llama: the summary's keys and invariants, the plot,
the workload generator, and the options it must refuse."""

import json

import pytest
from click.testing import CliRunner

from llmc.cli import main
from llmc.runtime.bench import BenchRequest, WorkloadSpec, make_workload, run_workload, summarize

KEYS = {"requests", "errors", "output_tokens", "throughput_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
        "tpot_ms_p99", "kv_utilization", "prefix_hit_rate", "preemptions"}
# Small enough to run in about a second on 2 cores; ranges so that requests differ.
MIXED = ["--requests", 8, "--prompt-len", 4, "--prompt-len-max", 40, "--output-len", 3, "--output-len-max", 9]


def llmc(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def bench_json(engine, *args) -> dict:
    result = llmc("bench", engine, "--json", "--threads", 2, *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def requested_outputs(requests=8, seed=0) -> int:
    spec = WorkloadSpec(requests=requests, prompt_len=4, prompt_len_max=40, output_len=3, output_len_max=9, seed=seed)
    return sum(r.output_len for r in make_workload(spec, vocab_size=258))


def test_offline_json_keys_and_invariants(tiny_llama_engine):
    summary = bench_json(tiny_llama_engine, *MIXED)
    assert KEYS <= summary.keys()
    assert summary["requests"] == 8 and summary["errors"] == 0 and summary["unfinished"] == 0
    assert summary["output_tokens"] == requested_outputs()
    assert summary["throughput_tok_s"] > 0
    assert 0 <= summary["ttft_ms_p50"] <= summary["ttft_ms_p99"]
    assert 0 <= summary["tpot_ms_p50"] <= summary["tpot_ms_p99"]
    assert 0 < summary["kv_utilization"] <= 1 and summary["preemptions"] == 0


def test_online_rate_and_table(tiny_llama_engine):
    summary = bench_json(tiny_llama_engine, *MIXED, "--rate", 200, "--seed", 3)
    assert summary["output_tokens"] == requested_outputs(seed=3)
    text = llmc("bench", tiny_llama_engine, "--requests", 2, "--prompt-len", 4, "--output-len", 2).stdout
    assert "throughput_tok_s" in text and "ttft_ms_p99" in text


def test_prompts_file_one_request_per_prompt(tiny_llama_engine, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fibonacci(\nimport os\nx = 1\n")
    summary = bench_json(tiny_llama_engine, "--prompts-file", prompts, "--output-len", 4)
    assert summary["requests"] == 3 and summary["output_tokens"] == 12


def test_a_request_too_long_is_an_error_not_a_crash(tiny_llama_engine):
    # tiny-llama has 512 positions: prompts of 600 tokens can never run.
    summary = bench_json(tiny_llama_engine, "--requests", 2, "--prompt-len", 600, "--output-len", 2)
    assert summary["errors"] == 2 and summary["requests"] == 0 and summary["output_tokens"] == 0
    assert "512 positions" in summary["error_messages"][0]


def test_plot_writes_png(tiny_llama_engine, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the bench extra)")
    out = tmp_path / "bench.png"
    result = llmc("bench", tiny_llama_engine, *MIXED, "--plot", out)
    assert result.exit_code == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--requests", -1], "--requests"),
    (["--requests", 0], "--requests"),
    (["--rate", 0], "--rate"),
    (["--rate", -2], "--rate"),
    (["--prompt-len", 0], "--prompt-len"),
    (["--output-len", 8, "--output-len-max", 4], "--output-len-max"),
    (["--prompts-file", "no-such-file.txt"], "no-such-file.txt"),
    (["--batch", 0], "--batch"),
    (["--batch", 1, "--rate", 5], "--rate"),
])
def test_bad_options_exit_2_with_one_line(tiny_llama_engine, args, message):
    result = llmc("bench", tiny_llama_engine, *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmc: error: ") and message in lines[0], result.stderr


def test_missing_engine_exit_2(tmp_path):
    result = llmc("bench", tmp_path / "nope.plan")
    assert result.exit_code == 2 and "no such file" in result.stderr


def test_workload_is_seeded_and_in_range():
    spec = WorkloadSpec(requests=50, prompt_len=16, prompt_len_max=512, output_len=16, output_len_max=128,
                        rate=4.0, seed=7)
    first, again = make_workload(spec, 8192), make_workload(spec, 8192)
    assert first == again
    assert all(16 <= len(r.prompt) <= 512 and 16 <= r.output_len <= 128 for r in first)
    assert all(0 <= t < 8192 for r in first for t in r.prompt)
    arrivals = [r.arrival_s for r in first]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert all(r.arrival_s == 0 for r in make_workload(WorkloadSpec(requests=5), 100))


class _FakeEngine:
    """Two requests' worth of engine: one token per running request per step; refuses long prompts."""

    def __init__(self):
        self.running, self.stats = {}, {"kv_utilization": 1.0, "prefix_hit_rate": 0.0, "preemptions": 0}

    def add_request(self, prompt, params, priority=0):
        from llmc.errors import LlmcError

        if len(prompt) > 10:
            raise LlmcError("too long")
        rid = f"r{len(self.running)}-{len(prompt)}"
        self.running[rid] = [0, params.max_new_tokens]
        return rid

    def has_unfinished(self):
        return any(done < total for done, total in self.running.values())

    def step(self):
        from llmc.runtime.engine import RequestOutput

        outputs = []
        for rid, state in self.running.items():
            if state[0] < state[1]:
                state[0] += 1
                finished = state[0] == state[1]
                outputs.append(RequestOutput(rid, [5], "x", finished, "length" if finished else None))
        return outputs


def test_run_workload_records_times_and_errors():
    ticks = iter(range(1000))
    workload = [BenchRequest([1, 2], 3, 0.0), BenchRequest([1] * 20, 3, 0.0), BenchRequest([3], 2, 1.0)]
    result = run_workload(_FakeEngine(), workload, clock=lambda: float(next(ticks)))
    ok, refused, late = result.records
    assert refused.error == "too long" and refused.first_token_s is None
    assert ok.tokens == 3 and late.tokens == 2 and ok.finish_reason == "length"
    assert ok.first_token_s < ok.finish_s and late.first_token_s >= late.arrival_s == 1.0
    summary = summarize(result)
    assert summary["requests"] == 2 and summary["errors"] == 1 and summary["output_tokens"] == 5
    assert sum(result.step_tokens) == 5


class _CountingEngine:
    """An Engine that records, at every step, how many of the requests it was given are unfinished."""

    def __init__(self, engine):
        self.engine, self.unfinished, self.in_step = engine, set(), []

    def add_request(self, prompt, params, priority=0):
        request_id = self.engine.add_request(prompt, params, priority=priority)
        self.unfinished.add(request_id)
        return request_id

    def has_unfinished(self):
        return self.engine.has_unfinished()

    def step(self):
        self.in_step.append(len(self.unfinished))
        outputs = self.engine.step()
        self.unfinished -= {o.request_id for o in outputs if o.finished}
        return outputs

    @property
    def stats(self):
        return self.engine.stats


def test_batch_1_runs_each_request_alone(tiny_llama_engine):
    from llmc.runtime.engine import Engine

    spec = WorkloadSpec(requests=5, prompt_len=4, prompt_len_max=40, output_len=3, output_len_max=9, seed=2)
    workload = make_workload(spec, vocab_size=258)
    engine = _CountingEngine(Engine(tiny_llama_engine, threads=2))
    result = run_workload(engine, workload, concurrency=1)
    assert engine.in_step and max(engine.in_step) == 1 and not engine.unfinished
    records = result.records
    assert [r.tokens for r in records] == [r.output_len for r in workload]
    # Each request arrives (is added) after the one before it finished.
    assert all(later.arrival_s >= earlier.finish_s for earlier, later in zip(records, records[1:]))
    summary = summarize(result)
    assert summary["requests"] == 5 and summary["errors"] == 0 and summary["unfinished"] == 0
    assert summary["batch"] == 1 and summary["decode_tok_s"] > 0


def test_batch_2_keeps_two_in_flight(tiny_llama_engine):
    from llmc.runtime.engine import Engine

    workload = make_workload(WorkloadSpec(requests=5, prompt_len=4, output_len=4, seed=1), vocab_size=258)
    engine = _CountingEngine(Engine(tiny_llama_engine, threads=2))
    result = run_workload(engine, workload, concurrency=2)
    assert max(engine.in_step) == 2 and summarize(result)["output_tokens"] == 20


def test_cli_batch_1_percentiles(tiny_llama_engine):
    summary = bench_json(tiny_llama_engine, *MIXED, "--batch", 1)
    assert KEYS <= summary.keys() and summary["batch"] == 1
    assert summary["requests"] == 8 and summary["errors"] == 0 and summary["unfinished"] == 0
    assert summary["output_tokens"] == requested_outputs()
    for metric in ("ttft_ms", "tpot_ms"):
        assert 0 <= summary[f"{metric}_p50"] <= summary[f"{metric}_p90"] <= summary[f"{metric}_p99"]
    assert summary["decode_tok_s"] > 0 and summary["preemptions"] == 0
    assert 0 <= summary["speculative_tokens_kept"] <= summary["speculative_tokens"]
    plain = bench_json(tiny_llama_engine, *MIXED, "--batch", 1, "--speculative-tokens", 0)
    assert plain["speculative_tokens"] == 0 and plain["output_tokens"] == summary["output_tokens"]
    text = llmc("bench", tiny_llama_engine, "--requests", 2, "--prompt-len", 4, "--output-len", 3, "--batch", 1).stdout
    assert "decode_tok_s" in text and "ttft_ms_p90" in text

