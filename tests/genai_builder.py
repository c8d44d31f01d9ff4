"""Test fixture factory: onnxruntime-genai model builder outputs of the seeded checkpoints.

`genai_model(family)` writes `hf_checkpoints.write_hf_checkpoint(folder, family)` and runs

    python -m onnxruntime_genai.models.builder -i CHECKPOINT -o OUT -p fp32 -e cpu -c CACHE

on it (a local folder: no hub access), into a folder cached under ``$LLMC_TEST_CACHE``
(default ``~/.cache/llmc-tests``) by family and builder version, so only the first run pays the
~15 s build. The output holds model.onnx (+ .data), genai_config.json (no config.json) and the
tokenizer as the builder re-saved it.

Import as `from genai_builder import genai_model` (tests/ is on sys.path via tests/conftest.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hf_checkpoints import write_hf_checkpoint
from shared_cache import cache_dir, locked


class BuilderRefused(Exception):
    """The builder cannot convert this family; the message is its last output lines."""


def genai_model(family: str, precision: str = "fp32", real_shape: bool = False) -> tuple[Path, Path]:
    """(checkpoint folder, builder output folder) for `family`, both cached.

    Args:
        family: one of hf_checkpoints.ALL_FAMILIES.
        precision: the builder's -p: fp32, or int4 (MatMulNBits weights), fp16, ...
        real_shape: the checkpoint at hf_checkpoints' real-shape geometry.

    Raises:
        BuilderRefused: the builder failed on this family (tests skip with its reason).
    """
    import onnxruntime_genai

    root = cache_dir() / f"genai-{onnxruntime_genai.__version__}" / (
        (family if precision == "fp32" else f"{family}-{precision}") + ("-real-shape" if real_shape else ""))
    checkpoint, output = root / "checkpoint", root / "genai"
    refused = root / "refused.txt"
    with locked(root):
        if refused.is_file():
            raise BuilderRefused(refused.read_text())
        if not ((output / "model.onnx").is_file() and (checkpoint / "config.json").is_file()):
            _build(root, family, precision, real_shape)
    return checkpoint, output


def _build(root: Path, family: str, precision: str, real_shape: bool) -> None:
    root.mkdir(parents=True, exist_ok=True)
    refused = root / "refused.txt"
    with tempfile.TemporaryDirectory(prefix=".build-", dir=root) as scratch:
        scratch = Path(scratch)
        write_hf_checkpoint(scratch / "checkpoint", family, real_shape=real_shape)
        done = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder",
                               "-i", str(scratch / "checkpoint"), "-o", str(scratch / "genai"),
                               "-p", precision, "-e", "cpu", "-c", str(scratch / "cache")],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            # The last line of the traceback says why (not its ~~~^^^ underlining).
            lines = [line.strip() for line in (done.stdout + done.stderr).splitlines()
                     if line.strip() and set(line.strip()) - set("~^")]
            refused.write_text(f"onnxruntime-genai's builder refuses {family} (exit {done.returncode}): "
                               + (lines[-1] if lines else "no output"))
            raise BuilderRefused(refused.read_text())
        for name in ("checkpoint", "genai"):  # moved in whole, so a half-built folder never counts
            shutil.rmtree(root / name, ignore_errors=True)
            (scratch / name).rename(root / name)
