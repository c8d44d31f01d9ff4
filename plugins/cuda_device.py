"""The NVIDIA GPU this process runs on, as a TensorRT engine records it at build and checks it at
load (formats/manifest.py, `TensorRTBuild`)."""

from __future__ import annotations

import subprocess
from typing import Any

from llmc.errors import LlmcError


def current_gpu() -> dict[str, Any]:
    """This machine's first GPU, by name and compute capability ("9.0"), as the manifest records them."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return {"name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}"}
    except ImportError:
        pass
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()[0]
        name, capability = (part.strip() for part in line.rsplit(",", 1))
        return {"name": name, "compute_capability": capability}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        raise LlmcError("--backend tensorrt: no NVIDIA GPU found (neither torch.cuda nor nvidia-smi sees one)") from None
