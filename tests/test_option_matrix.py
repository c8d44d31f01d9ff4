"""`llmc compile`'s options as a matrix, on the trained model (data/pystdlib-llama): every cell
builds an engine that runs and stays accurate, or is refused before any work in one line naming
both options.

The options: the backend (onnxruntime; tensorrt, as `--dry-run`), --fp16, the linear layers'
quantization (none, --int8-calib, --int8-dynamic, --weights int4, --weights int8), --calib, a
--precision-config (`MIXED`: layer 0 kept fp32, layer 3's MLP int4), --kv-cache-dtype (auto, fp16,
fp32) and --no-paged. A cell that quantizes without data adds --force (no accuracy gate).

Which combinations are illegal is stated here on its own (`conflict`), and each illegal pair of
values is checked to be refused. Of the legal product (228 cells, about a quarter of an hour) the
cells run are a pairwise covering: the product's own command (--fp16 --int8-calib) on both
backends, then, greedily, the cell holding the most pairs of option values not yet in a cell,
until every pair of values that some legal cell holds is in one (`test_the_cells_cover_every_legal_pair`).

What a cell must do, against the exported graph in onnxruntime (the reference `llmc check` uses,
precision/check.py, its metrics on `EVAL_TOKENS` held-out tokens of data/pystdlib-text/heldout):
- onnxruntime: compile, and `llmc run` completes a prompt greedily; float cells (no quantization,
  no fp16) give the reference's greedy tokens exactly and its perplexity within `FLOAT_PPL`
  percent; fp16 computation or an fp16 pool within `HALF_PPL`; quantized cells within `QUANTIZED_PPL`
  (the bar quantized SmolLM2 engines are held to).
- tensorrt: `--dry-run` finds no node TensorRT would refuse, and the graph the build would receive,
  run on the CPU (tests/tensorrt_form.py), meets the same tolerances.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from llmc.cli import main
from llmc.llm import LLM
from llmc.precision.check import ReferenceModel, check
from llmc.tokenizer import Tokenizer
from tensorrt_form import TensorRTForm, capture_tensorrt_graph

REPO = Path(__file__).resolve().parents[1]
CALIB = REPO / "data" / "pystdlib-text" / "calib"
HELDOUT = REPO / "data" / "pystdlib-text" / "heldout"
MIXED = {"rules": {"layers.0.*": "fp32", "layers.3.mlp.*": "int4"}}
CALIB_TOKENS = 1024
EVAL_TOKENS = 512
PROMPT, NEW_TOKENS = "def fibonacci(", 12
FLOAT_PPL, HALF_PPL, QUANTIZED_PPL = 0.01, 0.5, 2.0  # percent

OPTIONS = {
    "backend": ("onnxruntime", "tensorrt"),
    "fp16": (False, True),
    "quantize": (None, "int8-calib", "int8-dynamic", "int4", "int8"),
    "calib": (False, True),
    "config": (False, True),
    "kv": ("auto", "fp16", "fp32"),
    "paged": (True, False),
}
Cell = dict


def conflict(cell: Cell) -> tuple[str, str] | None:
    """The two options of `cell` that cannot go together, or None: the rules the product must keep."""
    trt = cell["backend"] == "tensorrt"
    rules = [(cell["quantize"] == "int8-calib" and cell["calib"], ("--int8-calib", "--calib")),
             (trt and not cell["paged"], ("--no-paged", "--backend tensorrt")),
             (trt and cell["quantize"] == "int8-dynamic", ("--int8-dynamic", "--backend tensorrt")),
             (not cell["paged"] and cell["kv"] != "auto", ("--kv-cache-dtype", "--no-paged"))]
    return next((options for hit, options in rules if hit), None)


def _value_pairs(cell: Cell) -> set:
    return {((a, cell[a]), (b, cell[b])) for a, b in itertools.combinations(OPTIONS, 2)}


PRODUCT = [dict(zip(OPTIONS, values)) for values in itertools.product(*OPTIONS.values())]
LEGAL = [cell for cell in PRODUCT if conflict(cell) is None]
THE_COMMAND = [{**LEGAL[0], "backend": backend, "fp16": True, "quantize": "int8-calib"}
               for backend in OPTIONS["backend"]]


def _covering(first: list[Cell]) -> list[Cell]:
    cells, uncovered = list(first), set().union(*map(_value_pairs, LEGAL)) - set().union(*map(_value_pairs, first))
    while uncovered:
        best = max(LEGAL, key=lambda cell: len(_value_pairs(cell) & uncovered))
        cells.append(best)
        uncovered -= _value_pairs(best)
    return cells


CELLS = _covering(THE_COMMAND)


def _name(cell: Cell) -> str:
    parts = [cell["backend"], "fp16" if cell["fp16"] else "", cell["quantize"] and f"q-{cell['quantize']}",
             "calib" if cell["calib"] else "", "mixed" if cell["config"] else "",
             cell["kv"] != "auto" and f"kv-{cell['kv']}", "" if cell["paged"] else "no-paged"]
    return "+".join(p for p in parts if p)


def _quantizes(cell: Cell) -> bool:
    return cell["quantize"] is not None or cell["config"]


def _argv(cell: Cell, onnx_file: Path, output: Path, config: Path) -> list[str]:
    argv = ["compile", str(onnx_file), "-o", str(output)]
    if cell["backend"] == "tensorrt":
        argv += ["--backend", "tensorrt", "--dry-run"]
    argv += ["--fp16"] * cell["fp16"]
    quantize = cell["quantize"]
    argv += {None: [], "int8-calib": ["--int8-calib", str(CALIB)], "int8-dynamic": ["--int8-dynamic"]}.get(
        quantize, ["--weights", str(quantize)])
    argv += ["--calib", str(CALIB)] * cell["calib"]
    argv += ["--precision-config", str(config)] * cell["config"]
    argv += ["--kv-cache-dtype", cell["kv"]] * (cell["kv"] != "auto")
    argv += ["--no-paged"] * (not cell["paged"])
    has_data = cell["calib"] or quantize == "int8-calib"
    argv += ["--calib-tokens", str(CALIB_TOKENS)] * has_data
    argv += ["--force"] * (_quantizes(cell) and not has_data)
    return argv


def _tolerance(cell: Cell) -> float:
    if _quantizes(cell):
        return QUANTIZED_PPL
    return HALF_PPL if cell["fp16"] or cell["kv"] == "fp16" else FLOAT_PPL


class Remembered:
    """The reference model, each window's logits computed once for every cell."""

    def __init__(self, reference: ReferenceModel):
        self.reference, self.interface, self.vocab_size = reference, reference.interface, reference.vocab_size
        self.known: dict[bytes, np.ndarray] = {}

    def logits(self, token_ids) -> np.ndarray:
        key = np.asarray(token_ids, np.int64).tobytes()
        if key not in self.known:
            self.known[key] = self.reference.logits(np.asarray(token_ids, np.int64))
        return self.known[key]


@pytest.fixture(scope="module")
def reference(trained_onnx) -> Remembered:
    return Remembered(ReferenceModel(trained_onnx))


@pytest.fixture(scope="module")
def mixed_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("matrix") / "mixed.json"
    path.write_text(json.dumps(MIXED))
    return path


def _greedy(reference: Remembered, prompt_ids: list[int], count: int) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(count):
        ids.append(int(reference.logits(ids)[-1].argmax()))
    return ids[len(prompt_ids):]


def test_the_cells_cover_every_legal_pair():
    assert all(conflict(cell) is None for cell in CELLS)
    legal_pairs = set().union(*map(_value_pairs, LEGAL))
    assert legal_pairs == set().union(*map(_value_pairs, CELLS))
    assert len(LEGAL) == 228 and len(CELLS) < 25


def _illegal_pairs() -> list[tuple]:
    """Each pair of option values no legal cell holds, with a cell holding it."""
    legal_pairs = set().union(*map(_value_pairs, LEGAL))
    found = {}
    for cell in PRODUCT:
        for pair in _value_pairs(cell) - legal_pairs:
            found.setdefault(pair, cell)
    return sorted(found.items(), key=repr)


@pytest.mark.parametrize("pair, cell", _illegal_pairs(),
                         ids=lambda v: _name(v) if isinstance(v, dict) else ",".join(f"{o}={x}" for o, x in v))
def test_an_illegal_pair_is_refused_before_any_work_naming_both(pair, cell, trained_onnx, mixed_config, tmp_path,
                                                                monkeypatch):
    from llmc.compiler import build

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(build, "load_onnx", no_work)
    result = CliRunner().invoke(main, _argv(cell, trained_onnx, tmp_path / "e.plan", mixed_config))
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("llmc: error: ") and all(option in line for option in conflict(cell)), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cell", CELLS, ids=_name)
def test_cell(cell, trained_onnx, reference, mixed_config, tmp_path, monkeypatch):
    engine = tmp_path / "engine.plan"
    graphs = capture_tensorrt_graph(monkeypatch)
    compiled = CliRunner().invoke(main, _argv(cell, trained_onnx, engine, mixed_config))
    assert compiled.exit_code == 0, compiled.output
    tokenizer = Tokenizer.from_folder(REPO / "data" / "pystdlib-llama")
    if cell["backend"] == "tensorrt":
        assert "ok:" in compiled.stdout and not engine.exists()
        [graph] = graphs
        under_test = TensorRTForm(graph, tokenizer, reference.interface.geometry.max_positions)
        prompt_ids = tokenizer.encode(PROMPT)
        served = _greedy(under_test, prompt_ids, NEW_TOKENS)
    else:
        ran = CliRunner().invoke(main, ["run", str(engine), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
                                        "--json"])
        assert ran.exit_code == 0, ran.output
        completion = json.loads(ran.stdout)
        prompt_ids, served = completion["prompt_token_ids"], completion["token_ids"]
        under_test = LLM(engine)
    report = check(under_test, reference, HELDOUT, max_tokens=EVAL_TOKENS, generate=8)
    assert report.tokens >= EVAL_TOKENS - 4
    assert abs(report.ppl_increase_pct) <= _tolerance(cell), report
    if _tolerance(cell) == FLOAT_PPL:
        assert served == _greedy(reference, prompt_ids, NEW_TOKENS)
        assert report.first_divergence is None
    else:
        assert len(served) == NEW_TOKENS
