"""Large-model benchmark: a 1B-parameter Llama-shaped checkpoint through llmc and onnxruntime-genai.

The checkpoint has TinyLlama-1.1B's shape (22 layers, hidden 2,048, intermediate 5,632, 32 heads,
4 kv heads, vocab 32,000), random seeded weights, 4.4 GB in fp32, and llmc's byte-level tokenizer.
Each step runs in a process of its own under /usr/bin/time, which reports its peak resident
memory (max RSS):

  llmc export           HF folder → model.onnx + model.onnx.data (with the seeded parity check)
  llmc compile          default level, paged KV → engine.plan
  llmc compile --weights int4, --fp16   (with --all)
  llmc run              engine.plan, prompt "hi", 4 new tokens
  torch.onnx export     transformers' model, torch.onnx.export(dynamo=True, external_data=True)
  llmc optimize         of that export (default level)
  genai builder         python -m onnxruntime_genai.models.builder -p fp32 -e cpu

    python bench/large_model_bench.py [--json] [--save-json PATH] [--all] [--work-dir DIR] [--steps export,compile,...]

Progress goes to stderr; stdout gets the table, or one JSON object with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

DEFAULT_WORK_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "llmc-large-bench"

CONFIG = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=256, eos_token_id=257,
    tie_word_embeddings=False,
)


def log(message: str) -> None:
    print(f"[large-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def ensure_checkpoint(folder: Path, seed: int = 0, positions: int = CONFIG["max_position_embeddings"]) -> Path:
    """Write the random 1B checkpoint (config.json, model.safetensors, tokenizer.json) once.

    Args:
        folder: destination; reused when it already holds the checkpoint.
        seed: torch.manual_seed for the weights.
        positions: max_position_embeddings.
    """
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    import torch
    import transformers

    from llmc.tokenizer import byte_level_tokenizer

    log(f"writing the 1B checkpoint to {folder}")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**CONFIG, "max_position_embeddings": positions})
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="50GB")
    byte_level_tokenizer().save(folder)
    return folder


def torch_export(checkpoint: Path, output: Path) -> None:
    """torch's own export of the checkpoint, as a user would write it: transformers' model,
    `torch.onnx.export(dynamo=True, external_data=True)`, input_ids + attention_mask → logits."""
    import torch
    import transformers

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    batch, seq = torch.export.Dim("batch", min=1), torch.export.Dim("sequence", min=1)
    example = (torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.int64))
    output.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(Logits(model), example, str(output), dynamo=True, external_data=True,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))


def measured(name: str, command: list[str], log_file: Path) -> dict:
    """Run `command` under /usr/bin/time -v; returns its wall seconds, peak RSS and exit code."""
    log(f"{name}: {' '.join(command)}")
    start = time.perf_counter()
    with open(log_file, "w") as out:
        proc = subprocess.run(["/usr/bin/time", "-v", *command], stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    text = log_file.read_text(errors="replace")
    result = {"step": name, "seconds": round(seconds, 1), **parse_time_log(text),
              "exit_code": proc.returncode, "log": str(log_file)}
    log(f"{name}: {result['seconds']} s ({result['cpu_seconds']} s CPU), peak RSS {result['peak_rss_gb']} GB, "
        f"exit {proc.returncode}")
    return result


def parse_time_log(text: str) -> dict:
    """Peak RSS (GB) and CPU seconds (user + system) from /usr/bin/time -v's report. CPU time is
    the steadier figure on a shared machine: wall time grows with other processes' load."""
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    cpu = [float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", text)]
    return {"peak_rss_gb": round(int(rss.group(1)) * 1024 / 1e9, 2) if rss else None,
            "cpu_seconds": round(sum(cpu), 1) if cpu else None}


def _size_gb(*paths: Path) -> float:
    return round(sum(p.stat().st_size for p in paths if p.is_file()) / 1e9, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--save-json", metavar="PATH", help="also write the JSON object to PATH")
    parser.add_argument("--all", action="store_true", help="also compile --weights int4 and --fp16")
    parser.add_argument("--steps", default=None, help="comma-separated subset of the steps")
    parser.add_argument("--torch-export", nargs=2, type=Path, metavar=("CHECKPOINT", "OUTPUT"),
                        help=argparse.SUPPRESS)  # one step, run in a process of its own
    args = parser.parse_args()
    if args.torch_export:
        torch_export(*args.torch_export)
        return

    began = record.begin()
    work = args.work_dir
    checkpoint = ensure_checkpoint(work / "checkpoint")
    llmc = [sys.executable, "-c", "from llmc.cli import main; main()"]
    onnx_path = work / "llmc" / "model.onnx"
    steps = {
        "llmc export": llmc + ["export", str(checkpoint), "-o", str(onnx_path)],
        "llmc compile": llmc + ["compile", str(onnx_path), "-o", str(work / "llmc" / "engine.plan")],
        "llmc run": llmc + ["run", str(work / "llmc" / "engine.plan"), "--prompt", "hi",
                            "--max-new-tokens", "4"],
    }
    if args.all:
        steps["llmc compile --weights int4"] = llmc + ["compile", str(onnx_path), "-o", str(work / "llmc" / "int4.plan"),
                                                       "--weights", "int4", "--force"]  # random weights: nothing to check
        steps["llmc compile --fp16"] = llmc + ["compile", str(onnx_path), "-o", str(work / "llmc" / "fp16.plan"), "--fp16"]
    torch_onnx = work / "torch" / "model.onnx"
    steps["torch.onnx export (dynamo)"] = [sys.executable, __file__, "--torch-export", str(checkpoint), str(torch_onnx)]
    steps["llmc optimize (torch's export)"] = llmc + ["optimize", str(torch_onnx), "-o",
                                                      str(work / "torch" / "optimized.onnx")]
    steps["genai builder"] = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint),
                              "-o", str(work / "genai"), "-p", "fp32", "-e", "cpu"]
    wanted = set(args.steps.split(",")) if args.steps else set(steps)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    results = []
    for name, command in steps.items():
        if name in wanted:
            log_name = name.replace(" ", "_").replace("-", "") + ".log"
            results.append(measured(name, command, work / "logs" / log_name))
    weights_gb = _size_gb(checkpoint / "model.safetensors")
    report = {"benchmark": "large-model",
              "checkpoint": {**CONFIG, "weights_gb": weights_gb},
              "onnx_gb": _size_gb(onnx_path, onnx_path.with_name("model.onnx.data")),
              "engine_gb": _size_gb(work / "llmc" / "engine.plan"),
              "results": results, "record": record.finish(began)}
    if args.save_json:
        record.write_json(args.save_json, report)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"1B checkpoint: {weights_gb} GB fp32 weights")
    print("| step | wall s | CPU s | peak RSS GB | × weights | exit |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = r["peak_rss_gb"] / weights_gb if r["peak_rss_gb"] else float("nan")
        print(f"| {r['step']} | {r['seconds']} | {r['cpu_seconds']} | {r['peak_rss_gb']} | {ratio:.2f} | {r['exit_code']} |")


if __name__ == "__main__":
    main()
