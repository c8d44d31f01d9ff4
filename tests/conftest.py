"""Shared fixtures, made once per test session: tiny-llama exported and compiled, the trained
model, and the random-weight Hugging Face checkpoints with their exports (a torch.onnx dynamo
export of a 2-layer model takes 6-11 s; several modules test the same ones).

pytest runs with --import-mode=importlib, which does not put test folders on sys.path; this
file adds `tests/` so that fixture factories (`hf_checkpoints`) import by plain name.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`get(family, sharded=False) -> folder`: tests/hf_checkpoints.py's checkpoints, written once
    per session; treat as read-only."""
    from hf_checkpoints import write_hf_checkpoint

    folders: dict[tuple[str, bool], Path] = {}

    def get(family: str, sharded: bool = False) -> Path:
        key = (family, sharded)
        if key not in folders:
            name = f"{family}-{'sharded' if sharded else 'single'}"
            folders[key] = write_hf_checkpoint(tmp_path_factory.mktemp(name), family, sharded=sharded)
        return folders[key]

    return get


@pytest.fixture(scope="session")
def hf_export(hf_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`get(family, exporter, attention="eager") -> model.onnx`: `hf_checkpoint(family)` through
    tests/exporters.py's `exporter`, exported once per session; treat as read-only. A test whose
    exporter cannot run here (Optimum without its venv) skips."""
    from exporters import ExporterUnavailable, export_decoder

    exports: dict[tuple[str, str, str], Path | ExporterUnavailable] = {}

    def get(family: str, exporter: str, attention: str = "eager") -> Path:
        if exporter in ("llmc", "optimum"):  # they export one attention whatever is asked
            attention = "default"
        key = (family, exporter, attention)
        if key not in exports:
            folder = tmp_path_factory.mktemp(f"{family}-{exporter}-{attention}")
            try:
                exports[key] = export_decoder(hf_checkpoint(family), exporter, folder / "model.onnx",
                                              attention=attention)
            except ExporterUnavailable as exc:
                exports[key] = exc
        if isinstance(exports[key], ExporterUnavailable):
            pytest.skip(str(exports[key]))
        return exports[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama_onnx(tmp_path_factory) -> Path:
    """tiny-llama exported with `llmc.export` (parity checked); treat as read-only."""
    from llmc.compiler.export import export

    path = tmp_path_factory.mktemp("tiny-llama") / "model.onnx"
    check = export("tiny-llama", path)
    assert check.max_abs < 1e-4
    return path


@pytest.fixture(scope="session")
def tiny_llama_engine(tiny_llama_onnx) -> Path:
    """tiny-llama compiled into an engine file; treat as read-only."""
    from llmc.compiler.build import compile_model

    path = tiny_llama_onnx.parent / "engine.plan"
    compile_model(tiny_llama_onnx, path)
    return path


@pytest.fixture(scope="session")
def trained_onnx(tmp_path_factory) -> Path:
    """The committed model trained on the standard library (data/pystdlib-llama), exported."""
    from llmc.compiler.export import export

    path = tmp_path_factory.mktemp("pystdlib") / "model.onnx"
    export(str(Path(__file__).resolve().parents[1] / "data" / "pystdlib-llama"), path)
    return path


@pytest.fixture(scope="session")
def trained_engine(trained_onnx) -> Path:
    """The trained model compiled with default options; treat as read-only."""
    from llmc.compiler.build import compile_model

    path = trained_onnx.parent / "trained.plan"
    compile_model(trained_onnx, path)
    return path


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
