"""Every pass by name: an explicit list, checked for duplicate names at import."""

from __future__ import annotations

from llmc.passes.base import Pass

_ALL: list[type[Pass]] = []

PASSES: dict[str, type[Pass]] = {}
for _cls in _ALL:
    if _cls.name in PASSES:
        raise RuntimeError(f"two passes are named '{_cls.name}'")
    PASSES[_cls.name] = _cls
