"""runtime/huge_pages.py: the tunables added to a process's environment, and the `llmc` command
starting itself again with them, where glibc then puts the heap on huge pages."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest

from llmc.runtime import huge_pages


@pytest.fixture
def thp(tmp_path, monkeypatch):
    """A kernel setting file this test controls (the machine's own may say never)."""
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    monkeypatch.setattr(huge_pages.sys, "platform", "linux")
    monkeypatch.setattr(huge_pages.os, "confstr", lambda name: "glibc 2.36")
    return setting


def tunables(env: dict[str, str]) -> dict[str, str]:
    return dict(item.split("=") for item in env["GLIBC_TUNABLES"].split(":"))


def test_environment_adds_the_tunables_and_keeps_the_users(thp):
    env = huge_pages.environment({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.top_pad=1"})
    assert env["PATH"] == "/bin"
    assert tunables(env) == {**huge_pages.TUNABLES, "glibc.malloc.arena_max": "2", "glibc.malloc.top_pad": "1"}
    assert tunables(huge_pages.environment({})) == huge_pages.TUNABLES


@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, {"LLMC_HUGE_PAGES": "0"}])
def test_the_users_choice_stands(thp, env):
    assert huge_pages.environment(env) is None


@pytest.mark.parametrize("setting, platform, libc, reason", [
    ("always madvise [never]\n", "linux", "glibc 2.36", "never"),
    (None, "linux", "glibc 2.36", "no transparent huge pages"),
    ("[always] madvise never\n", "linux", "glibc 2.31", "2.35 and later"),
    ("[always] madvise never\n", "linux", "", "not glibc"),
    ("[always] madvise never\n", "darwin", "glibc 2.36", "Linux's"),
])
def test_unavailable_says_why(thp, monkeypatch, setting, platform, libc, reason):
    if setting is None:
        thp.unlink()
    else:
        thp.write_text(setting)
    monkeypatch.setattr(huge_pages.sys, "platform", platform)
    monkeypatch.setattr(huge_pages.os, "confstr", lambda name: libc)
    assert reason in huge_pages.unavailable({})
    assert huge_pages.environment({}) is None
    assert reason in huge_pages.summary()


def test_the_restarted_commands_own_their_process():
    """`entry` restarts only commands that own their process for an engine (they share one
    thread pool): serving and measuring it, not running one job."""
    from llmc.cli import main
    from llmc.cli.common import ENGINE_COMMANDS

    owning = {name for name, command in main.commands.items()
              if "share_threads(" in inspect.getsource(sys.modules[command.callback.__module__])}
    assert set(ENGINE_COMMANDS) == owning - {"run", "check"}


# Run twice when `entry` restarts it: only the restarted process, with the tunables, measures its
# heap: 24 MiB from malloc (bytes; numpy asks for huge pages itself), below the mmap threshold.
CHILD = textwrap.dedent("""
    import os, sys
    if "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", ""):
        block = b"x" * (24 << 20)
        with open("/proc/self/smaps_rollup") as f:
            huge = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
        print("restarted", os.environ["GLIBC_TUNABLES"], huge, flush=True)
    sys.argv = ["llmc", *sys.argv[1:]]
    from llmc.cli import entry
    entry()
""")


@pytest.mark.skipif(huge_pages.unavailable({}) is not None, reason=f"{huge_pages.unavailable({})}")
@pytest.mark.parametrize("command, restarts", [(["serve", "--help"], True), (["--debug", "bench", "--help"], True),
                                               (["run", "--help"], False), (["inspect", "--help"], False)])
def test_llmc_command_restarts_with_huge_pages(command, restarts):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", huge_pages.OPT_OUT)}
    done = subprocess.run([sys.executable, "-c", CHILD, *command], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Usage: llmc" in done.stdout
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("restarted")]
    if not restarts:
        assert lines == []
        return
    [(_, given, huge)] = lines
    assert dict(item.split("=") for item in given.split(":")) == huge_pages.TUNABLES
    assert int(huge) >= 16 << 10, "glibc did not put the 24 MiB block on huge pages"


def test_docs_give_the_tunables():
    """docs/running.md's command line for a Python program is the one the `llmc` command uses."""
    from pathlib import Path

    docs = (Path(huge_pages.__file__).parents[1] / "docs" / "running.md").read_text()
    assert "GLIBC_TUNABLES=" + ":".join(f"{k}={v}" for k, v in huge_pages.TUNABLES.items()) + " python" in docs
