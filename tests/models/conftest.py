"""Fixtures for the model tests. `tests/conftest.py` puts `tests/` on sys.path for `hf_checkpoints`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hf_checkpoints import write_hf_checkpoint


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`get(family, sharded=False) -> folder`: HF checkpoints written once per session; treat as read-only."""
    folders: dict[tuple[str, bool], Path] = {}

    def get(family: str, sharded: bool = False) -> Path:
        key = (family, sharded)
        if key not in folders:
            name = f"{family}-{'sharded' if sharded else 'single'}"
            folders[key] = write_hf_checkpoint(tmp_path_factory.mktemp(name), family, sharded=sharded)
        return folders[key]

    return get
