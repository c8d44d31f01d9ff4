"""What this machine's CPU computes natively, read from /proc/cpuinfo: the compiler's bf16 check
(precision/bf16.py) and the OpenVINO backend's choice of compute precision both ask."""

from __future__ import annotations

from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # flags under which OpenVINO computes bf16 natively


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_bf16(flags: frozenset[str]) -> list[str]:
    """The flags in `flags` that give bf16 arithmetic, sorted (empty: none)."""
    return sorted(set(BF16_FLAGS) & flags)
