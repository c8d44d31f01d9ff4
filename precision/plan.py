"""Which precision each part of the graph gets, from the compile options and a mixed-precision file.

Precisions of a linear layer (precision/linears.py names them):

    fp32           as exported
    fp16           computed in fp16 (the whole graph with --fp16, islands excepted: precision/fp16.py)
    int8           int8 Q/DQ, activations calibrated (needs --int8-calib; precision/int8.py says
                   which activations get per-token scales instead of static ones)
    int8-dynamic   int8 Q/DQ with per-token activation scales computed at run time (no calibration)
    int8-weights   weight-only int8 (MatMulNBits)
    int4           weight-only int4, block-wise (MatMulNBits)

The mixed-precision file is JSON. "default" sets every linear layer; "rules" map a glob over
layer names (``layers.*.mlp.down``, ``lm_head``) or an op type (``Attention``, ``Gather``) to a
precision, later rules overriding earlier ones. Op types take fp32 or fp16 only:

    {"default": "int8", "rules": {"lm_head": "fp32", "layers.0.*": "int8-weights", "Attention": "fp16"}}

A rule that names nothing in the model is an error, raised before calibration starts.

By rule, lm_head is not given int8 activations nor int4 weights: under int8, int8-dynamic or int4
it gets int8 weights only, unless a rule names it. On SmolLM2-135M its static int8 alone costs
+4.9% perplexity on real text, per-token about +0.9%; weight-only int8 keeps it within 0.2% and
its weights at a quarter of fp32 (it is the largest layer of a small model, and with tied
embeddings the one matrix int4 rounds worst: precision/weight_only.py).

Any quantizing option needs data, to calibrate and to check the result: the accuracy gate
(precision/gate.py) holds back a quarter of it and refuses an engine past --max-ppl-increase.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from llmc.errors import LlmcError
from llmc.precision.calibration import check_calibrator, observe
from llmc.precision.data import read_documents, windows
from llmc.precision.fp16 import convert_to_fp16, node_key
from llmc.precision.dequantize_linear import INT4_BLOCK_SIZES  # TensorRT's int4 blocks
from llmc.precision.gate import DEFAULT_MAX_PPL_INCREASE, split
from llmc.precision.int8 import quantize_int8
from llmc.precision.linears import linear_layers
from llmc.precision.weight_only import (BLOCK_SIZES, DEFAULT_BLOCK_SIZE, LM_HEAD_MIN_BLOCK_SIZE, LM_HEAD_UNDER_INT4,
                                         SYMMETRIC, quantize_weights)
from llmc.precision.weight_only import SAMPLE_ROWS as WEIGHT_SAMPLE_ROWS

PRECISIONS = ("fp32", "fp16", "int8", "int8-dynamic", "int8-weights", "int4")
CALIBRATION_WINDOW = 256


@dataclass(frozen=True)
class PrecisionOptions:
    """What `llmc compile` was asked for (see the CLI help for each)."""

    fp16: bool = False
    int8_calib: str | None = None
    calibrator: str = "minmax"
    smoothquant: float | None = None      # None: strength searched per activation; 0: off
    calib_tokens: int = 4096
    weights: str | None = None
    weights_block_size: int | None = None  # None: the backend's (compiler/targets.py), else DEFAULT_BLOCK_SIZE
    weights_symmetric: bool = SYMMETRIC   # True: no zero points (onnxruntime-genai's int4 scheme)
    config: str | None = None
    int8_dynamic: bool = False
    calib: str | None = None              # data for the accuracy check (and SmoothQuant) without --int8-calib
    max_ppl_increase: float = DEFAULT_MAX_PPL_INCREASE
    force: bool = False

    @property
    def is_default(self) -> bool:
        return self == PrecisionOptions()

    @property
    def data(self) -> tuple[str, str] | None:
        """(folder, the option that named it), or None."""
        if self.int8_calib is not None:
            return self.int8_calib, "--int8-calib"
        return (self.calib, "--calib") if self.calib is not None else None

    @property
    def quantizes(self) -> bool:
        """Whether --int8-calib, --int8-dynamic or --weights quantize the linear layers (what a
        mixed-precision file asks for is in `precisions`)."""
        return bool(self.int8_calib or self.int8_dynamic or self.weights)

    @property
    def base(self) -> str:
        """The precision every linear layer gets before a mixed-precision file's default and rules."""
        if self.int8_calib is not None:
            return "int8"
        if self.int8_dynamic:
            return "int8-dynamic"
        return {"int8": "int8-weights", "int4": "int4"}.get(self.weights) or ("fp16" if self.fp16 else "fp32")

    def precisions(self, config: MixedPrecision | None) -> frozenset[str]:
        """Every precision these options and their mixed-precision file ask for (the lm_head rules
        of apply_precision aside: they only trade one quantized form for another)."""
        if config is None:
            return frozenset({self.base})
        return frozenset({config.default or self.base, *(value for _, value in config.rules)})


@dataclass(frozen=True)
class MixedPrecision:
    default: str | None
    rules: list[tuple[str, str]]
    source: str


def read_config(path: str | None) -> MixedPrecision | None:
    """Parse and check a mixed-precision file (values only; names are checked against the model)."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise LlmcError(f"--precision-config: {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise LlmcError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, dict) or set(data) - {"default", "rules"}:
        raise LlmcError(f"{path}: expected an object with \"default\" and/or \"rules\"")
    rules = data.get("rules", {})
    if not isinstance(rules, dict):
        raise LlmcError(f"{path}: \"rules\" must map patterns to precisions")
    for where, value in [("default", data.get("default", "fp32"))] + list(rules.items()):
        if value not in PRECISIONS:
            raise LlmcError(f"{path}: {where}: '{value}' is not a precision ({', '.join(PRECISIONS)})")
    return MixedPrecision(data.get("default"), list(rules.items()), str(path))


QUANTIZED = frozenset({"int8", "int8-dynamic", "int8-weights", "int4"})


def check_options(options: PrecisionOptions, backend: str = "onnxruntime") -> MixedPrecision | None:
    """Everything that can be checked before the model is read: each value, the mixed-precision
    file, and the options that cannot go together (on `backend`), refused in one line naming them."""
    if options.weights not in (None, "int8", "int4"):
        raise LlmcError(f"--weights: '{options.weights}' is not a weight format (int8, int4)")
    if options.weights_block_size is not None and options.weights_block_size not in BLOCK_SIZES:
        raise LlmcError(f"--weights-block-size: {options.weights_block_size} is not supported "
                        f"({', '.join(map(str, BLOCK_SIZES))})")
    if options.smoothquant is not None and not 0.0 <= options.smoothquant < 1.0:
        raise LlmcError(f"--smoothquant: alpha must be in [0, 1) (0 turns it off), got {options.smoothquant}")
    if sum(map(bool, (options.int8_calib, options.int8_dynamic, options.weights))) > 1:
        raise LlmcError("--int8-calib, --int8-dynamic and --weights each set every linear layer; give one "
                        "(or a --precision-config to mix them)")
    if options.int8_calib is not None and options.calib is not None:
        raise LlmcError("--int8-calib already names the data; drop --calib")
    if not options.max_ppl_increase > 0:
        raise LlmcError(f"--max-ppl-increase: must be positive, got {options.max_ppl_increase}")
    if options.calib_tokens < 1:
        raise LlmcError(f"--calib-tokens: must be ≥ 1, got {options.calib_tokens}")
    check_calibrator(options.calibrator)  # the amount is checked with the data
    config = read_config(options.config)
    asked = options.precisions(config)
    # Where a quantized precision comes from, for the messages.
    source = ("--int8-dynamic" if options.int8_dynamic else f"--weights {options.weights}" if options.weights
              else f"--precision-config {options.config}")
    if "int8" in asked and options.data is None:
        raise LlmcError(f"--precision-config {options.config}: its int8 layers need calibration data: give --calib DIR")
    if asked & QUANTIZED and options.data is None and not options.force:
        raise LlmcError(f"{source}: quantizing needs data to check the engine's accuracy on: give --calib DIR (text "
                        "like your traffic), or --force to skip the check")
    if backend == "tensorrt" and "int8-dynamic" in asked:
        # IDynamicQuantizeLayer's output_type "must be either DataType::kFP4 (NVFP4 quantization) or
        # DataType::kFP8 (MXFP8 quantization)" (tensorrt-cu13-bindings 11.4.0.106, tensorrt.so's
        # docstrings): TensorRT 11.4 computes no INT8 scales at run time.
        where = "--int8-dynamic" if options.int8_dynamic else f"--precision-config {options.config}: int8-dynamic"
        raise LlmcError(f"{where} and --backend tensorrt: TensorRT computes int8 activation scales only ahead of "
                        "time; use --int8-calib DIR")
    if (backend == "tensorrt" and "int4" in asked and options.weights_block_size is not None
            and options.weights_block_size not in INT4_BLOCK_SIZES):
        raise LlmcError(f"--weights-block-size {options.weights_block_size} and --backend tensorrt: TensorRT's int4 "
                        f"blocks hold {' or '.join(map(str, INT4_BLOCK_SIZES))} weights")
    return config


def calibration_windows(options: PrecisionOptions, tokenizer, vocab_size: int,
                        max_positions: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Read and cut the data into (calibration, held back for the accuracy gate) windows,
    refusing too little of it, or quantizing with none unless forced."""
    if options.data is None:
        if options.quantizes and not options.force:
            raise LlmcError("quantizing needs data to check the engine's accuracy on: give --calib DIR (text "
                            "like your traffic; --int8-calib DIR for static int8), or --force to skip the check")
        return [], []
    folder, what = options.data
    documents = read_documents(folder, tokenizer, vocab_size, what=what)
    pieces = windows(documents, min(CALIBRATION_WINDOW, max_positions), options.calib_tokens)
    calibration, held = split(pieces, what, required=not options.force)
    if options.int8_calib is not None:
        check_calibrator(options.calibrator, sum(len(p) for p in calibration))
    return calibration, held


def apply_precision(model: onnx.ModelProto, options: PrecisionOptions, config: MixedPrecision | None,
                    calibration: list[np.ndarray], outliers: str = "per-token",
                    progress: Callable[[str], None] = lambda message: None) -> dict:
    """Rewrite the optimized graph in place; returns the manifest's "precision" entry.

    Args:
        outliers: the form of the int8 layers whose activations carry token outliers
            (precision/int8.py `OUTLIER_FORMS`): what the backend can run.
    """
    linears = linear_layers(model)
    chosen = {l.name: options.base for l in linears}
    op_rules: dict[str, str] = {}
    if config is not None and config.default is not None:
        chosen = {name: config.default for name in chosen}
    if chosen.get("lm_head") in ("int8", "int8-dynamic"):  # the lm_head rules (module docstring)
        chosen["lm_head"] = "int8-weights"
    elif chosen.get("lm_head") == "int4":
        chosen["lm_head"] = LM_HEAD_UNDER_INT4
    if config is not None:
        ops = {n.op_type for n in model.graph.node}
        for pattern, value in config.rules:
            matched = [name for name in chosen if fnmatch.fnmatchcase(name, pattern)]
            if matched:
                chosen.update(dict.fromkeys(matched, value))
            elif pattern in ops:
                if value not in ("fp32", "fp16"):
                    raise LlmcError(f"{config.source}: op type {pattern}: only fp32 or fp16, not {value}")
                op_rules[pattern] = value
            else:
                raise LlmcError(f"{config.source}: '{pattern}' names no layer or op type of this model "
                                f"(layers: {', '.join(list(chosen)[:3])} … {list(chosen)[-1]})")
    if "int8" in chosen.values() and not calibration:
        raise LlmcError("int8 layers need calibration data: give --int8-calib DIR (or --calib DIR)")

    by_name = {l.name: l for l in linears}
    entry = {"fp16": options.fp16, "linears": chosen}
    block_size = options.weights_block_size or DEFAULT_BLOCK_SIZE
    # int4 first: its activation-aware scales are measured on the float graph and fold into
    # norms and projections that must not have been rewritten yet.
    for bits, label in ((4, "int4"), (8, "int8-weights")):
        layers = [by_name[n] for n, p in chosen.items() if p == label]
        if not layers:
            continue
        activations = None
        if bits == 4 and calibration:  # activation-aware scaling (precision/awq.py)
            activations = observe(model, calibration, sorted({l.node.input[0] for l in layers}), histograms=False,
                                  sample_rows=WEIGHT_SAMPLE_ROWS, progress=progress)
        # An 8-bit lm_head in blocks of at least LM_HEAD_MIN_BLOCK_SIZE (precision/weight_only.py).
        lm_head_block = max(block_size, LM_HEAD_MIN_BLOCK_SIZE) if bits == 8 else block_size
        sizes = {id(l.node): lm_head_block if l.name == "lm_head" else block_size for l in layers}
        for size in sorted(set(sizes.values())):
            quantize_weights(model, bits, size, select=lambda node, size=size: sizes.get(id(node)) == size,
                             symmetric=options.weights_symmetric, activations=activations)
        if any(l.name == "lm_head" for l in layers):
            entry["lm_head_block_size"] = lm_head_block
        entry["weights_block_size"] = block_size
        entry["weights_symmetric"] = options.weights_symmetric
        entry[f"{label}_activation_aware"] = activations is not None
    for label, dynamic in (("int8", False), ("int8-dynamic", True)):
        layers = [by_name[n] for n, p in chosen.items() if p == label]
        if not layers:
            continue
        if label == "int8":
            progress(f"int8: calibrating {len(layers)} linear layers ({options.calibrator}) on "
                     f"{sum(len(w) for w in calibration)} tokens")
        groups = quantize_int8(model, layers, calibration, options.calibrator, smoothquant=options.smoothquant,
                               dynamic=dynamic, outliers=outliers, progress=progress)
        per_token = sum(len(g.layers) for g in groups if g.per_token)
        weights_only = sum(len(g.layers) for g in groups if not g.quantized)
        progress(f"{label}: {len(layers) - per_token - weights_only} layers with static activation scales, "
                 f"{per_token} per-token" + (f", {weights_only} with float activations" if weights_only else ""))
        entry[label] = {"calibrator": options.calibrator, "calibration_tokens": int(sum(len(w) for w in calibration)),
                        "activations": [g.summary() for g in groups]}
    wants_half = options.fp16 or "fp16" in chosen.values() or "fp16" in op_rules.values()
    if wants_half:
        keep_ops = {op for op, p in op_rules.items() if p == "fp32"}
        keep_nodes = {node_key(by_name[n].node) for n, p in chosen.items() if p != "fp16"}
        if not options.fp16:  # fp16 only where asked: every other node stays fp32
            half_ops = {op for op, p in op_rules.items() if p == "fp16"}
            half_nodes = {node_key(by_name[n].node) for n, p in chosen.items() if p == "fp16"}
            keep_nodes |= {node_key(n) for n in model.graph.node if n.op_type not in half_ops and node_key(n) not in half_nodes}
        half_islands = {op for op, p in op_rules.items() if p == "fp16"}
        halves = convert_to_fp16(model, keep_ops, keep_nodes, half_islands)
        progress(f"fp16: {halves} nodes compute in fp16")
        entry["op_rules"] = op_rules
    return entry

