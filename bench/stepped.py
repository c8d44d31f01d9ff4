"""Measurement workers kept loaded and stepped in turn, so that two systems' figures of a row are
taken seconds apart, not a minute.

This machine's speed drifts by up to 30% within a minute. A pair of systems measured one whole
run after the other sees different drift in each; loaded side by side, each row measured by one
and then at once by the other, the two see the same. A worker is a process of its own (its own
interpreter and venv where it needs one): the first line on its stdin is its job, each later line
names a step, and it answers each with one JSON line; only the step's own work runs while the
other worker waits on its stdin.

The rows that time a request (one request's decode, the long prompt, the 128-token prompts, the
batch) are each taken `takes` times, the workers alternating (A B A B ...), each take on fresh
prompts: a ratio per take, a second or two apart, rather than one per run. A take is its own set
of figures.

Standard library only: OpenVINO GenAI's worker imports it in a venv of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Callable

# A run's steps, in order. A worker answers a step it has nothing for with {}; the ones that
# drop state another needs (OpenVINO GenAI's batch frees its single-request pipeline) come last.
STEPS = ("warmup", "decode", "texts", "long", "ttft", "batch", "done", "profile")
TAKEN_AGAIN = ("decode", "long", "ttft", "batch")  # the steps taken `takes` times


Step = Callable[[int], dict[str, Any]]  # a step's figures at its take (0, 1, ...: which prompts it uses)


def serve(start: Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Step]]]) -> None:
    """The worker's side: `start(job)` loads and returns the ready figures and the steps; each step
    read from stdin (its name and take) is answered on stdout. Anything else written to stdout (a
    library's progress) goes to stderr, so that stdout carries the answers alone."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    ready, steps = start(json.loads(sys.stdin.readline()))
    _answer(answers, ready)
    for line in sys.stdin:
        asked = json.loads(line)
        step = steps.get(asked["step"])
        _answer(answers, step(asked["take"]) if step else {})


def _answer(answers, figures: dict[str, Any]) -> None:
    answers.write(json.dumps(figures) + "\n")
    answers.flush()


def huge_pages_mib() -> float | None:
    """This process's memory on transparent huge pages (MiB), which a worker reports once loaded
    (llmc's workers start with malloc's heap on them: runtime/huge_pages.py)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(round(int(line.split()[1]) / 1024, 1) for line in f if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration):
        return None


class Worker:
    """The driver's side: `command` started with `job`, loaded once `ready` is read."""

    def __init__(self, command: list[str], job: dict[str, Any], env: dict[str, str] | None = None):
        self.name = job.get("system", command[-1])
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._send(job)
        self.ready = self._read()

    def step(self, name: str, take: int = 0) -> dict[str, Any]:
        self._send({"step": name, "take": take})
        return self._read()

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:  # it has exited (or could not start): `_read` says with what code
            try:
                self.process.stdin.close()
            except BrokenPipeError:  # the line still buffered: closed all the same
                pass

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
        if self.process.wait() != 0:
            raise RuntimeError(f"{self.name} worker exited with {self.process.returncode} (its error is above)")

    def _read(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:  # its stdout closed: it has exited, or is exiting
            try:
                code = self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                code = self.process.wait()
            raise RuntimeError(f"{self.name} worker exited with {code} (its error is above)")
        return json.loads(line)


def run_pair(workers: list[Callable[[], Worker]], takes: int = 1) -> list[list[dict[str, Any]] | Exception]:
    """Each worker started in turn (loads do not overlap), then STEPS, each taken by every worker
    before the next step (TAKEN_AGAIN's `takes` times, alternating); a worker's figures, one dict
    a take (the first also holds the ready figures and the steps taken once), or the error that
    stopped it (the others go on)."""
    figures: list[list[dict[str, Any]] | Exception] = []
    started: list[Worker | None] = []
    for make in workers:
        try:
            worker = make()
            started.append(worker)
            figures.append([dict(worker.ready)] + [{} for _ in range(takes - 1)])
        except Exception as exc:  # a peer that cannot load is a result, not the end of the pair
            started.append(None)
            figures.append(exc)
    for step in STEPS:
        for take in range(takes if step in TAKEN_AGAIN else 1):
            for n, worker in enumerate(started):
                if worker is None:
                    continue
                try:
                    figures[n][take].update(worker.step(step, take))
                except Exception as exc:
                    started[n], figures[n] = None, exc
    for n, worker in enumerate(started):
        if worker is not None:
            try:
                worker.close()
            except Exception as exc:
                figures[n] = exc
    return figures
