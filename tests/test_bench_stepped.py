"""bench/stepped.py: two loaded workers take each measurement step in turn (the short rows' steps
several times, alternating), answer on a clean channel, and one that fails is reported without
stopping the other."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import stepped  # noqa: E402

# A worker whose every step reports when it ran, prints noise on stdout as libraries do, and
# fails at the step its job names.
FAKE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {bench!r})
    import stepped

    def start(job):
        print("a library's progress on stdout")
        def step(name):
            def run(take):
                print("more noise")
                if name == job.get("fail_at"):
                    raise RuntimeError("broken on purpose")
                return {{name: time.perf_counter(), name + "_take": take}}
            return run
        return {{"loaded": job["system"]}}, {{name: step(name) for name in stepped.STEPS if name != "texts"}}

    stepped.serve(start)
""")


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE.format(bench=str(REPO / "bench")))
    return script


def _start(script: Path, **job):
    return lambda: stepped.Worker([sys.executable, str(script)], job)


def test_a_pair_takes_each_step_in_turn(fake):
    takes = 3
    first, second = stepped.run_pair([_start(fake, system="a"), _start(fake, system="b")], takes)
    assert len(first) == len(second) == takes
    assert first[0]["loaded"] == "a" and second[0]["loaded"] == "b"
    assert "texts" not in first[0] and "texts" not in second[0]  # a step a worker lacks answers {}
    # a's step, then b's same step, then a's next (or its next take): never two of one worker's
    # steps in a row; the steps taken again once a take, the rest once
    order = [(step, take) for step in stepped.STEPS if step != "texts"
             for take in range(takes if step in stepped.TAKEN_AGAIN else 1)]
    times = [figures[take][step] for step, take in order for figures in (first, second)]
    assert times == sorted(times)
    for figures in (first, second):
        assert [set(figures[take]) for take in range(1, takes)] == \
            [{k for step in stepped.TAKEN_AGAIN for k in (step, step + "_take")}] * (takes - 1)
        assert all(figures[take][step + "_take"] == take for step in stepped.TAKEN_AGAIN for take in range(takes))


def test_a_worker_that_fails_is_reported_and_its_partner_finishes(fake):
    broken, whole = stepped.run_pair([_start(fake, system="a", fail_at="ttft"), _start(fake, system="b")], 2)
    assert isinstance(broken, RuntimeError) and "a worker exited with 1" in str(broken)
    assert set(whole[0]) >= {"warmup", "decode", "ttft", "batch", "done", "profile"}
    assert set(whole[1]) >= {"decode", "ttft", "batch"}


def test_a_worker_that_cannot_start_is_reported(tmp_path):
    missing = tmp_path / "missing.py"
    (figures,) = stepped.run_pair([_start(missing, system="gone")], 2)
    assert isinstance(figures, RuntimeError) and "gone worker exited with 2" in str(figures)


def test_a_worker_gone_before_it_reads_its_job_is_reported():
    # A job larger than a pipe holds: writing it fails once the process has exited unread.
    def start():
        return stepped.Worker([sys.executable, "-c", "raise SystemExit(3)"], {"system": "gone", "pad": "x" * (1 << 20)})
    (figures,) = stepped.run_pair([start], 2)
    assert isinstance(figures, RuntimeError) and "gone worker exited with 3" in str(figures)
