"""The test cache, and locks for what test processes running side by side (`pytest -n 2`) make once.

Downloads and builds that outlive a run live under ``$LLMC_TEST_CACHE`` (default
``~/.cache/llmc-tests``): SmolLM2, the onnxruntime-genai builds, the TensorRT bindings wheel, the
Optimum venv. Each is checked for and made while holding a lock of its own (`locked`), so that a
second process waits for the first's instead of making it again or replacing a folder the first
is reading. Standard library only: a bare interpreter builds the Optimum venv with it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("LLMC_TEST_CACHE", Path.home() / ".cache" / "llmc-tests"))


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (the lock file is `path` + ".lock" beside it) against
    every other process asking for it; released on leaving, or when the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
