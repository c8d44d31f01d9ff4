"""What every benchmark's JSON carries beside its figures, so that a figure can be traced to the
command, machine, load and commit that produced it (bench/results.py renders it).

    began = record.begin()              # at the start: UTC time, load average, the command line
    ...
    result["record"] = record.finish(began)
    record.write_json(path, result)     # atomic: a reader never sees half a file
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent

#: the keys finish() writes; bench/results.py refuses a file missing one of them
FIELDS = ("command", "utc_start", "utc_end", "machine", "git", "versions")
MACHINE_FIELDS = ("cpu", "cores", "memory_gib", "loadavg_start", "loadavg_end")


#: environment variables that change what llmc runs (runtime/huge_pages.py OPT_OUT), named here
#: so that recording a run imports nothing of llmc: set, they lead the recorded command line
RUN_SETTINGS = ("LLMC_HUGE_PAGES",)


def begin(argv: list[str] | None = None) -> dict[str, Any]:
    """The state at a benchmark's start: its command line (as typed from the repository root,
    after the RUN_SETTINGS it runs with), the UTC time and the load average."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    settings = [f"{name}={os.environ[name]}" for name in RUN_SETTINGS if name in os.environ]
    return {"command": " ".join([*settings, "python", str(script), *argv[1:]]),
            "utc_start": _utc_now(), "loadavg_start": _loadavg()}


def finish(began: dict[str, Any]) -> dict[str, Any]:
    """The record to store under a result's "record" key: begin()'s fields, the load average and
    UTC time now, the machine, the commit and the library versions."""
    return {"command": began["command"], "utc_start": began["utc_start"], "utc_end": _utc_now(),
            "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "memory_gib": memory_gib(),
                        "loadavg_start": began["loadavg_start"], "loadavg_end": _loadavg()},
            "git": git_state(), "versions": versions()}


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    """Write `result` as indented JSON to `path` through a temporary file and a rename."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(temporary, path)


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def git_state() -> dict[str, Any]:
    """The commit the benchmark ran on and whether the working tree differed from it."""
    def git(*command: str) -> str:
        done = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for package in ("onnxruntime", "onnxruntime-genai", "onnx", "torch", "transformers", "llmc"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[package] = metadata.version(package)
    return found


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
