"""`llmc compile` with drawn option sets: each either gets past every check to the optimization
passes, or exits 2 with one line naming the option(s) at fault; never an internal error.

The rules are stated here on their own (`violations`), as the spec the CLI must keep, both ways:
a set they allow must reach the passes (where the test stops it: the matrix in
test_option_matrix.py builds and runs the legal cells), a set they refuse must be refused, and
when a rule needs no model (every option conflict and option value), before the model is loaded.
What needs the model is refused after loading it and before the passes: a --max-seq-len past its
positions, a --kv-pool-mb short of one sequence, a data folder that is not there.

The options and their values (`VALUES`, bad ones among them) are drawn up to four at a time, which
seldom isolates one rule; `EACH_RULE` breaks each alone, and holds sets that break none.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmc.cli import main
from llmc.compiler import build

REPO = Path(__file__).resolve().parents[1]
CALIB = str(REPO / "data" / "pystdlib-text" / "calib")
NOWHERE = str(REPO / "data" / "no-such-folder")
# The trained model (data/pystdlib-llama/config.json): what the model-dependent rules read.
POSITIONS, LAYERS, KV_HEADS, HEAD_DIM = 512, 4, 2, 64

FLAG = True
NAN, INF = math.nan, math.inf
# Mixed-precision files by name: their content, and the precisions they ask for (None: no file,
# or not one llmc reads). "int8"'s default replaces the options' own precision.
CONFIGS = {"mixed": ({"rules": {"layers.0.*": "fp32", "layers.3.mlp.*": "int4"}}, {"fp32", "int4"}),
           "int8": ({"default": "int8"}, {"int8"}),
           "dynamic": ({"rules": {"layers.1.*": "int8-dynamic"}}, {"int8-dynamic"}),
           "half": ({"rules": {"Attention": "fp16"}}, {"fp16"}),
           "broken": ("{not json", None),
           "missing": (None, None)}
VALUES = {
    "--backend": ["onnxruntime", "tensorrt", "cuda"],
    "--dry-run": [FLAG],
    "--fp16": [FLAG],
    "--int8-calib": [CALIB, NOWHERE],
    "--int8-dynamic": [FLAG],
    "--weights": ["int4", "int8", "int3"],
    "--weights-block-size": [32, 64, 128, 48],
    "--weights-symmetric": [FLAG],
    "--calib": [CALIB, NOWHERE],
    "--smoothquant": [0.0, 0.5, 1.5, NAN],
    "--calibrator": ["minmax", "entropy", "median"],
    "--calib-tokens": [1024, 0],
    "--precision-config": list(CONFIGS),
    "--kv-cache-dtype": ["auto", "fp16", "fp32", "int8"],
    "--no-paged": [FLAG],
    "--force": [FLAG],
    "--max-ppl-increase": [3.0, 0.0, NAN, INF],
    "--block-size": [8, 16, 48],
    "--max-batch": [1, 64, 0],
    "--max-seq-len": [64, 512, 1, 4096],
    "--kv-pool-mb": [0.5, 4.0, 0.0, NAN, INF],
    "--max-num-tokens": [256, 0],
    "--hardware-compatible": [FLAG],
}
TENSORRT_ONLY = ("--dry-run", "--max-num-tokens", "--hardware-compatible")
PAGED_ONLY = ("--block-size", "--max-batch", "--max-seq-len", "--kv-pool-mb", "--kv-cache-dtype")
QUANTIZED = {"int8", "int8-dynamic", "int8-weights", "int4"}


def violations(options: dict) -> list[tuple[tuple[str, ...], bool]]:
    """Each rule `options` break: the names its one line must hold, and whether the model is read
    first (only for rules that depend on the model or the data)."""
    found = []

    def rule(broken, *names, after_load=False):
        if broken:
            found.append((names, after_load))

    given = options.__contains__
    backend = options.get("--backend", "onnxruntime")
    trt, paged = backend == "tensorrt", not given("--no-paged")
    rule(backend not in ("onnxruntime", "tensorrt"), "--backend")
    for name in TENSORRT_ONLY:
        rule(given(name) and not trt, name, "--backend tensorrt")
    rule(trt and not paged, "--no-paged", "--backend tensorrt")
    for name in PAGED_ONLY:
        rule(given(name) and not paged, name, "--no-paged")
    rule(options.get("--kv-cache-dtype", "auto") not in ("auto", "fp16", "fp32"), "--kv-cache-dtype")
    rule(options.get("--block-size", 16) not in (1, 2, 4, 8, 16, 32, 64, 128, 256), "--block-size")
    rule(options.get("--max-batch", 1) < 1, "--max-batch")
    rule(options.get("--max-seq-len", 2) < 2, "--max-seq-len")
    rule(not 0 < options.get("--kv-pool-mb", 1) < INF, "--kv-pool-mb")
    rule(options.get("--max-num-tokens", 1) < 1, "--max-num-tokens")
    rule(options.get("--weights", "int4") not in ("int4", "int8"), "--weights")
    rule(options.get("--weights-block-size", 32) not in (16, 32, 64, 128, 256), "--weights-block-size")
    rule(not 0 <= options.get("--smoothquant", 0) < 1, "--smoothquant")
    whole = [name for name in ("--int8-calib", "--int8-dynamic", "--weights") if given(name)]
    rule(len(whole) > 1, *whole[:2])
    rule(given("--int8-calib") and given("--calib"), "--int8-calib", "--calib")
    rule(not options.get("--max-ppl-increase", 1) > 0, "--max-ppl-increase")
    rule(options.get("--calib-tokens", 1) < 1, "--calib-tokens")
    rule(options.get("--calibrator", "minmax") not in ("minmax", "percentile", "entropy"), "--calibrator")
    config = options.get("--precision-config")
    rule(config in ("broken", "missing"), f"{config}.json")

    base = ("int8" if given("--int8-calib") else "int8-dynamic" if given("--int8-dynamic")
            else {"int8": "int8-weights", "int4": "int4"}.get(options.get("--weights")) or "fp32")
    content, named = CONFIGS.get(config, (None, None))
    asked = {base} if named is None else named if "default" in content else named | {base}
    data, quantized = given("--int8-calib") or given("--calib"), asked & QUANTIZED
    source = next((name for name in ("--int8-dynamic", "--weights") if given(name)), "--precision-config")
    rule("int8" in asked and not data, "--precision-config")
    rule(quantized and not data and not given("--force"), source)
    rule(trt and "int8-dynamic" in asked, "--backend tensorrt",
         "--int8-dynamic" if given("--int8-dynamic") else "--precision-config")
    block = options.get("--weights-block-size", 64 if trt else 32)
    rule(trt and "int4" in asked and block not in (64, 128), "--weights-block-size", "--backend tensorrt")
    rule(given("--smoothquant") and not asked & {"int8", "int8-dynamic"}, "--smoothquant")
    rule(given("--calibrator") and "int8" not in asked, "--calibrator")
    for name in ("--weights-block-size", "--weights-symmetric"):
        rule(given(name) and not quantized, name)
    rule(given("--calib-tokens") and not data, "--calib-tokens")

    for name in ("--int8-calib", "--calib"):
        rule(options.get(name) == NOWHERE, name, after_load=True)
    max_seq_len = options.get("--max-seq-len", POSITIONS)
    rule(max_seq_len > POSITIONS, "--max-seq-len", after_load=True)
    block_size = options.get("--block-size", 16)
    block_bytes = LAYERS * 2 * KV_HEADS * block_size * HEAD_DIM * (2 if options.get("--kv-cache-dtype") == "fp16" else 4)
    pool = options.get("--kv-pool-mb", INF)
    rule(0 < pool < INF and pool * 2**20 // block_bytes < -(-max_seq_len // block_size), "--kv-pool-mb",
         after_load=True)
    return found


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("configs")
    for name, (content, _) in CONFIGS.items():
        if content is not None:
            (folder / f"{name}.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


class Reached(BaseException):
    """compile_model got past every check to the optimization passes (not an Exception, so that
    neither the CLI nor click's test runner takes it for an error)."""


def _argv(options: dict, onnx_file: Path, configs: Path) -> list[str]:
    argv = ["compile", str(onnx_file), "-o", str(configs / "never.plan")]
    for name, value in options.items():
        if name == "--precision-config":
            value = str(configs / f"{value}.json")
        argv += [name] if value is FLAG else [name, str(value)]
    return argv


def _compile(argv: list[str]):
    """(click's result, or None when the passes were reached; whether the model was loaded)."""
    loaded = []
    load = build.load_onnx

    def loading(*args, **kwargs):
        loaded.append(True)
        return load(*args, **kwargs)

    def optimize(*args, **kwargs):
        raise Reached

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "load_onnx", loading)
        patch.setattr(build, "optimize", optimize)
        try:
            return CliRunner().invoke(main, argv), bool(loaded)
        except Reached:
            return None, bool(loaded)


# Each rule broken alone, and sets that break none: the drawn sets below rarely isolate a rule.
EACH_RULE = [
    {"--backend": "cuda"}, {"--dry-run": FLAG}, {"--hardware-compatible": FLAG}, {"--max-num-tokens": 256},
    {"--backend": "tensorrt", "--dry-run": FLAG, "--no-paged": FLAG},
    *({"--no-paged": FLAG, name: VALUES[name][0]} for name in PAGED_ONLY),
    {"--kv-cache-dtype": "int8"}, {"--block-size": 48}, {"--max-batch": 0}, {"--max-seq-len": 1},
    {"--kv-pool-mb": 0.0}, {"--kv-pool-mb": NAN}, {"--kv-pool-mb": INF},
    {"--backend": "tensorrt", "--dry-run": FLAG, "--max-num-tokens": 0},
    {"--weights": "int3", "--force": FLAG}, {"--weights": "int4", "--weights-block-size": 48, "--force": FLAG},
    {"--int8-dynamic": FLAG, "--smoothquant": 1.5, "--force": FLAG}, {"--max-ppl-increase": NAN},
    {"--max-ppl-increase": 0.0}, {"--calib": CALIB, "--calib-tokens": 0},
    {"--int8-calib": CALIB, "--calibrator": "median"},
    {"--int8-calib": CALIB, "--int8-dynamic": FLAG}, {"--int8-dynamic": FLAG, "--weights": "int8", "--force": FLAG},
    {"--int8-calib": CALIB, "--calib": CALIB},
    {"--precision-config": "broken"}, {"--precision-config": "missing"}, {"--precision-config": "int8", "--force": FLAG},
    {"--weights": "int4"}, {"--int8-dynamic": FLAG}, {"--precision-config": "mixed"},
    {"--backend": "tensorrt", "--dry-run": FLAG, "--int8-dynamic": FLAG, "--force": FLAG},
    {"--backend": "tensorrt", "--dry-run": FLAG, "--precision-config": "dynamic", "--calib": CALIB},
    {"--backend": "tensorrt", "--dry-run": FLAG, "--weights": "int4", "--weights-block-size": 32, "--force": FLAG},
    {"--weights": "int4", "--smoothquant": 0.5, "--force": FLAG}, {"--int8-dynamic": FLAG, "--calibrator": "entropy",
                                                                   "--force": FLAG},
    {"--weights-block-size": 64}, {"--weights-symmetric": FLAG}, {"--fp16": FLAG, "--calib-tokens": 1024},
    {"--int8-calib": NOWHERE}, {"--calib": NOWHERE}, {"--max-seq-len": 4096}, {"--kv-pool-mb": 0.5},
    # none broken
    {}, {"--fp16": FLAG, "--int8-calib": CALIB}, {"--backend": "tensorrt", "--dry-run": FLAG, "--fp16": FLAG,
                                                  "--int8-calib": CALIB},
    {"--weights": "int4", "--calib": CALIB, "--weights-block-size": 64, "--weights-symmetric": FLAG},
    {"--backend": "tensorrt", "--dry-run": FLAG, "--weights": "int4", "--force": FLAG}, {"--no-paged": FLAG},
    {"--kv-cache-dtype": "fp16", "--block-size": 8, "--max-batch": 1, "--max-seq-len": 64, "--kv-pool-mb": 0.5},
    {"--int8-calib": CALIB, "--smoothquant": 0.5, "--calibrator": "entropy", "--calib-tokens": 1024},
    {"--precision-config": "half"}, {"--precision-config": "dynamic", "--calib": CALIB, "--smoothquant": 0.0},
]


def _check(options: dict, onnx_file: Path, configs: Path) -> str:
    """Run `llmc compile` with `options` against `violations`; returns what happened."""
    broken = violations(options)
    result, loaded = _compile(_argv(options, onnx_file, configs))
    if not broken:
        assert result is None, f"refused: {result.output}"
        return "works"
    assert result is not None, f"not refused; expected one of {[names for names, _ in broken]}"
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("llmc: error: ") and "internal error" not in line
    assert any(all(name in line for name in names) for names, _ in broken), (line, broken)
    if not all(after_load for _, after_load in broken):
        assert not loaded, f"refused only after loading the model: {line}"
    return "refused after loading the model" if loaded else "refused before any work"


@pytest.mark.parametrize("options", EACH_RULE,
                         ids=lambda options: " ".join(f"{k}={v}" for k, v in options.items()) or "none")
def test_each_rule(options, trained_onnx, configs):
    _check(options, trained_onnx, configs)


option_sets = st.sets(st.sampled_from(list(VALUES)), max_size=4).flatmap(
    lambda names: st.fixed_dictionaries({name: st.sampled_from(VALUES[name]) for name in sorted(names)}))


@settings(max_examples=200, deadline=None)
@given(options=option_sets)
def test_a_drawn_option_set_works_or_is_refused_in_one_line_naming_the_option(options, trained_onnx, configs):
    event(_check(options, trained_onnx, configs))
