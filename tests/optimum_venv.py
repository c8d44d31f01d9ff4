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
`helper_python` builds such a venv for any pins (bench/openvino_peer.py's OpenVINO GenAI has one).
"""

from __future__ import annotations

import hashlib
import os
import site
import subprocess
import sys
from pathlib import Path

from shared_cache import cache_dir, locked

CACHE = cache_dir()
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
    return helper_python("optimum", [OPTIMUM_REQUIREMENT])


def helper_python(name: str, requirements: list[str], cache: Path = CACHE, unwanted: tuple[str, ...] = ()) -> Path:
    """The python of a venv over the running environment holding `requirements`, built on first use.

    Args:
        name: the venv's folder prefix under `cache` (one venv per name and running environment).
        requirements: pip requirement strings; the venv is rebuilt when they change.
        cache: where the venv and its lock file live.
        unwanted: packages pip pulls in as dependencies that must not stay (one whose wheel cannot
            load beside the running environment's, and that the helper's work never imports).

    Raises:
        ExporterUnavailable: pip could not install the requirements (e.g. no registry reachable).
    """
    key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
    venv = cache / f"{name}-venv-{key}"
    python = venv / "bin" / "python"
    ready = venv / ".llmc-ready"
    stamp = f"{' '.join(requirements)} over {sys.prefix}" + "".join(f" without {package}" for package in unwanted)
    with locked(venv):
        if ready.is_file() and ready.read_text() == stamp:
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
        lines = [f"import site; site.addsitedir({folder!r})" for folder in running_site_packages()]
        Path(own, "llmc-running-environment.pth").write_text("\n".join(lines) + "\n")
        install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *requirements],
                                 capture_output=True, text=True)
        if install.returncode:
            last = (install.stderr.strip().splitlines() or ["no output"])[-1]
            raise ExporterUnavailable(f"pip install {' '.join(requirements)} failed: {last}")
        if unwanted:
            subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "--yes", *unwanted], check=True)
        ready.write_text(stamp)
    return python
