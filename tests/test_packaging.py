"""Packaging: everything installs under the llmc namespace, and start-up stays light."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_installs_only_the_llmc_namespace(tmp_path):
    # Build from a copy: setuptools leaves a build/ folder in the source tree.
    source = shutil.copytree(REPO, tmp_path / "src", ignore=shutil.ignore_patterns(
        ".git", "build", "out", "*.egg-info", "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("llmc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"llmc", "llmc-0.1.0.dist-info"}
    for module in ("llmc/cli.py", "llmc/compiler/export.py", "llmc/runtime/sampler.py",
                   "llmc/models/decoder.py"):
        assert module in names
    entry_points = zipfile.ZipFile(wheel).read("llmc-0.1.0.dist-info/entry_points.txt").decode()
    assert "llmc = llmc.cli:main" in entry_points


def test_cli_start_up_imports_neither_torch_nor_tensorrt():
    code = ("import sys, llmc.cli, llmc.llm, llmc.compiler.build; "
            "print(sorted(m for m in ('torch', 'tensorrt', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
