"""The Optimum helper venv: Optimum's pins beside the packages of the environment running the tests.

optimum-onnx 0.1.0 pins transformers < 4.58 and the project runs transformers 5, so Optimum lives in
a venv of its own (tests/README.md). That venv must see the torch, onnx and onnxruntime of the
environment the suite runs in, whatever that is (a system-wide install, a fresh venv, a venv over
system packages), and nothing else:

- `python -m venv` without ``--system-site-packages``, which would expose the *base* interpreter's
  packages, not the running venv's (in a fresh venv those lack onnx and onnxruntime);
- a ``.pth`` file in it that runs ``site.addsitedir`` on each site-packages folder of the running
  interpreter. The venv's own folder stays first on sys.path, so what pip installs there
  (transformers 4.57, optimum) shadows the running environment's; ``addsitedir`` (not a plain path
  line) also processes those folders' own ``.pth`` files, as the running interpreter does;
- pip then installs only what the running environment lacks or pins differently: the same torch
  (the CPU build, no second multi-GB download), the same onnx and onnxruntime as the suite's.

The venv is cached under ``$LLMC_TEST_CACHE`` (default ``~/.cache/llmc-tests``), one per running
environment (keyed by its prefix), built once under a file lock. It imports only the standard
library, so a bare interpreter can build it (tests/test_optimum_venv.py does, from a fresh venv).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import site
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("LLMC_TEST_CACHE", Path.home() / ".cache" / "llmc-tests"))
OPTIMUM_REQUIREMENT = "optimum-onnx==0.1.0"


class ExporterUnavailable(RuntimeError):
    """The exporter cannot run on this machine (its package could not be installed)."""


def running_site_packages() -> list[str]:
    """The running interpreter's site-packages folders that are on its sys.path, in that order."""
    known = {*site.getsitepackages(), site.getusersitepackages()}
    return [folder for folder in dict.fromkeys(sys.path) if folder in known and os.path.isdir(folder)]


def optimum_python() -> Path:
    """The python of the Optimum venv of the running environment, built on first use.

    Raises:
        ExporterUnavailable: pip could not install the package (e.g. no registry reachable).
    """
    key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
    venv = CACHE / f"optimum-venv-{key}"
    python = venv / "bin" / "python"
    ready = venv / ".llmc-ready"
    stamp = f"{OPTIMUM_REQUIREMENT} over {sys.prefix}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"optimum-venv-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.is_file() and ready.read_text() == stamp:
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
        lines = [f"import site; site.addsitedir({folder!r})" for folder in running_site_packages()]
        Path(own, "llmc-running-environment.pth").write_text("\n".join(lines) + "\n")
        install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", OPTIMUM_REQUIREMENT],
                                 capture_output=True, text=True)
        if install.returncode:
            last = (install.stderr.strip().splitlines() or ["no output"])[-1]
            raise ExporterUnavailable(f"pip install {OPTIMUM_REQUIREMENT} failed: {last}")
        ready.write_text(stamp)
    return python
