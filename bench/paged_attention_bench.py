"""Paged-attention benchmark: KV memory utilization and CPU attention latency.

    python bench/paged_attention_bench.py [--json] [--quick] [--save-json PATH]

1. Utilization: cached token slots in use ÷ slots allocated, on a mix of prompt and output
   lengths, for paged blocks of several sizes against contiguous max-length allocation (what a
   static-batch runtime reserves per request). Arithmetic over the workload, seeded.
2. Latency: one decode token per sequence against a cached context of 128 … 4096, CPU, 2
   threads: the CPU backend's in-place kernel (plugins/paged_attention_cpu.py, block 16, "cpu-16")
   and the dense form of the op in onnxruntime (plugins/paged_attention_onnx.py, several block
   sizes) against dense Attention-23 over a contiguous cache (what the fused contiguous graph
   runs). Variants run interleaved, round-robin, so machine noise hits them alike; medians.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record  # noqa: E402

from llmc.plugins.paged_attention import PagedBatch, plan_step
from llmc.plugins.paged_attention_cpu import CpuPagedAttention
from llmc.plugins.paged_attention_onnx import standalone_model

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64
BLOCK_SIZES = (16, 32, 64, 256)
MAX_LEN = 2048


def utilization(rng: np.random.Generator, requests: int = 1000) -> dict:
    """Slots in use ÷ allocated, at the end of each request, over a lognormal length mix."""
    prompts = np.clip(rng.lognormal(np.log(300), 0.9, requests), 4, MAX_LEN // 2).astype(int)
    outputs = np.clip(rng.lognormal(np.log(150), 0.8, requests), 1, MAX_LEN // 2).astype(int)
    lengths = prompts + outputs
    result = {"requests": requests, "mean_prompt": float(prompts.mean()), "mean_output": float(outputs.mean()),
              "contiguous_max_len": float(lengths.sum() / (requests * MAX_LEN))}
    for block in BLOCK_SIZES + (1, 8):
        allocated = (-(-lengths // block) * block).sum()
        result[f"paged_block_{block}"] = float(lengths.sum() / allocated)
    return result


def _session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def dense_model():
    value = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    node = helper.make_node("Attention", ["q", "k", "v", "", "past_k", "past_v"], ["y", "present_k", "present_v"])
    graph = helper.make_graph([node], "dense", [
        value("q", ["b", HEADS, 1, HEAD_DIM]), value("k", ["b", KV_HEADS, 1, HEAD_DIM]),
        value("v", ["b", KV_HEADS, 1, HEAD_DIM]), value("past_k", ["b", KV_HEADS, "p", HEAD_DIM]),
        value("past_v", ["b", KV_HEADS, "p", HEAD_DIM])],
        [value("y", None), value("present_k", None), value("present_v", None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)


def latency_cases(rng, batch: int, context: int):
    """One call per variant at one (batch, context); the paged pool has 25% spare blocks."""
    dense = _session(dense_model())
    dense_feeds = {
        "q": rng.standard_normal((batch, HEADS, 1, HEAD_DIM), np.float32),
        "k": rng.standard_normal((batch, KV_HEADS, 1, HEAD_DIM), np.float32),
        "v": rng.standard_normal((batch, KV_HEADS, 1, HEAD_DIM), np.float32),
        "past_k": rng.standard_normal((batch, KV_HEADS, context, HEAD_DIM), np.float32),
        "past_v": rng.standard_normal((batch, KV_HEADS, context, HEAD_DIM), np.float32)}
    cases = {"dense": lambda: dense.run(None, dense_feeds)}
    for block in BLOCK_SIZES:
        per_seq = -(-context // block)
        blocks = int(batch * per_seq * 1.25) + 1
        tables = rng.permutation(blocks)[: batch * per_seq].reshape(batch, per_seq)
        plan = plan_step(PagedBatch(tables, np.full(batch, context), np.arange(batch + 1)), block)
        pool = (blocks, KV_HEADS, block, HEAD_DIM)
        feeds = {"query": rng.standard_normal((batch, HEADS, HEAD_DIM), np.float32),
                 "key": rng.standard_normal((batch, KV_HEADS, HEAD_DIM), np.float32),
                 "value": rng.standard_normal((batch, KV_HEADS, HEAD_DIM), np.float32),
                 "key_cache": rng.standard_normal(pool, np.float32),
                 "value_cache": rng.standard_normal(pool, np.float32), **plan.feeds()}
        model = standalone_model(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=block)
        cases[f"paged-{block}"] = lambda session=_session(model), feeds=feeds: session.run(None, feeds)
        if block == 16:
            kernel = CpuPagedAttention(HEADS, KV_HEADS, HEAD_DIM, block, threads=2)
            layout = kernel.layout(PagedBatch(tables, np.full(batch, context), np.arange(batch + 1)))
            tensors = [feeds[n] for n in ("query", "key", "value", "key_cache", "value_cache")]
            cases["cpu-16"] = lambda kernel=kernel, layout=layout, tensors=tensors: kernel(*tensors, layout)
    return cases


def latency(rng, batches, contexts, rounds: int) -> list[dict]:
    rows = []
    for batch in batches:
        for context in contexts:
            print(f"latency: batch {batch}, context {context}", file=sys.stderr)
            cases = latency_cases(rng, batch, context)
            times = {name: [] for name in cases}
            for call in cases.values():
                for _ in range(3):
                    call()
            for r in range(rounds):
                order = list(cases)[r % len(cases):] + list(cases)[: r % len(cases)]
                for name in order:
                    start = time.perf_counter()
                    cases[name]()
                    times[name].append(time.perf_counter() - start)
            row = {"batch": batch, "context": context}
            row.update({f"{name}_us": float(np.median(t) * 1e6) for name, t in times.items()})
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="few rounds, two contexts (smoke run)")
    parser.add_argument("--save-json", metavar="PATH", help="also write the JSON object to PATH")
    args = parser.parse_args()
    began = record.begin()
    rng = np.random.default_rng(0)
    contexts = (128, 1024) if args.quick else (128, 512, 1024, 2048, 4096)
    result = {"utilization": utilization(rng),
              "latency": latency(rng, (1, 16), contexts, 5 if args.quick else 60),
              "setup": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "threads": 2,
                        "onnxruntime": ort.__version__}}
    result = {"benchmark": "paged-attention", "quick": args.quick, **result, "record": record.finish(began)}
    if args.save_json:
        record.write_json(args.save_json, result)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    u = result["utilization"]
    print(f"KV utilization over {u['requests']} requests (mean prompt {u['mean_prompt']:.0f}, "
          f"mean output {u['mean_output']:.0f}, max length {MAX_LEN}):")
    print(f"  contiguous max-length  {u['contiguous_max_len']:.3f}")
    for block in (1, 8, 16, 32, 64, 256):
        print(f"  paged, block {block:3d}      {u[f'paged_block_{block}']:.3f}")
    names = ["dense", "cpu-16"] + [f"paged-{b}" for b in BLOCK_SIZES]
    print("\ndecode attention latency, µs (median); ratio = paged / dense")
    print("batch  context  " + "  ".join(f"{n:>10s}" for n in names) + "  " +
          "  ".join(f"{n + '/dense':>15s}" for n in names[1:]))
    for row in result["latency"]:
        cells = "  ".join(f"{row[n + '_us']:10.1f}" for n in names)
        ratios = "  ".join(f"{row[n + '_us'] / row['dense_us']:15.2f}" for n in names[1:])
        print(f"{row['batch']:5d}  {row['context']:7d}  {cells}  {ratios}")


if __name__ == "__main__":
    main()
