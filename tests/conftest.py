"""Shared fixtures, made once per test run: tiny-llama exported and compiled, the trained
model, and the random-weight Hugging Face checkpoints with their exports (a torch.onnx dynamo
export of a 2-layer model takes 6-11 s; several modules test the same ones). Under pytest-xdist
(`pytest -n 2`) the workers share them: the first to ask makes one, the others wait for it
(`made_once`).

pytest runs with --import-mode=importlib, which does not put test folders on sys.path; this
file adds `tests/` so that fixture factories (`hf_checkpoints`) import by plain name.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

from shared_cache import locked  # noqa: E402  (found through the path just added)


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]):
    """`make(folder)`'s result (JSON-able), made once per run in an empty `folder` of its own by
    whichever pytest-xdist worker asks first; the others wait, then read the result it recorded.
    A `make` that raises records nothing: the next to ask tries again."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common folder
    folder, result = root / name, root / f"{name}.json"
    with locked(folder):
        if not result.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            staged = result.with_suffix(".partial")
            staged.write_text(json.dumps(make(folder)))
            staged.replace(result)
    return json.loads(result.read_text())


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`get(family, sharded=False) -> folder`: tests/hf_checkpoints.py's checkpoints, written once
    per run (`made_once`); treat as read-only."""
    from hf_checkpoints import write_hf_checkpoint

    def get(family: str, sharded: bool = False) -> Path:
        name = f"{family}-{'sharded' if sharded else 'single'}"
        return Path(made_once(tmp_path_factory, name,
                              lambda folder: str(write_hf_checkpoint(folder, family, sharded=sharded))))

    return get


@pytest.fixture(scope="session")
def hf_export(hf_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`get(family, exporter, attention="eager") -> model.onnx`: `hf_checkpoint(family)` through
    tests/exporters.py's `exporter`, exported once per run; treat as read-only. A test whose
    exporter cannot run here (Optimum without its venv) skips."""
    from exporters import ExporterUnavailable, export_decoder

    def get(family: str, exporter: str, attention: str = "eager") -> Path:
        if exporter in ("llmc", "optimum"):  # they export one attention whatever is asked
            attention = "default"

        def make(folder: Path) -> dict:
            try:
                path = export_decoder(hf_checkpoint(family), exporter, folder / "model.onnx", attention=attention)
            except ExporterUnavailable as exc:
                return {"skip": str(exc)}
            return {"path": str(path)}

        made = made_once(tmp_path_factory, f"{family}-{exporter}-{attention}", make)
        if "skip" in made:
            pytest.skip(made["skip"])
        return Path(made["path"])

    return get


@pytest.fixture(scope="session")
def tiny_llama_onnx(tmp_path_factory) -> Path:
    """tiny-llama exported with `llmc.export` (parity checked); treat as read-only."""
    from llmc.compiler.export import export

    def make(folder: Path) -> str:
        check = export("tiny-llama", folder / "model.onnx")
        assert check.max_abs < 1e-4
        return str(folder / "model.onnx")
    return Path(made_once(tmp_path_factory, "tiny-llama", make))


@pytest.fixture(scope="session")
def tiny_llama_engine(tiny_llama_onnx, tmp_path_factory) -> Path:
    """tiny-llama compiled into an engine file; treat as read-only."""
    from llmc.compiler.build import compile_model

    def make(folder: Path) -> str:
        compile_model(tiny_llama_onnx, folder / "engine.plan")
        return str(folder / "engine.plan")
    return Path(made_once(tmp_path_factory, "tiny-llama-engine", make))


@pytest.fixture(scope="session")
def trained_onnx(tmp_path_factory) -> Path:
    """The committed model trained on the standard library (data/pystdlib-llama), exported."""
    from llmc.compiler.export import export

    def make(folder: Path) -> str:
        export(str(Path(__file__).resolve().parents[1] / "data" / "pystdlib-llama"), folder / "model.onnx")
        return str(folder / "model.onnx")
    return Path(made_once(tmp_path_factory, "pystdlib", make))


@pytest.fixture(scope="session")
def trained_engine(trained_onnx, tmp_path_factory) -> Path:
    """The trained model compiled with default options; treat as read-only."""
    from llmc.compiler.build import compile_model

    def make(folder: Path) -> str:
        compile_model(trained_onnx, folder / "trained.plan")
        return str(folder / "trained.plan")
    return Path(made_once(tmp_path_factory, "pystdlib-engine", make))


@pytest.fixture(scope="session")
def trained_log_probs():
    """Log-softmax (float64) of transformers' logits at every position of a sequence of ids, on
    the trained model's checkpoint: the reference for log-probabilities."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    checkpoint = Path(__file__).resolve().parents[1] / "data" / "pystdlib-llama"
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def log_probs(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
    return log_probs


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_engine(tiny_llama_onnx, tmp_path_factory) -> Path:
    """tiny-llama compiled with its byte-level tokenizer given a chat template (CHAT_TEMPLATE)."""
    from llmc.compiler.build import compile_model
    from llmc.tokenizer import byte_level_tokenizer

    folder = tmp_path_factory.mktemp("chat-tokenizer")
    byte_level_tokenizer().save(folder)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    path = folder / "chat.plan"
    compile_model(tiny_llama_onnx, path, tokenizer=folder)
    return path
