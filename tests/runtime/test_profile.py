"""`llmc profile`: the report's kinds and parts, and a trace whose events nest and add up.

On the model trained here (data/pystdlib-llama), with prompt-lookup guessing off so that every
decode step takes one token per sequence: the workload's token count is then known without the
profiler (each request's prompt once, and a token per decode step after its first), and the
report's steps must add up to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmc.cli import main

BATCH, PROMPT, NEW = 3, 32, 8


def llmc(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def engine(trained_engine) -> Path:
    return trained_engine


@pytest.fixture(scope="module")
def profiled(engine, tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "trace.json"
    result = llmc("profile", engine, "--batch", BATCH, "--prompt-len", PROMPT, "--new-tokens", NEW,
                  "--speculative-tokens", 0, "--trace", trace, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1]), json.loads(trace.read_text())


def test_report_has_each_step_kind_and_its_parts_add_up(profiled):
    report, _ = profiled
    kinds = report["kinds"]
    assert {"prefill", "decode b1", f"decode b{BATCH}"} <= set(kinds)
    assert kinds["decode b1"]["steps"] == NEW - 1  # the first token comes from the prompt's step
    assert kinds[f"decode b{BATCH}"]["tokens_per_step"] == BATCH
    requests = 1 + BATCH
    tokens = sum(row["steps"] * row["tokens_per_step"] for row in kinds.values())
    assert tokens == pytest.approx(requests * PROMPT + requests * (NEW - 1))
    for kind, row in kinds.items():
        assert sum(row["parts_ms"].values()) == pytest.approx(row["step_ms"], rel=1e-6), kind
        assert min(row["parts_ms"].values()) >= 0, kind
        assert row["parts_ms"].get("onnxruntime", 0) > 0, kind
        operators = sum(entry["ms_per_step"] for entry in row["top_operators"])
        assert 0 < operators <= row["parts_ms"]["onnxruntime"], kind
        # Bounds: the kind's and its matrix products'; the machine measured.
        assert row["bound"]["bound"] in ("memory", "compute") and row["bound"]["fraction"] > 0, kind
        products = [entry for entry in row["top_operators"] if entry["op"] == "MatMul"]
        assert products and all("bound" in entry for entry in products), kind
    assert report["machine"]["memory_bytes_per_s"] > 0 and report["machine"]["flops_per_s"] > 0
    # The batch's prompts go through the segments and the attention kernel.
    assert any("paged attention" in row["parts_ms"] for row in kinds.values())


def _nest(events: list[dict], track: str) -> None:
    """Events of one thread either hold each other or do not overlap (1 µs of rounding)."""
    stack: list[dict] = []
    for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and event["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - 1:
            stack.pop()
        if stack:
            outer = stack[-1]
            assert event["ts"] + event["dur"] <= outer["ts"] + outer["dur"] + 1, \
                f"{track}: {event['name']} overlaps {outer['name']} without nesting"
        stack.append(event)


def test_trace_events_nest_and_add_up_to_the_wall_time(profiled):
    report, trace = profiled
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"engine", "onnxruntime", "kernel"} <= set(names.values())
    for tid, track in names.items():
        _nest([e for e in events if e["tid"] == tid], track)
    steps = [e for e in events if names[e["tid"]] == "engine" and e["name"] == "step"]
    assert len(steps) == sum(row["steps"] for row in report["kinds"].values())
    assert sum(e["dur"] for e in steps) == pytest.approx(report["wall_s"] * 1e6, rel=0.05)
    # Every onnxruntime call inside a step's execute; every operator inside a call.
    executes = [e for e in events if e["name"] == "execute"]
    calls = [e for e in events if names[e["tid"]] == "onnxruntime" and e["cat"] != "operator"]
    operators = [e for e in events if e["cat"] == "operator"]
    assert calls and operators
    for inner, outers in ((calls, executes), (operators, calls)):
        for event in inner:
            assert any(o["ts"] - 1 <= event["ts"] and event["ts"] + event["dur"] <= o["ts"] + o["dur"] + 1
                       for o in outers), event["name"]


@pytest.mark.parametrize("args, message", [
    (("--batch", 0), "--batch: must be an integer ≥ 1"),
    (("--new-tokens", 0), "--new-tokens: must be an integer ≥ 1"),
    (("--prompt-len", 500, "--new-tokens", 20), "more than the engine's 512 positions"),
    (("--threads", 0), "--threads: must be ≥ 1"),
])
def test_bad_options_get_one_line(engine, args, message):
    result = llmc("profile", engine, *args, "--no-bounds")
    assert result.exit_code == 2
    assert message in result.output and result.output.count("\n") <= 2, result.output


def test_bad_files_get_one_line_and_no_trace(engine, tmp_path):
    missing = llmc("profile", tmp_path / "none.plan")
    assert missing.exit_code == 2 and "none.plan: no such file" in missing.output
    trace = tmp_path / "absent" / "trace.json"
    folder = llmc("profile", engine, "--trace", trace, "--no-bounds")
    assert folder.exit_code == 2 and "--trace" in folder.output and not trace.exists()
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    text = llmc("profile", engine, "--text", short, "--no-bounds", "--trace", tmp_path / "t.json")
    assert text.exit_code == 2 and "short.txt" in text.output and "--prompt-len 128" in text.output
    assert not (tmp_path / "t.json").exists()


def test_an_engine_without_a_timeline_records_nothing(engine):
    from llmc.runtime.engine import Engine
    from llmc.runtime.timeline import OFF

    llm = Engine(engine)
    assert llm.timeline is OFF and llm.backend.timeline is OFF
