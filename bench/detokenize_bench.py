"""Per-token Python time over one long output: is it flat in the output's length?

Two measurements:

  engine   One request, a 16-token prompt and 4,096 output tokens (ignore_eos, greedy) through
           `Engine`, on optimize_bench's ~32M Llama with 4,160 positions (compiled from the same
           ONNX by each tree), one token a step (no guessing ahead). The engine's backend step is
           wrapped so its time is subtracted from each `engine.step()`'s wall time: what is left is
           the engine's Python time per token (scheduling, block tables, sampling, detokenization,
           stop checks). Reported as the mean and median per token in windows of 512 tokens, for
           this tree and, for contrast, another tree (`--old`, e.g. the base commit 5d1f3e5). The
           wrapper also masks the logits to the printable ASCII ids (32-126) of the checkpoint's
           byte-level tokenizer (258 tokens; the random model's other 8,000 ids decode to nothing),
           so every output token is text; the mask's time counts as the decoder's.
  micro    `IncrementalText.add` alone against `tokenizer.decode(all ids)` per token, at output
           lengths 512 ... 4,096, on the first 4,096 tokens of data/pystdlib-text/heldout, for the byte-level
           tokenizer and (when cached by the tests) SmolLM2's.

    python bench/detokenize_bench.py [--old 5d1f3e5|PATH] [--json] [--save-json PATH] [--threads 2] [--skip-engine]

Each tree runs in its own interpreter with `llmc -> tree` first on PYTHONPATH (as in
compare_commits.py). Progress and tables go to stderr; --json prints one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
THIS_TREE = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
import record  # noqa: E402

POSITIONS = 4160
PROMPT = 16
OUTPUT = 4096
WINDOW = 512
LENGTHS = (512, 1024, 2048, 3072, 4096)
SMOLLM2 = Path.home() / ".cache" / "llmc-tests" / "SmolLM2-135M-Instruct"
HELD_OUT = BENCH_DIR.parent / "data" / "pystdlib-text" / "heldout"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- workers (in a subprocess with one tree's llmc first on the path) --------------------------


def _check_tree(tree: Path) -> str:
    import llmc

    where = Path(llmc.__file__).resolve()
    if tree.resolve() not in where.parents:
        raise RuntimeError(f"imported llmc from {where}, not from {tree}")
    return str(where)


def _export(job: dict[str, Any]) -> dict[str, Any]:
    import contextlib

    sys.path.insert(0, str(Path(job["tree"]) / "bench"))
    from optimize_bench import ModelSpec, ensure_checkpoint

    parameters = ensure_checkpoint(Path(job["checkpoint"]), ModelSpec(max_positions=POSITIONS))
    from llmc.compiler.export import export

    with contextlib.redirect_stdout(sys.stderr):
        export(job["checkpoint"], job["onnx"], check=False)
    return {"parameters": parameters}


def _compile(job: dict[str, Any]) -> dict[str, Any]:
    import contextlib

    from llmc.compiler.build import compile_model

    with contextlib.redirect_stdout(sys.stderr):
        manifest = compile_model(job["onnx"], job["engine"])
    return {"paged": {k: v for k, v in manifest["paged"].items() if k != "segments"}}


def _engine(job: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    from llmc.runtime.engine import Engine
    from llmc.runtime.sampling_params import SamplingParams

    # One token a step: a step that guesses ahead makes several, and the windows would count steps.
    engine = Engine(job["engine"], threads=job["threads"], speculative_tokens=0)
    # The step's one entry point: the backend's `run` (in the base commit 5d1f3e5, the decoder's `step`).
    decoder, method = (engine.backend, "run") if hasattr(engine, "backend") else (engine.decoder, "step")
    inner = getattr(decoder, method)
    spent = [0.0]

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        try:
            logits = inner(*args, **kwargs)
            if not logits.flags.writeable:
                logits = logits.copy()
            logits[:, :32] = -np.inf  # printable ASCII only (see the module docstring)
            logits[:, 127:] = -np.inf
            return logits
        finally:
            spent[0] += time.perf_counter() - start

    setattr(decoder, method, timed_step)
    rng = np.random.default_rng(0)
    prompt = rng.integers(32, 127, PROMPT).tolist()
    params = SamplingParams(max_new_tokens=job["output"], ignore_eos=True)
    engine.add_request(prompt[:4], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    while engine.has_unfinished():
        engine.step()
    engine.add_request(prompt, params)
    python_ms: list[float] = []
    decoder_ms: list[float] = []
    text: list[str] = []
    start_all = time.perf_counter()
    while engine.has_unfinished():
        spent[0] = 0.0
        start = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - start
        made = sum(len(o.new_token_ids) for o in outputs)
        text += [o.text for o in outputs]
        if made:
            python_ms.append((wall - spent[0]) * 1e3 / made)
            decoder_ms.append(spent[0] * 1e3 / made)
    total = time.perf_counter() - start_all
    windows = []
    for first in range(0, len(python_ms), WINDOW):
        py, dec = python_ms[first:first + WINDOW], decoder_ms[first:first + WINDOW]
        windows.append({"tokens": f"{first + 1}-{first + len(py)}", "python_ms_mean": round(statistics.mean(py), 4),
                        "python_ms_median": round(statistics.median(py), 4),
                        "decoder_ms_mean": round(statistics.mean(dec), 3)})
    joined = "".join(text)
    return {"tokens": len(python_ms), "seconds": round(total, 1), "windows": windows,
            "last_over_first_mean": round(windows[-1]["python_ms_mean"] / windows[0]["python_ms_mean"], 3),
            "last_over_first_median": round(windows[-1]["python_ms_median"] / windows[0]["python_ms_median"], 3),
            "text_chars": len(joined), "text_head": joined[:60]}


def worker_main() -> int:
    job = json.loads(sys.stdin.read())
    where = _check_tree(Path(job["tree"]))
    out = {"export": _export, "compile": _compile, "engine": _engine}[job["task"]](job)
    out["llmc"] = where
    print(json.dumps(out, default=str))
    return 0


def run_in(tree: Path, pkg: Path, job: dict[str, Any]) -> dict[str, Any]:
    """`job` in a fresh interpreter whose `import llmc` is `tree`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pkg)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"], env=env, text=True,
                          input=json.dumps({**job, "tree": str(tree)}), stdout=subprocess.PIPE, cwd=str(pkg))
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {job['task']} exited with {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the micro-benchmark (this tree, in process) -----------------------------------------------


def micro(repeats: int = 5) -> dict[str, Any]:
    from llmc.runtime.detokenizer import IncrementalText
    from llmc.tokenizer import Tokenizer, byte_level_tokenizer

    source = "".join(path.read_text() for path in sorted(HELD_OUT.glob("*.txt")))
    tokenizers = {"byte-level": byte_level_tokenizer()}
    if (SMOLLM2 / "tokenizer.json").is_file():
        tokenizers["SmolLM2"] = Tokenizer.from_folder(SMOLLM2)
    out = {}
    for name, tokenizer in tokenizers.items():
        ids = tokenizer.encode(source)
        ids = [t for t in ids if t not in tokenizer.eos_ids and t != tokenizer.bos_id][:max(LENGTHS)]
        if len(ids) < max(LENGTHS):
            raise RuntimeError(f"{name}: {HELD_OUT} is {len(ids)} tokens, need {max(LENGTHS)}")
        rows = []
        # IncrementalText.add: every add timed, best of `repeats` runs per token, then the mean
        # of the 64 tokens ending at each length.
        per_add = [float("inf")] * len(ids)
        for _ in range(repeats):
            text = IncrementalText(tokenizer, ids[:0])
            clock = time.perf_counter
            for i, token in enumerate(ids):
                start = clock()
                text.add(token)
                spent = clock() - start
                if spent < per_add[i]:
                    per_add[i] = spent
        for length in LENGTHS:
            add_us = statistics.mean(per_add[length - 64:length]) * 1e6
            times = []
            for _ in range(repeats * 4):
                start = time.perf_counter()
                tokenizer.decode(ids[:length])
                times.append(time.perf_counter() - start)
            full_us = min(times) * 1e6
            rows.append({"length": length, "incremental_add_us": round(add_us, 2),
                         "full_decode_us": round(full_us, 1), "full_over_incremental": round(full_us / add_us, 1)})
        out[name] = rows
    return out


# --- the driver --------------------------------------------------------------------------------


def render(result: dict[str, Any]) -> str:
    lines = []
    for side, run in result.get("engine", {}).items():
        lines += [f"engine, {side} ({run['commit']}): {run['tokens']} tokens in {run['seconds']} s; Python ms/token "
                  f"last window / first: mean {run['last_over_first_mean']}×, median {run['last_over_first_median']}×"]
        lines += ["  tokens        python mean  python median  decoder mean (ms/token)"]
        lines += [f"  {w['tokens']:<12}  {w['python_ms_mean']:>11.4f}  {w['python_ms_median']:>13.4f}  {w['decoder_ms_mean']:>12.3f}"
                  for w in run["windows"]]
    for name, rows in result.get("micro", {}).items():
        lines += [f"micro, {name}: µs per token", "  length  IncrementalText.add  decode(all ids)  ratio"]
        lines += [f"  {r['length']:>6}  {r['incremental_add_us']:>19.2f}  {r['full_decode_us']:>15.1f}  {r['full_over_incremental']:>5.1f}"
                  for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", help="a tree or commit to run for contrast (e.g. the base commit 5d1f3e5)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=int, default=OUTPUT, help=f"output tokens (default {OUTPUT})")
    parser.add_argument("--skip-engine", action="store_true", help="only the micro-benchmark")
    parser.add_argument("--work-dir", default=str(BENCH_DIR / ".work"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--save-json", metavar="PATH")
    args = parser.parse_args(argv)
    began = record.begin([sys.argv[0], *argv])
    result: dict[str, Any] = {"benchmark": "detokenize", "prompt": PROMPT, "output": args.output, "positions": POSITIONS, "threads": args.threads}
    if not args.skip_engine:
        work = Path(args.work_dir).resolve()
        scratch = Path(tempfile.mkdtemp(prefix="llmc-detok-", dir=work))
        trees = {"new": THIS_TREE}
        worktree = None
        if args.old:
            old = Path(args.old)
            if not (old.is_dir() and (old / "__init__.py").is_file()):
                worktree = old = scratch / "tree-old"
                subprocess.run(["git", "-C", str(THIS_TREE), "worktree", "add", "--detach", str(old), args.old],
                               check=True, stdout=sys.stderr, stderr=sys.stderr)
            trees["old"] = old.resolve()
        try:
            pkgs = {}
            for side, tree in trees.items():
                pkgs[side] = scratch / f"pkg-{side}"
                pkgs[side].mkdir()
                (pkgs[side] / "llmc").symlink_to(tree)
            onnx = scratch / "model.onnx"
            log(f"export ({POSITIONS} positions)")
            result["parameters"] = run_in(THIS_TREE, pkgs["new"], {
                "task": "export", "checkpoint": str(work / f"hf-llama-32m-{POSITIONS}"), "onnx": str(onnx)})["parameters"]
            result["engine"] = {}
            for side, tree in trees.items():
                log(f"compile ({side}: {tree})")
                engine = scratch / f"engine-{side}.plan"
                built = run_in(tree, pkgs[side], {"task": "compile", "onnx": str(onnx), "engine": str(engine)})
                log(f"  {built['paged']}")
                log(f"engine run ({side})")
                run = run_in(tree, pkgs[side], {"task": "engine", "engine": str(engine), "threads": args.threads,
                                                "output": args.output})
                run["commit"] = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                                               capture_output=True, text=True).stdout.strip()
                run["paged"] = built["paged"]
                result["engine"][side] = run
                log(f"  last/first window: {run['last_over_first_mean']}× (mean)")
        finally:
            if worktree is not None:
                subprocess.run(["git", "-C", str(THIS_TREE), "worktree", "remove", "--force", str(worktree)],
                               stdout=sys.stderr, stderr=sys.stderr)
            shutil.rmtree(scratch, ignore_errors=True)  # the engines and the ONNX: ~370 MB a run
    log("micro-benchmark")
    result["micro"] = micro()
    result["record"] = record.finish(began)
    print(render(result), file=sys.stderr)
    text = json.dumps(result, indent=2, default=str)
    if args.save_json:
        record.write_json(args.save_json, result)
    if args.json:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
