"""What this machine's CPU computes natively, and who made it, read from /proc/cpuinfo: the
compiler's bf16 check (precision/bf16.py) and the OpenVINO backend's choice of compute precision
both ask."""

from __future__ import annotations

from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # flags under which OpenVINO computes bf16 natively


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    return frozenset(_field("flags", cpuinfo).split())


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD"; empty where /proc/cpuinfo cannot be read)."""
    return _field("vendor_id", cpuinfo).strip()


def _field(name: str, cpuinfo: str) -> str:
    """The value of the first processor's `name` line in /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value
    return ""


def native_bf16(flags: frozenset[str]) -> list[str]:
    """The flags in `flags` that give bf16 arithmetic, sorted (empty: none)."""
    return sorted(set(BF16_FLAGS) & flags)
