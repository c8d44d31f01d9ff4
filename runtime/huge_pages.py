"""Transparent huge pages behind a process's heap, where glibc and the kernel allow them.

A decode step reads every weight once, and onnxruntime's and OpenVINO's prepacked weights live on
malloc's heap: with 4 KiB pages the step walks the page tables every 4 KiB of them. Backed by
2 MiB pages, measured on SmolLM2-135M on a 2-core Xeon, each engine in two processes alternating:
batch-1 decode 6-12% faster at int4 and 4-8% at fp32 (onnxruntime), 14% at int4 on the OpenVINO
backend, a 128-token prompt 4% faster, a static batch of 16 the same; resident memory 5-15 MiB more.
Loading is slower with them where much memory is new to the process (load and first token:
SmolLM2 bf16 on OpenVINO 6.8 s against 4.6 s, medians of 6 alternating loads; a 1B fp32 engine
17.7-21.2 s against 6.6-14.7 s, 2 loads each; SmolLM2 fp32 on onnxruntime the same).

glibc reads its malloc tunables once, as the process starts. So the `llmc` commands that keep an
engine loaded start themselves again with them set (`restart_with_huge_pages`, called by
cli/common.py `entry`); a program that loads engines through the Python API gets them by starting
with `GLIBC_TUNABLES` as `environment` gives it (the benchmarks' llmc workers do).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

TUNABLES = {
    "glibc.malloc.hugetlb": "1",  # malloc advises huge pages (MADV_HUGEPAGE) for what it maps
    # The heap grows 32 MiB at a time, keeps up to 128 MiB free at its top, and holds allocations
    # below 8 MiB. Measured on SmolLM2-135M (medians of 5 loads, load + first token): hugetlb
    # alone took 1.9 s instead of 1.2 (fp32) and held 105 MiB more resident (OpenVINO bf16);
    # these, 1.2 s, and +5 and +15 MiB. Holding allocations up to 32 MiB cost OpenVINO 240 MiB
    # more resident; leaving the threshold at glibc's 128 KiB (which setting top_pad fixes) left a
    # third of the fp32 weights on small pages, and fp32 decode no faster.
    "glibc.malloc.mmap_threshold": str(8 << 20),
    "glibc.malloc.top_pad": str(32 << 20),
    "glibc.malloc.trim_threshold": str(128 << 20),
}
OPT_OUT = "LLMC_HUGE_PAGES"  # "0": leave malloc as it is
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MIN_GLIBC = (2, 35)  # the first with glibc.malloc.hugetlb


def unavailable(env: Mapping[str, str] = os.environ) -> str | None:
    """Why this process's heap cannot be on huge pages, or None when it can."""
    if env.get(OPT_OUT) == "0":
        return f"{OPT_OUT}=0"
    if not sys.platform.startswith("linux"):
        return f"{sys.platform}: transparent huge pages are Linux's"
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""
    name, _, version = libc.partition(" ")
    if name != "glibc":
        return "the C library is not glibc"
    if tuple(int(part) for part in version.split(".")[:2] if part.isdigit()) < MIN_GLIBC:
        return f"glibc {version} has no glibc.malloc.hugetlb (2.35 and later)"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return f"{THP_SETTING}: the kernel has no transparent huge pages"
    if "[never]" in setting:
        return f"{THP_SETTING}: never"
    return None


def environment(env: Mapping[str, str] = os.environ) -> dict[str, str] | None:
    """`env` with `TUNABLES` added to its GLIBC_TUNABLES, or None when huge pages are unavailable
    or `env` already names glibc.malloc.hugetlb (the user's choice stands). Tunables it already
    sets keep their values."""
    given = _given(env)
    if unavailable(env) is not None or "glibc.malloc.hugetlb" in given:
        return None
    tunables = {**TUNABLES, **given}
    return {**env, "GLIBC_TUNABLES": ":".join(f"{name}={value}" for name, value in tunables.items())}


def _given(env: Mapping[str, str]) -> dict[str, str]:
    """The tunables `env`'s GLIBC_TUNABLES sets, by name."""
    items = (item.partition("=") for item in env.get("GLIBC_TUNABLES", "").split(":") if item)
    return {name: value for name, _, value in items}


def restart_with_huge_pages() -> None:
    """Start this process again, as it was started, with `environment`'s tunables, where they are
    available and not yet set; returns only when they are not (or the interpreter is unknown)."""
    changed = environment()
    if changed is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, changed)


def summary() -> str:
    """One line on whether llmc's processes run engines with their heap on huge pages here."""
    reason = unavailable()
    if reason is not None:
        return f"4 KiB pages ({reason})"
    if _given(os.environ).get("glibc.malloc.hugetlb", "1") != "1":
        return f"as GLIBC_TUNABLES sets ({os.environ['GLIBC_TUNABLES']})"
    return "2 MiB transparent huge pages behind the heap (llmc serve, bench and profile set GLIBC_TUNABLES)"
