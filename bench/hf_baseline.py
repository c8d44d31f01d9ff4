"""Hugging Face transformers `generate` baselines of the serving benchmark (bench/serving_bench.py).

Run as a script by serving_bench.in_fresh_process: one JSON object on stdin ({"run": function
name, then its arguments}), the result as JSON on stdout. It imports nothing from llmc, so torch
runs with libgomp's default wait policy, not the passive one llmc sets when imported. Requests
are (prompt token ids, output length) pairs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from optimize_bench import log


def finish(name: str, useful: int, generated: int, seconds: float, **extra) -> dict[str, Any]:
    log(f"{name}: {useful} useful tokens ({generated} generated) in {seconds:.1f} s → {useful / seconds:.1f} tok/s")
    return {"useful_tokens": useful, "generated_tokens": generated, "seconds": round(seconds, 3),
            "throughput_tok_s": round(useful / seconds, 2), **extra}


def load(checkpoint: Path, threads: int):
    import torch
    import transformers

    torch.set_num_threads(threads)
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def generate(model, prompts: list[list[int]], new_tokens: int, pad: int) -> int:
    """Greedy, left-padded, exactly `new_tokens` tokens per row; returns the tokens made."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    return out.shape[1] - width


def run_hf_static(checkpoint: Path, threads: int, requests: list[tuple[list[int], int]], pad: int,
                  group_size: int) -> dict[str, Any]:
    """Batches of `group_size` in arrival order, each run to its longest requested output."""
    model = load(checkpoint, threads)
    generate(model, [requests[0][0][:16]], 4, pad)  # warm-up
    start, generated = time.perf_counter(), 0
    for first in range(0, len(requests), group_size):
        group = requests[first:first + group_size]
        longest = max(length for _, length in group)
        made = generate(model, [prompt for prompt, _ in group], longest, pad)
        if made != longest:
            raise RuntimeError(f"hf-static: generate made {made} tokens, asked for {longest}")
        generated += longest * len(group)
        log(f"  hf-static: batch {first // group_size + 1}: {len(group)} × {longest} tokens")
    useful = sum(length for _, length in requests)
    return finish("hf-static", useful, generated, time.perf_counter() - start, batch=group_size)


def run_hf_single(checkpoint: Path, threads: int, requests: list[tuple[list[int], int]], pad: int) -> dict[str, Any]:
    """One request at a time."""
    model = load(checkpoint, threads)
    start = time.perf_counter()
    for index, (prompt, length) in enumerate(requests):
        made = generate(model, [prompt], length, pad)
        if made != length:
            raise RuntimeError(f"hf-single: generate made {made} tokens, asked for {length}")
        if index % 8 == 7:
            log(f"  hf-single: {index + 1} requests")
    useful = sum(length for _, length in requests)
    return finish("hf-single", useful, useful, time.perf_counter() - start, requests=len(requests))


if __name__ == "__main__":
    arguments = json.load(sys.stdin)
    run = {"run_hf_static": run_hf_static, "run_hf_single": run_hf_single}[arguments.pop("run")]
    json.dump(run(**arguments), sys.stdout)
