"""Precision benchmark: accuracy and decode speed of every precision, side by side.

Accuracy on the trained model (data/pystdlib-llama, scripts/train_tiny_model.py): perplexity on
held-out standard-library text (data/pystdlib-text/heldout) and its increase over the fp32
export, with `llmc check`'s other metrics. Decode speed: one request, 32 prompt tokens, 128
generated (EOS ignored), through the serving Engine; tokens/s = 1000 / median time per output
token. Speed is also measured on optimize_bench's 32M-parameter Llama (random weights, so speed
only): the trained model's 14 MB of fp32 weights fit in cache, where weight-only formats cannot
show what they save on memory-bound decode.

Variants: llmc fp32, fp16, int8 with each calibrator (and SmoothQuant 0.5 with minmax), int8
weight-only, int4 weight-only; and onnxruntime.quantization's quantize_static (QDQ, per-channel
int8 weights, minmax) and quantize_dynamic (int8 weights) applied to llmc's level-2 graph, then
compiled with `--level 0` so both go through the same engine path.

`--model smollm2` measures SmolLM2-135M-Instruct (tests/smollm2.py) instead, on real
text: the held-out standard-library text plus the first 12 kB of the GPL-3 (English prose),
~4,000 tokens; calibration as above. Its export is cached in the work folder (delete
model.export.json to export again). The default pipeline (level 2) runs once, and every variant
compiles that graph with `--level 0`: llmc's precisions, and onnxruntime's quantize_dynamic (int8)
and MatMulNBitsQuantizer (int4 asymmetric in blocks of 128; symmetric in blocks of 32 at
accuracy_level 4; both with lm_head left fp32). Engines hold 512 positions, enough for the
check's 256-token windows and the decode request.

    python bench/precision_bench.py [--model pystdlib-llama|smollm2] [--json] [--quick] [--save-json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(ROOT / "tests"))  # smollm2.py, the SmolLM2 checkpoint fixture
import record  # noqa: E402
from optimize_bench import DEFAULT_WORK_DIR, ModelSpec, ensure_checkpoint, log  # noqa: E402

from llmc.compiler.build import compile_model, find_tokenizer  # noqa: E402
from llmc.compiler.export import export  # noqa: E402
from llmc.formats.onnx_io import load_onnx  # noqa: E402
from llmc.compiler.paged_engine import PagedOptions  # noqa: E402
from llmc.compiler.pipeline import optimize_file  # noqa: E402
from llmc.llm import LLM  # noqa: E402
from llmc.precision.calibration import prefill_feeds  # noqa: E402
from llmc.precision.check import ReferenceModel, check  # noqa: E402
from llmc.precision.data import read_documents, windows  # noqa: E402
from llmc.precision.linears import linear_layers  # noqa: E402
from llmc.precision.plan import PrecisionOptions  # noqa: E402
from llmc.runtime.bench import WorkloadSpec, prepare, run_workload, summarize  # noqa: E402

MODEL = ROOT / "data" / "pystdlib-llama"
CALIB = ROOT / "data" / "pystdlib-text" / "calib"
HELD_OUT = ROOT / "data" / "pystdlib-text" / "heldout"
GOALS = {"int8_ppl_increase_pct": 1.5, "int4_ppl_increase_pct": 5.0, "int4_decode_speedup": 2.0}

SMOLLM2_WORK = "precision-smollm2"
SMOLLM2_PAGED = PagedOptions(max_seq_len=512)  # the check's 256-token windows, the 160-token request; a small pool
ENGLISH, ENGLISH_BYTES = Path("/usr/share/common-licenses/GPL-3"), 12_000


def options(**fields) -> PrecisionOptions:
    """PrecisionOptions with `force=True` where that field exists: the bench measures the engines
    an accuracy gate would refuse."""
    if "force" in {f.name for f in dataclasses.fields(PrecisionOptions)}:
        fields.setdefault("force", True)
    return PrecisionOptions(**fields)


# Variant name → PrecisionOptions fields: one line adds a variant.
VARIANTS = {name: options(**fields) for name, fields in {
    "fp32": dict(),
    "fp16": dict(fp16=True),
    "int8-minmax": dict(int8_calib=str(CALIB), calibrator="minmax"),
    "int8-percentile": dict(int8_calib=str(CALIB), calibrator="percentile"),
    "int8-entropy": dict(int8_calib=str(CALIB), calibrator="entropy"),
    "int8-minmax-smoothquant": dict(int8_calib=str(CALIB), calibrator="minmax", smoothquant=0.5),
    "int8-weights": dict(weights="int8"),
    "int4-weights": dict(weights="int4"),
}.items()}

SMOLLM2_VARIANTS = {
    "fp32": dict(),
    "fp16": dict(fp16=True),
    "int8": dict(int8_calib=str(CALIB)),
    "int8-smoothquant-off": dict(int8_calib=str(CALIB), smoothquant=0.0),
    "int8-percentile": dict(int8_calib=str(CALIB), calibrator="percentile"),
    "int8-dynamic-nodata": dict(int8_dynamic=True),
    "int8-dynamic-smoothed": dict(int8_dynamic=True, calib=str(CALIB)),
    "int8-weights": dict(weights="int8"),
    "int4-weights-nodata": dict(weights="int4"),
    "int4-weights": dict(weights="int4", calib=str(CALIB)),
}
# onnxruntime.quantization on llmc's level-2 graph: name → (quantizer, its keyword arguments).
SMOLLM2_ORT = {
    "ort-quantize-dynamic": ("dynamic", {}),
    "ort-int4-asym-b128": ("matmul-nbits", dict(bits=4, block_size=128, is_symmetric=False)),
    "ort-int4-sym-b32-acc4": ("matmul-nbits", dict(bits=4, block_size=32, is_symmetric=True, accuracy_level=4)),
}
SMOLLM2_QUICK = ("fp32", "int4-weights", "ort-int4-sym-b32-acc4")


class CachedReference(ReferenceModel):
    """The reference's logits computed once per token sequence: every variant is checked on the
    same windows and the same greedy continuation."""

    def __init__(self, path, threads: int | None = None):
        super().__init__(path, threads)
        self._cache: dict[bytes, np.ndarray] = {}

    def logits(self, token_ids: np.ndarray) -> np.ndarray:
        key = np.asarray(token_ids, np.int64).tobytes()
        if key not in self._cache:
            self._cache[key] = super().logits(token_ids)
        return self._cache[key]


def decode_tok_s(engine: Path, threads: int, output_len: int) -> float:
    spec = WorkloadSpec(requests=1, prompt_len=32, output_len=output_len, seed=0)
    llm_engine, workload = prepare(engine, spec, threads=threads)
    run_workload(llm_engine, workload[:1])  # warm-up
    llm_engine, workload = prepare(engine, spec, threads=threads)
    summary = summarize(run_workload(llm_engine, workload))
    return round(1000.0 / summary["tpot_ms_p50"], 1)


def measure(engine: Path, reference: ReferenceModel, data: Path, *, threads: int, check_tokens: int,
            output_len: int) -> dict:
    """`llmc check` against the reference on `data`, decode speed and engine size."""
    report = check(LLM(engine, threads), reference, data, max_tokens=check_tokens)
    return {**report.to_dict(), "decode_tok_s": decode_tok_s(engine, threads, output_len),
            "engine_mb": round(engine.stat().st_size / 2**20, 2)}


def _failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


def ort_weight_only(level2: Path, target: Path, **config) -> Path:
    """onnxruntime's MatMulNBitsQuantizer on llmc's level-2 graph, lm_head left fp32."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(level2))
    heads = [layer.node for layer in linear_layers(model) if layer.name == "lm_head"]
    for node in heads:
        node.name = node.name or "lm_head"  # the quantizer excludes by node name
    logging.getLogger(MatMulNBitsQuantizer.__module__).setLevel(logging.WARNING)  # a line per node otherwise
    quantizer = MatMulNBitsQuantizer(model, nodes_to_exclude=[node.name for node in heads], **config)
    quantizer.process()
    quantizer.model.save_model_to_file(str(target))
    return target


def ort_quantized(level2: Path, out: Path, kind: str, calibration: list[np.ndarray]) -> Path:
    """onnxruntime.quantization applied to llmc's level-2 graph."""
    import onnxruntime as ort
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_dynamic, quantize_static)

    target = out / f"ort-{kind}.onnx"
    if kind == "dynamic":
        quantize_dynamic(str(level2), str(target), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
        return target
    session = ort.InferenceSession(str(level2), providers=["CPUExecutionProvider"])

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([prefill_feeds(session, w) for w in calibration])

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(str(level2), str(target), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                    calibrate_method=CalibrationMethod.MinMax,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    return target


def run_pystdlib_llama(args) -> dict:
    work = Path(args.work_dir).resolve() / "precision"
    work.mkdir(parents=True, exist_ok=True)
    threads, output_len = args.threads, 16 if args.quick else 128
    reference = work / "model.onnx"
    export(str(MODEL), reference)
    log("exported the trained model")
    level2 = work / "level2.onnx"
    optimize_file(reference, level2, level=2)
    results, errors = {}, {}
    check_tokens = 512 if args.quick else 4096
    reference_model = CachedReference(reference, threads)
    variants = dict(list(VARIANTS.items())[:2] + list(VARIANTS.items())[-1:]) if args.quick else VARIANTS
    for name, precision in variants.items():
        log(f"{name}: compiling")
        engine = work / f"{name}.plan"
        try:
            start = time.perf_counter()
            compile_model(reference, engine, precision=precision)
            build_s = time.perf_counter() - start
            results[name] = {**measure(engine, reference_model, HELD_OUT, threads=threads,
                                       check_tokens=check_tokens, output_len=output_len),
                             "build_s": round(build_s, 1)}
            _log_result(name, results[name])
        except Exception as exc:  # a failing variant is a result, not the end of the run
            errors[name] = _failure(exc)
            log(f"{name}: FAILED {errors[name]}")
    tokenizer = find_tokenizer(load_onnx(reference, load_weights=False), reference, None)
    calibration = windows(read_documents(CALIB, tokenizer, reference_model.vocab_size), 256, 4096)
    for kind in ([] if args.quick else ["static", "dynamic"]):
        name = f"ort-quantize-{kind}"
        log(f"{name}: quantizing")
        try:
            quantized = ort_quantized(level2, work, kind, calibration)
            engine = work / f"{name}.plan"
            compile_model(quantized, engine, level=0)
            results[name] = measure(engine, reference_model, HELD_OUT, threads=threads,
                                    check_tokens=check_tokens, output_len=output_len)
            _log_result(name, results[name])
        except Exception as exc:
            errors[name] = _failure(exc)
            log(f"{name}: FAILED {errors[name]}")

    speed32 = {}
    if not args.quick:
        checkpoint = Path(args.work_dir).resolve() / "hf-llama-32m"
        ensure_checkpoint(checkpoint, ModelSpec())
        big = work / "llama32m.onnx"
        export(str(checkpoint), big)
        for name in ("fp32", "fp16", "int8-weights", "int4-weights"):
            engine = work / f"llama32m-{name}.plan"
            try:
                compile_model(big, engine, precision=VARIANTS[name])
                speed32[name] = decode_tok_s(engine, threads, output_len)
                log(f"32M {name}: decode {speed32[name]} tok/s")
            except Exception as exc:
                errors[f"32M {name}"] = _failure(exc)
    _add_speedups(results)
    return {"benchmark": "precision", "model": "pystdlib-llama", "quick": args.quick, "threads": threads,
            "title": "trained 3.5M Llama, held-out perplexity",
            "variants": results, "decode_tok_s_32m": speed32,
            "decode_vs_fp32_32m": {k: round(v / speed32["fp32"], 2) for k, v in speed32.items()} if "fp32" in speed32 else {},
            "errors": errors, "goals": GOALS}


def _log_result(name: str, r: dict) -> None:
    log(f"{name}: ppl {r['engine_ppl']:.3f} ({r['ppl_increase_pct']:+.2f}%), top-1 {r['top1_agreement']:.3f}, "
        f"decode {r['decode_tok_s']} tok/s, {r['engine_mb']} MB")


def _add_speedups(results: dict) -> None:
    fp32 = results.get("fp32", {}).get("decode_tok_s")
    for r in results.values():
        r["decode_vs_fp32"] = round(r["decode_tok_s"] / fp32, 2) if fp32 else None


def smollm2_export(work: Path) -> tuple[Path, dict]:
    """SmolLM2-135M-Instruct exported by llmc, cached: `model.onnx` counts only once its parity
    record is written beside it (an interrupted export is redone)."""
    from smollm2 import smollm2_folder

    onnx_path, record = work / "model.onnx", work / "model.export.json"
    if onnx_path.is_file() and record.is_file():
        log(f"using the cached export {onnx_path}")
        return onnx_path, json.loads(record.read_text())
    record.unlink(missing_ok=True)
    folder = smollm2_folder()
    log(f"exporting {folder} (minutes)")
    start = time.perf_counter()
    parity = export(str(folder), onnx_path, progress=log)
    entry = {"checkpoint": str(folder), "export_s": round(time.perf_counter() - start, 1),
             "parity_max_abs": parity.max_abs if parity else None}
    record.write_text(json.dumps(entry, indent=2))
    return onnx_path, entry


def real_text(work: Path) -> Path:
    """The held-out folder: English prose first (files are read in name order, so the token cap
    takes all of it), then the held-out standard-library text."""
    folder = work / "realtext"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "english.txt").write_text(ENGLISH.read_bytes()[:ENGLISH_BYTES].decode("utf-8", "ignore"))
    (folder / "python.txt").write_text((HELD_OUT / "heldout.txt").read_text())
    return folder


def run_smollm2(args) -> dict:
    work = Path(args.work_dir).resolve() / SMOLLM2_WORK
    work.mkdir(parents=True, exist_ok=True)
    threads, output_len = args.threads, 16 if args.quick else 128
    check_tokens = 512 if args.quick else 4096
    reference, export_entry = smollm2_export(work)
    data = real_text(work)
    reference_model = CachedReference(reference, threads)
    keep = ((lambda name: name in SMOLLM2_QUICK) if args.quick
            else (lambda name: name in args.variants) if args.variants else (lambda name: True))
    # Every variant compiles the same level-2 graph (the default pipeline, run once) with
    # --level 0: llmc's precision applies after optimization anyway, onnxruntime's quantizers
    # start from the same graph, and the pipeline runs once instead of once per variant.
    level2 = work / "level2.onnx"
    log("optimizing the export at level 2 (minutes)")
    start = time.perf_counter()
    optimize_file(reference, level2, level=2)
    log(f"optimized in {time.perf_counter() - start:.0f} s")
    variants = {name: ("llmc", fields) for name, fields in SMOLLM2_VARIANTS.items()}
    variants.update(SMOLLM2_ORT)
    results, errors = {}, {}
    for name, (kind, config) in variants.items():
        if not keep(name):
            continue
        source, engine = level2, work / f"{name}.plan"
        log(f"{name}: {'compiling' if kind == 'llmc' else 'quantizing'}")
        try:
            start = time.perf_counter()
            if kind == "dynamic":
                source = ort_quantized(level2, work, "dynamic", [])
            elif kind == "matmul-nbits":
                source = ort_weight_only(level2, work / f"{name}.onnx", **config)
            compile_model(source, engine, level=0, paged=SMOLLM2_PAGED,
                          precision=options(**config) if kind == "llmc" else PrecisionOptions(),
                          progress=lambda message, name=name: log(f"{name}: {message}"))
            build_s = time.perf_counter() - start
            log(f"{name}: built in {build_s:.0f} s; checking")
            results[name] = {**measure(engine, reference_model, data, threads=threads, check_tokens=check_tokens,
                                       output_len=output_len), "build_s": round(build_s, 1)}
            _log_result(name, results[name])
        except Exception as exc:  # a failing variant is a result, not the end of the run
            errors[name] = _failure(exc)
            log(f"{name}: FAILED {errors[name]}")
        finally:
            engine.unlink(missing_ok=True)  # ~650 MB each at fp32
            if source != level2:
                source.unlink(missing_ok=True)
    _add_speedups(results)
    return {"benchmark": "precision", "model": "smollm2", "quick": args.quick, "threads": threads,
            "title": "SmolLM2-135M-Instruct, real text (Python + English)",
            "data": {"files": ["english.txt: first 12 kB of GPL-3", "python.txt: data/pystdlib-text/heldout"],
                     "max_tokens": check_tokens, "calibration": str(CALIB.relative_to(ROOT))},
            "export": export_entry, "max_seq_len": SMOLLM2_PAGED.max_seq_len,
            "variants_options": {**SMOLLM2_VARIANTS, **{k: {"quantizer": q, **c} for k, (q, c) in SMOLLM2_ORT.items()}},
            "variants": results, "decode_tok_s_32m": {}, "decode_vs_fp32_32m": {}, "errors": errors}


def render(result: dict) -> str:
    lines = [f"Precision benchmark — {result['title']}; decode: 1 request, {result['threads']} threads",
             "", f"{'variant':<26}{'ppl':>9}{'Δppl %':>9}{'top-1':>8}{'KL':>10}{'decode tok/s':>14}{'× fp32':>8}{'MB':>7}"]
    for name, r in result["variants"].items():
        lines.append(f"{name:<26}{r['engine_ppl']:9.3f}{r['ppl_increase_pct']:+9.2f}{r['top1_agreement']:8.3f}"
                     f"{r['mean_kl']:10.2e}{r['decode_tok_s']:14.1f}{r['decode_vs_fp32'] or 0:8.2f}{r['engine_mb']:7.2f}")
    if result["decode_tok_s_32m"]:
        lines += ["", "32M Llama decode tok/s: " + ", ".join(
            f"{k} {v} ({result['decode_vs_fp32_32m'][k]}×)" for k, v in result["decode_tok_s_32m"].items())]
    lines += [f"FAILED {k}: {v}" for k, v in result["errors"].items()]
    return "\n".join(lines)


RUNS = {"pystdlib-llama": run_pystdlib_llama, "smollm2": run_smollm2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=RUNS, default="pystdlib-llama",
                        help="the trained 3.5M Llama (default) or SmolLM2-135M-Instruct on real text")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="three variants, short decode: a smoke run")
    parser.add_argument("--save-json", metavar="PATH")
    parser.add_argument("--variants", type=lambda text: text.split(","), metavar="A,B",
                        help="SmolLM2: only these variants (names as in the table), e.g. to rerun after a change")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", default=str(DEFAULT_WORK_DIR))
    args = parser.parse_args(argv)
    began = record.begin()
    result = RUNS[args.model](args)
    result["record"] = record.finish(began)
    if args.save_json:
        record.write_json(args.save_json, result)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 1 if result["errors"] and not result["variants"] else 0


if __name__ == "__main__":
    sys.exit(main())
