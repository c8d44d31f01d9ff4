"""`llmc bench --profile`: the breakdown of a second, profiled run of the benchmark's workload.

On the model trained here (data/pystdlib-llama), with prompt-lookup guessing off so that every
decode step takes one token per sequence: the workload's token count is then known without the
profiler (each prompt once, and a token per decode step after each request's first), and so is
its step count (the timed run's: the same workload through the same scheduler).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc.cli import main

REQUESTS, PROMPT, OUTPUT = 4, 16, 8
WORKLOAD = ["--requests", REQUESTS, "--prompt-len", PROMPT, "--output-len", OUTPUT, "--speculative-tokens", 0,
            "--threads", 2]


def llmc(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def engine(trained_engine) -> Path:
    return trained_engine


def test_profile_covers_the_timed_workload_step_for_step(engine):
    result = llmc("bench", engine, *WORKLOAD, "--profile", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["requests"] == REQUESTS and summary["output_tokens"] == REQUESTS * OUTPUT
    profile = summary["profile"]
    kinds = profile["kinds"]
    assert "prefill" in kinds and f"decode b{REQUESTS}" in kinds
    tokens = sum(row["steps"] * row["tokens_per_step"] for row in kinds.values())
    assert tokens == pytest.approx(REQUESTS * PROMPT + REQUESTS * (OUTPUT - 1))
    assert sum(row["steps"] for row in kinds.values()) == summary["steps"]
    for kind, row in kinds.items():
        assert sum(row["parts_ms"].values()) == pytest.approx(row["step_ms"], rel=1e-6), kind
        assert row["parts_ms"].get("onnxruntime", 0) > 0 and row["top_operators"], kind
        assert "bound" in row, kind
    assert profile["machine"]["memory_bytes_per_s"] > 0 and profile["machine"]["flops_per_s"] > 0


def test_profile_one_at_a_time_is_rendered_after_the_figures(engine):
    result = llmc("bench", engine, *WORKLOAD, "--batch", 1, "--profile")
    assert result.exit_code == 0, result.output
    figures, _, breakdown = result.stdout.partition("where the time went")
    assert "throughput_tok_s" in figures and "decode b1" not in figures
    # each request alone: its prompt, then OUTPUT - 1 decodes at batch 1
    assert f"decode b1: {REQUESTS * (OUTPUT - 1)} steps" in breakdown
    assert f"prefill: {REQUESTS} steps" in breakdown and "onnxruntime" in breakdown


def test_profile_with_url_is_refused_in_one_line(engine):
    result = llmc("bench", engine, "--url", "http://127.0.0.1:9", "--profile")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmc: error: --profile: not with --url"), result.stderr
