"""A process killed during `llmc compile` leaves no engine or a complete one, never a torn file.

`llmc compile` runs as a subprocess and gets SIGKILL at fractions of one measured compile, then
from a driver that kills it from inside the engine writer: once a chunk has reached the temporary
file, and just before the temporary is renamed over the engine. Every kill goes into the same
folder, as repeated crashes would; a last compile into it must then succeed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


from llmc.formats.engine_file import read_engine

ENGINE = "engine.plan"

# Runs `llmc <argv>` with the engine writer patched to SIGKILL the process at `stage`.
DRIVER = """
import glob, os, signal, sys
import llmc.formats.engine_file as engine_file
from llmc.cli import main

stage, folder, argv = sys.argv[1], sys.argv[2], sys.argv[3:]

def temporaries():
    return glob.glob(os.path.join(folder, ".engine.plan.*"))

if stage == "first-chunk":
    chunks = engine_file._chunks  # the payload pieces write_engine writes
    def killing_chunks(data):
        for chunk in chunks(data):
            yield chunk
            if temporaries():  # resumed after the writer wrote this chunk to the temporary
                os.kill(os.getpid(), signal.SIGKILL)
    engine_file._chunks = killing_chunks
elif stage == "before-rename":
    replace = os.replace
    def killing_replace(src, dst, *args, **kwargs):
        if os.path.basename(str(src)).startswith(".engine.plan."):
            os.kill(os.getpid(), signal.SIGKILL)
        return replace(src, dst, *args, **kwargs)
    os.replace = killing_replace
main(argv)
"""


def compile_args(onnx: Path, folder: Path) -> list[str]:
    return ["compile", str(onnx), "-o", str(folder / ENGINE)]


STAGES = ("first-chunk", "before-rename")


def kill_in_writer(stage: str, onnx: Path, folder: Path) -> None:
    killed = subprocess.run([sys.executable, "-c", DRIVER, stage, str(folder), *compile_args(onnx, folder)],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, (stage, killed.stderr)  # the hook fired


def assert_no_engine_or_a_complete_one(folder: Path, when: str) -> None:
    if (folder / ENGINE).exists():
        read_engine(folder / ENGINE)  # checks the header, the manifest and every section's SHA-256
    # Anything else is hidden scratch a SIGKILL leaves behind (the writer's .engine.plan.XXXX, the
    # compiler's .llmc-XXXX folder), never a file that looks like a finished engine.
    others = [p.name for p in folder.iterdir() if p.name != ENGINE]
    assert all(name.startswith((f".{ENGINE}.", ".llmc-")) for name in others), (when, others)
    assert not [name for name in others if name.endswith(".plan")], (when, others)


def test_killed_compile_leaves_no_engine_or_a_complete_one(tiny_llama_onnx, tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "llmc.cli", *compile_args(tiny_llama_onnx, reference)],
                          capture_output=True, text=True, timeout=300)
    duration = time.monotonic() - start
    assert done.returncode == 0, done.stderr

    folder = tmp_path / "killed"
    folder.mkdir()
    for fraction in (0.1, 0.4, 0.7, 0.95):
        process = subprocess.Popen([sys.executable, "-m", "llmc.cli", *compile_args(tiny_llama_onnx, folder)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(duration * fraction)
        process.send_signal(signal.SIGKILL)  # a no-op if it already finished: then the engine must be whole
        process.wait(timeout=60)
        assert_no_engine_or_a_complete_one(folder, f"killed at {fraction:.0%}")
        (folder / ENGINE).unlink(missing_ok=True)  # the next kill starts from no engine again

    for stage in STAGES:
        kill_in_writer(stage, tiny_llama_onnx, folder)
        assert not (folder / ENGINE).exists(), stage
        assert_no_engine_or_a_complete_one(folder, stage)

    assert [p for p in folder.iterdir() if p.name.startswith(f".{ENGINE}.")]  # the killed writers' leftovers
    done = subprocess.run([sys.executable, "-m", "llmc.cli", *compile_args(tiny_llama_onnx, folder)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert_no_engine_or_a_complete_one(folder, "after a clean compile")
    # The next compile removes what the dead ones left: nothing piles up.
    assert sorted(p.name for p in folder.iterdir()) == [ENGINE]

    # Recompiling over an engine and dying in the writer keeps the old engine, byte for byte.
    before = (folder / ENGINE).read_bytes()
    for stage in STAGES:
        kill_in_writer(stage, tiny_llama_onnx, folder)
        assert (folder / ENGINE).read_bytes() == before, stage
        assert_no_engine_or_a_complete_one(folder, f"{stage}, over an engine")

