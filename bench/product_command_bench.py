"""The product's command on a real model: `llmc compile model.onnx --fp16 --int8-calib DIR` for
the CPU and for TensorRT, and the TensorRT form of the layers with token outliers, side by side.

SmolLM2-135M-Instruct (tests/smollm2.py), calibrated on data/pystdlib-text/calib; accuracy is
`llmc check`'s (precision/check.py) against the exported fp32 graph on held-out real text (the
first 12 kB of the GPL-3 and data/pystdlib-text/heldout, ~4,000 tokens: bench/precision_bench.py's
folder). Rows:

- cpu: the onnxruntime engine, served through `LLM` (down projections with per-token scales).
- tensorrt/<form>: the exact graph a `--backend tensorrt` build would receive (after the dry run's
  check), run in onnxruntime with the plugin nodes computed by the op's NumPy reference
  (tests/tensorrt_form.py), for each form of the MLP down projections: int8-weights (float
  activations, int8 weights: what llmc ships), static (static scales after smoothing), and fp16
  (the down projections left unquantized by a precision config). A form the accuracy gate
  refuses is reported with its gate figure.

    python bench/product_command_bench.py [--max-tokens 4096] [--json] [--save-json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # smollm2.py, tensorrt_form.py
import record  # noqa: E402
from optimize_bench import DEFAULT_WORK_DIR, log  # noqa: E402
from precision_bench import CALIB, SMOLLM2_WORK, real_text, smollm2_export  # noqa: E402
from tensorrt_form import TensorRTForm, capture_tensorrt_graph  # noqa: E402

from llmc.compiler import build, targets  # noqa: E402
from llmc.compiler.paged_engine import PagedOptions  # noqa: E402
from llmc.compiler.tensorrt_network import TensorRTOptions  # noqa: E402
from llmc.errors import LlmcError  # noqa: E402
from llmc.llm import LLM  # noqa: E402
from llmc.precision.check import ReferenceModel, check  # noqa: E402
from llmc.precision.plan import PrecisionOptions  # noqa: E402

MAX_SEQ_LEN = 512  # the check's 256-token windows
TENSORRT_FORMS = ("int8-weights", "static", "fp16")


def tensorrt_row(onnx_path: Path, work: Path, form: str, reference: ReferenceModel, data: Path,
                 max_tokens: int) -> dict:
    config = None
    if form == "fp16":
        config = work / "down-fp16.json"
        config.write_text(json.dumps({"default": "int8", "rules": {"lm_head": "int8-weights",
                                                                   "layers.*.mlp.down": "fp16"}}))
    graphs = capture_tensorrt_graph(SimpleNamespace(setattr=setattr))
    chosen = targets.TARGETS["tensorrt"]
    if form != "fp16":
        targets.TARGETS["tensorrt"] = dataclasses.replace(chosen, outliers=form)
    try:
        manifest = build.compile_model(
            onnx_path, work / "unused.plan", backend="tensorrt", paged=PagedOptions(max_seq_len=MAX_SEQ_LEN),
            precision=PrecisionOptions(fp16=True, int8_calib=str(CALIB), config=config and str(config)),
            tensorrt=TensorRTOptions(dry_run=True), progress=log)
    except LlmcError as exc:
        return {"row": f"tensorrt/{form}", "refused": str(exc)}
    finally:
        targets.TARGETS["tensorrt"] = chosen
    unsupported = manifest["tensorrt_check"]["unsupported"]
    form_engine = TensorRTForm(graphs[-1], reference_tokenizer(onnx_path), MAX_SEQ_LEN)
    report = check(form_engine, reference, data, max_tokens=max_tokens, generate=8)
    return {"row": f"tensorrt/{form}", "dry_run_unsupported": len(unsupported),
            "gate_ppl_increase_pct": manifest["precision"]["accuracy"]["ppl_increase_pct"], **report.to_dict()}


def reference_tokenizer(onnx_path: Path):
    from llmc.formats.onnx_io import load_onnx

    return build.find_tokenizer(load_onnx(onnx_path, load_weights=False), onnx_path, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens checked")
    parser.add_argument("--work-dir", default=str(DEFAULT_WORK_DIR))
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--save-json", metavar="PATH", help="also write the JSON object to PATH")
    args = parser.parse_args()
    began = record.begin()
    work = Path(args.work_dir).resolve() / SMOLLM2_WORK
    work.mkdir(parents=True, exist_ok=True)
    onnx_path, _ = smollm2_export(work)
    data = real_text(work)
    reference = ReferenceModel(onnx_path)
    rows = []
    with tempfile.TemporaryDirectory(dir=work) as scratch:
        scratch = Path(scratch)
        start = time.perf_counter()
        manifest = build.compile_model(onnx_path, scratch / "cpu.plan", paged=PagedOptions(max_seq_len=MAX_SEQ_LEN),
                                       precision=PrecisionOptions(fp16=True, int8_calib=str(CALIB)), progress=log)
        compile_s = time.perf_counter() - start
        report = check(LLM(scratch / "cpu.plan"), reference, data, max_tokens=args.max_tokens, generate=8)
        rows.append({"row": "cpu", "compile_s": round(compile_s, 1),
                     "gate_ppl_increase_pct": manifest["precision"]["accuracy"]["ppl_increase_pct"], **report.to_dict()})
        for form in TENSORRT_FORMS:
            log(f"TensorRT form: {form}")
            rows.append(tensorrt_row(onnx_path, scratch, form, reference, data, args.max_tokens))
    result = {"benchmark": "product-command", "model": "SmolLM2-135M-Instruct",
              "command": "llmc compile smol.onnx --fp16 --int8-calib data/pystdlib-text/calib [--backend tensorrt --dry-run]",
              "rows": rows, "record": record.finish(began)}
    if args.save_json:
        record.write_json(args.save_json, result)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'row':24} {'ppl +%':>8} {'top-1':>6} {'gate +%':>8}")
    for row in rows:
        if "refused" in row:
            print(f"{row['row']:24} refused by the gate: {row['refused']}")
        else:
            print(f"{row['row']:24} {row['ppl_increase_pct']:8.2f} {row['top1_agreement']:6.3f} "
                  f"{row['gate_ppl_increase_pct']:8.2f}")


if __name__ == "__main__":
    main()
