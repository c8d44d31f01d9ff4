"""`llmc export`'s two paths on one checkpoint: llmc's own module (the table's families) against
transformers' module (every other family, models/transformers_module.py), forced here for a family
both can load.

The checkpoint is a Llama of ordinary shape written by transformers with seeded random weights
(default 8 layers, hidden 512, 8 heads, 4 kv heads, head dim 64, vocab 258). For each path and
exporter, `--repeats` exports (`compiler.export.export`, its parity check included), each into a
fresh file:

  load_s     the checkpoint into the path's module
  export_s   trace + write + parity check, median of the repeats (min and max beside it)
  parity     the check's max abs difference between onnxruntime and PyTorch
  nodes      nodes in the written graph
  optimized  nodes after `llmc optimize`'s default level, and each pass's match count (`fused`):
             what an exporter's graph gives the passes to fuse

and the two paths' graphs run on the same seeded inputs (`max_abs_between_paths`).

    python bench/export_paths_bench.py [--layers 8] [--hidden 512] [--repeats 3]
                                       [--exporters auto,dynamo] [--work-dir DIR] [--save-json PATH]

Prints one JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

from llmc.compiler.export import export, model_geometry, sample_inputs
from llmc.compiler.pipeline import optimize
from llmc.models import load_checkpoint
from llmc.models.checkpoint import LoadedModel, read_config
from llmc.models.transformers_module import load_transformers_checkpoint
from llmc.tokenizer import Tokenizer, byte_level_tokenizer


def write_llama(folder: Path, layers: int, hidden: int) -> Path:
    heads = hidden // 64
    config = transformers.LlamaConfig(vocab_size=258, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=max(1, heads // 2), max_position_embeddings=2048,
                                      bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    byte_level_tokenizer().save(folder)
    return folder


def load(folder: Path, path: str) -> LoadedModel:
    if path == "table":
        return load_checkpoint(folder)
    model = load_transformers_checkpoint(folder, read_config(folder))
    return LoadedModel(model=model, tokenizer=Tokenizer.from_folder(folder), name=folder.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--exporters", default="auto,dynamo")
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--save-json", metavar="PATH", help="also write the JSON object to PATH")
    args = parser.parse_args()
    began = record.begin()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="export-paths-"))
    folder = write_llama(work / "llama", args.layers, args.hidden)
    runs, graphs = [], {}
    for exporter in args.exporters.split(","):
        for path in ("table", "transformers"):
            start = time.perf_counter()
            loaded = load(folder, path)
            load_s = time.perf_counter() - start
            times = []
            for repeat in range(args.repeats):
                output = work / f"{path}-{exporter}-{repeat}" / "model.onnx"
                output.parent.mkdir(parents=True)
                start = time.perf_counter()
                check = export(loaded, output, exporter=exporter)
                times.append(time.perf_counter() - start)
            graphs[path, exporter] = output
            run = {"path": path, "exporter": exporter, "module": type(loaded.model).__name__,
                   "load_s": round(load_s, 2), "export_s": round(statistics.median(times), 2),
                   "export_s_range": [round(min(times), 2), round(max(times), 2)],
                   "parity": check.max_abs, "nodes": len(onnx.load(output, load_external_data=False).graph.node)}
            _, passes = optimize(onnx.load(output))
            run["optimized"] = passes[-1]["nodes_after"]
            run["fused"] = {p["pass"]: p["matches"] for p in passes if p["matches"]}
            print(json.dumps(run), file=sys.stderr)
            runs.append(run)
    geometry = model_geometry(load(folder, "table").model)
    feeds = {k: v.numpy() for k, v in sample_inputs(geometry, 2, 7, 5, seed=3).items()}
    between = {}
    for exporter in args.exporters.split(","):
        logits = [ort.InferenceSession(str(graphs[p, exporter])).run(["logits"], feeds)[0]
                  for p in ("table", "transformers")]
        between[exporter] = float(np.max(np.abs(logits[0] - logits[1])))
    weights_mb = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e6
    result = {"benchmark": "export-paths",
              "checkpoint": {"family": "llama", "layers": args.layers, "hidden": args.hidden,
                             "weights_mb": round(weights_mb, 1)},
              "torch_threads": torch.get_num_threads(), "runs": runs,
              "max_abs_between_paths": between, "record": record.finish(began)}
    if args.save_json:
        record.write_json(args.save_json, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
