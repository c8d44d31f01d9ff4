"""Precision benchmark (issue 6): accuracy and decode speed of every precision, side by side.

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

    python bench/precision_bench.py [--json] [--quick] [--save-json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from optimize_bench import DEFAULT_WORK_DIR, ModelSpec, _cpu_name, _git_state, _versions, ensure_checkpoint, log  # noqa: E402

from llmc.compiler.build import compile_model  # noqa: E402
from llmc.compiler.export import export  # noqa: E402
from llmc.compiler.pipeline import optimize_file  # noqa: E402
from llmc.llm import LLM  # noqa: E402
from llmc.precision.calibration import prefill_feeds  # noqa: E402
from llmc.precision.check import ReferenceModel, check  # noqa: E402
from llmc.precision.data import read_documents, windows  # noqa: E402
from llmc.precision.plan import PrecisionOptions  # noqa: E402
from llmc.runtime.bench import WorkloadSpec, prepare, run_workload, summarize  # noqa: E402

MODEL = ROOT / "data" / "pystdlib-llama"
CALIB = ROOT / "data" / "pystdlib-text" / "calib"
HELD_OUT = ROOT / "data" / "pystdlib-text" / "heldout"
GOALS = {"int8_ppl_increase_pct": 1.5, "int4_ppl_increase_pct": 5.0, "int4_decode_speedup": 2.0}

VARIANTS = {
    "fp32": PrecisionOptions(),
    "fp16": PrecisionOptions(fp16=True),
    "int8-minmax": PrecisionOptions(int8_calib=str(CALIB), calibrator="minmax"),
    "int8-percentile": PrecisionOptions(int8_calib=str(CALIB), calibrator="percentile"),
    "int8-entropy": PrecisionOptions(int8_calib=str(CALIB), calibrator="entropy"),
    "int8-minmax-smoothquant": PrecisionOptions(int8_calib=str(CALIB), calibrator="minmax", smoothquant=0.5),
    "int8-weights": PrecisionOptions(weights="int8"),
    "int4-weights": PrecisionOptions(weights="int4"),
}


def decode_tok_s(engine: Path, threads: int, output_len: int) -> float:
    spec = WorkloadSpec(requests=1, prompt_len=32, output_len=output_len, seed=0)
    llm_engine, workload = prepare(engine, spec, threads=threads)
    run_workload(llm_engine, workload[:1])  # warm-up
    llm_engine, workload = prepare(engine, spec, threads=threads)
    summary = summarize(run_workload(llm_engine, workload))
    return round(1000.0 / summary["tpot_ms_p50"], 1)


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


def run(args) -> dict:
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
    calibration = None
    variants = dict(list(VARIANTS.items())[:2] + list(VARIANTS.items())[-1:]) if args.quick else VARIANTS
    for name, options in variants.items():
        log(f"{name}: compiling")
        engine = work / f"{name}.plan"
        try:
            start = time.perf_counter()
            compile_model(reference, engine, precision=options)
            build_s = time.perf_counter() - start
            llm = LLM(engine, threads)
            if calibration is None:
                docs = read_documents(CALIB, llm.tokenizer, llm.manifest["geometry"]["vocab_size"])
                calibration = windows(docs, 256, 4096)
            report = check(llm, ReferenceModel(reference, threads), HELD_OUT, max_tokens=check_tokens)
            results[name] = {**report.to_dict(), "decode_tok_s": decode_tok_s(engine, threads, output_len),
                             "build_s": round(build_s, 1), "engine_mb": round(engine.stat().st_size / 2**20, 2)}
            log(f"{name}: ppl {report.engine_ppl:.3f} ({report.ppl_increase_pct:+.2f}%), "
                f"decode {results[name]['decode_tok_s']} tok/s")
        except Exception as exc:  # a failing variant is a result, not the end of the run
            errors[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            log(f"{name}: FAILED {errors[name]}")
    for kind in ([] if args.quick else ["static", "dynamic"]):
        name = f"ort-quantize-{kind}"
        log(f"{name}: quantizing")
        try:
            quantized = ort_quantized(level2, work, kind, calibration)
            engine = work / f"{name}.plan"
            compile_model(quantized, engine, level=0)
            llm = LLM(engine, threads)
            report = check(llm, ReferenceModel(reference, threads), HELD_OUT, max_tokens=check_tokens)
            results[name] = {**report.to_dict(), "decode_tok_s": decode_tok_s(engine, threads, output_len),
                             "engine_mb": round(engine.stat().st_size / 2**20, 2)}
            log(f"{name}: ppl {report.engine_ppl:.3f} ({report.ppl_increase_pct:+.2f}%), "
                f"decode {results[name]['decode_tok_s']} tok/s")
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
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
                errors[f"32M {name}"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    fp32 = results.get("fp32", {}).get("decode_tok_s")
    for r in results.values():
        r["decode_vs_fp32"] = round(r["decode_tok_s"] / fp32, 2) if fp32 else None
    return {"benchmark": "precision", "quick": args.quick, "threads": threads,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "variants": results, "decode_tok_s_32m": speed32,
            "decode_vs_fp32_32m": {k: round(v / speed32["fp32"], 2) for k, v in speed32.items()} if "fp32" in speed32 else {},
            "errors": errors, "goals": GOALS, "machine": {"cpu": _cpu_name()}, "versions": _versions(),
            "git": _git_state()}


def render(result: dict) -> str:
    lines = [f"Precision benchmark — trained 3.5M Llama, held-out perplexity; decode: 1 request, {result['threads']} threads",
             "", f"{'variant':<26}{'ppl':>9}{'Δppl %':>9}{'top-1':>8}{'KL':>10}{'decode tok/s':>14}{'× fp32':>8}{'MB':>7}"]
    for name, r in result["variants"].items():
        lines.append(f"{name:<26}{r['engine_ppl']:9.3f}{r['ppl_increase_pct']:+9.2f}{r['top1_agreement']:8.3f}"
                     f"{r['mean_kl']:10.2e}{r['decode_tok_s']:14.1f}{r['decode_vs_fp32'] or 0:8.2f}{r['engine_mb']:7.2f}")
    if result["decode_tok_s_32m"]:
        lines += ["", "32M Llama decode tok/s: " + ", ".join(
            f"{k} {v} ({result['decode_vs_fp32_32m'][k]}×)" for k, v in result["decode_tok_s_32m"].items())]
    lines += [f"FAILED {k}: {v}" for k, v in result["errors"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="three variants, short decode: a smoke run")
    parser.add_argument("--save-json", metavar="PATH")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", default=str(DEFAULT_WORK_DIR))
    args = parser.parse_args(argv)
    result = run(args)
    if args.save_json:
        Path(args.save_json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 1 if result["errors"] and not result["variants"] else 0


if __name__ == "__main__":
    sys.exit(main())
