"""Third-party exports benchmark: family × exporter → compiles (paged), greedy match, nodes, latency.

For each family (seeded tiny checkpoints from tests/hf_checkpoints.py: 2 layers, hidden 64) and
each exporter (tests/exporters.py: Optimum in its own venv, torch.onnx dynamo, TorchScript,
`llmc export`; tests/genai_builder.py: onnxruntime-genai's model builder, fp32 CPU), the
checkpoint is exported once and then:

  compiles   `compile_model` with the default options; "paged" or the manifest's reason not to
  greedy     `llmc.LLM(engine).generate` (2 prompts, 12 tokens, ignore_eos) equals transformers'
             greedy continuation (argmax of a full forward pass per token)
  nodes      nodes in the export → after `optimize` at the default level (before paged lowering)
  decode     one decode token (batch 1, past 32) through onnxruntime: the level-2 graph's median
             latency against the raw export's, both with the session optimizer on (ORT_ENABLE_ALL)
             and the same thread count, timed in alternating rounds

    python bench/exporters_bench.py [--families llama,gpt2] [--exporters optimum,dynamo]
                                    [--threads 2] [--work-dir DIR] [--json]

Progress goes to stderr; stdout gets a Markdown table, or one JSON list with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the fixture factories: exporters, hf_checkpoints

FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "gpt_neox", "phi3", "gemma", "qwen3", "gemma2", "gemma3")
EXPORTERS = ("optimum", "dynamo", "torchscript", "llmc", "genai")
PROMPTS = ("def fibonacci(", "Hi")
NEW_TOKENS = 12
DECODE_PAST = 32
ROUNDS, WARMUP = 200, 20


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def reference_greedy(model, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy continuation: argmax of a full forward pass per new token."""
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def decode_latency(raw: onnx.ModelProto, optimized: onnx.ModelProto, threads: int) -> tuple[float, float]:
    """Median ms of one decode step for the raw and the optimized graph, rounds alternating."""
    from llmc.compiler.compare import seeded_feeds
    from llmc.formats.onnx_io import serialize
    from llmc.formats.sessions import open_session

    feeds = seeded_feeds(raw, batch=1, seq=1, past=DECODE_PAST)
    sessions = []
    for model in (raw, optimized):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        sessions.append(open_session(serialize(model), options))
    times: list[list[float]] = [[], []]
    for round_ in range(WARMUP + ROUNDS):
        for index in (round_ % 2, 1 - round_ % 2):
            start = time.perf_counter()
            sessions[index].run(None, feeds)
            if round_ >= WARMUP:
                times[index].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def run_cell(family: str, exporter: str, folder: Path, work: Path, model, threads: int) -> dict:
    from exporters import ExporterUnavailable, export_decoder

    from llmc import LLM, SamplingParams
    from llmc.compiler.build import compile_model
    from llmc.compiler.pipeline import optimize

    cell = {"family": family, "exporter": exporter}
    path = work / f"{family}-{exporter}" / "model.onnx"
    engine = path.with_name("engine.plan")
    try:
        if exporter == "genai":
            path = _genai_export(family)
        elif not path.is_file():
            start = time.perf_counter()
            export_decoder(folder, exporter, path)
            log(f"{family}/{exporter}: exported in {time.perf_counter() - start:.1f} s")
    except (ExporterUnavailable, RuntimeError) as exc:
        return {**cell, "error": f"exporter unavailable: {str(exc).strip().splitlines()[-1][:160]}"}
    engine.parent.mkdir(parents=True, exist_ok=True)
    # The builder re-saves the tokenizer and may add a token past these tiny models' vocabulary
    # (Qwen2's, Gemma's pad): take the checkpoint's own, as tests/compiler/test_genai_builder.py does.
    tokenizer = path.parent.parent / "checkpoint" if exporter == "genai" else None
    try:
        manifest = compile_model(path, engine, tokenizer=tokenizer)
    except Exception as exc:  # the table records any failure rather than stopping the run
        return {**cell, "error": f"compile: {type(exc).__name__}: {str(exc)[:200]}"}
    cell["paged"] = manifest["paged"] is not None
    cell["not_paged"] = manifest.get("not_paged")
    completions = LLM(engine).generate(
        list(PROMPTS), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    cell["greedy_match"] = all(c.token_ids == reference_greedy(model, c.prompt_token_ids) for c in completions)
    raw = onnx.load(path)
    optimized, _ = optimize(onnx.load(path))
    cell["nodes_before"], cell["nodes_after"] = len(raw.graph.node), len(optimized.graph.node)
    cell["decode_raw_ms"], cell["decode_optimized_ms"] = (round(t, 3) for t in decode_latency(raw, optimized, threads))
    log(f"{family}/{exporter}: {cell}")
    return cell


def _genai_export(family: str) -> Path:
    """The builder's model.onnx (its checkpoint is write_hf_checkpoint's, seeded like `folder`)."""
    from genai_builder import BuilderRefused, genai_model

    try:
        return genai_model(family)[1] / "model.onnx"
    except BuilderRefused as exc:
        raise RuntimeError(f"builder refused: {exc}") from None


def table(cells: list[dict]) -> str:
    lines = ["| family | exporter | compiles (paged) | greedy match | nodes before → after | "
             "decode ms raw → llmc (speedup) |", "|---|---|---|---|---|---|"]
    for c in cells:
        if "error" in c:
            lines.append(f"| {c['family']} | {c['exporter']} | {c['error']} | | | |")
            continue
        paged = "yes (paged)" if c["paged"] else f"yes (contiguous: {c['not_paged']})"
        speedup = c["decode_raw_ms"] / c["decode_optimized_ms"]
        lines.append(f"| {c['family']} | {c['exporter']} | {paged} | {'yes' if c['greedy_match'] else 'NO'} | "
                     f"{c['nodes_before']} → {c['nodes_after']} | {c['decode_raw_ms']:.3f} → "
                     f"{c['decode_optimized_ms']:.3f} ({speedup:.2f}x) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--exporters", default=",".join(EXPORTERS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=ROOT / "bench" / ".work" / "exporters")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from hf_checkpoints import hf_model, write_hf_checkpoint

    cells = []
    for family in args.families.split(","):
        folder = args.work_dir / "checkpoints" / family
        if not (folder / "config.json").is_file():
            write_hf_checkpoint(folder, family)
        model = hf_model(folder)
        for exporter in args.exporters.split(","):
            cells.append(run_cell(family, exporter, folder, args.work_dir, model, args.threads))
    print(json.dumps(cells, indent=2) if args.json else table(cells))


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
