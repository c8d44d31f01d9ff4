"""Build one deployable engine in a CI job: export (or take an ONNX file), compile (cached), gate
on accuracy, smoke-run, bench, and publish the engine with its reports.

    python examples/ci/build_engine.py MODEL --precision int8-weights --calib calib/ --heldout heldout/ \\
        --cache .llmc-cache --out dist [--backend onnxruntime|tensorrt] [--max-ppl-increase 1.5]

MODEL is a Hugging Face checkpoint folder, a built-in name or an ONNX file. Only the `llmc`
command line is used, so what runs here is what a user runs.

Outputs, under --out:
  NAME/                   published only when every step passed; NAME is
                          MODEL-BACKEND-PRECISION-<engine sha256, 12 digits>:
    engine.plan           the engine
    compile.json          `llmc compile --json`'s summary
    accuracy.json         `llmc check --json`'s report (the gate)
    run.json              a greedy completion of --prompt (`llmc run --json`)
    bench.json            a short `llmc bench --json`
  rejected/MODEL-BACKEND-PRECISION/
                          the reports of an engine the gate refused (no engine)

The build cache (--cache) holds compiled engines keyed by the graph's SHA-256 (the ONNX file and its
external data), the compile options, the calibration data, and the llmc and TensorRT versions: an
unchanged engine is not rebuilt. An entry whose engine does not match its recorded SHA-256 or
fails `llmc inspect`'s deploy check (section checksums) is deleted and rebuilt, never used.

Prints one JSON object on stdout; progress goes to stderr. Under GitHub Actions the outputs
`artifact` (the name), `artifact-path` and `report-path` are set for the upload steps.
Exit 0: published; 1: the gate or a step failed; 2: bad input (a model, folder or option llmc
refuses). On failure no engine is published, and the reports made so far go to rejected/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LLMC = [sys.executable, "-m", "llmc.cli"]

# What each precision adds to `llmc compile`; CALIB stands for --calib's folder. The compiler's own
# accuracy refusal is overridden (--force): the gate below decides, on held-out data, with a report.
PRECISIONS = {
    "fp32": [],
    "fp16": ["--fp16"],
    "int8": ["--int8-calib", "CALIB", "--force"],
    "int8-weights": ["--weights", "int8", "--calib", "CALIB", "--force"],
    "int4": ["--weights", "int4", "--calib", "CALIB", "--force"],
}


class StepFailed(Exception):
    """A step failed: the job fails, keeping the reports made so far; status 2 for bad input."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out)
    label = f"{_slug(args.model)}-{args.backend}-{args.precision}"
    rejected = out / "rejected" / label
    shutil.rmtree(rejected, ignore_errors=True)  # a past run's refusal of this engine
    with tempfile.TemporaryDirectory(prefix="llmc-ci-") as scratch:
        reports = Path(scratch) / "reports"
        reports.mkdir()
        try:
            engine, summary, cached = _build(args, Path(scratch), reports)
        except StepFailed as exc:
            _reject(reports, rejected, exc)
            return exc.status
        name = f"{label}-{summary['sha256'][:12]}"
        shutil.copyfile(engine, reports / "engine.plan")
        _replace(reports, out / name)
    _github_output(**{"artifact": name, "artifact-path": str(out / name)})
    _report({"published": str(out / name), "artifact": name, "cached": cached, "sha256": summary["sha256"],
             "accuracy": json.loads((out / name / "accuracy.json").read_text())})
    _progress(f"published {out / name}")
    return 0


def _reject(reports: Path, rejected: Path, exc: StepFailed) -> None:
    """Keep the reports of a failed build (the accuracy report of a refused engine) without the engine."""
    kept = any(reports.iterdir())
    if kept:
        _replace(reports, rejected)
        _github_output(**{"report-path": str(rejected)})
    accuracy = rejected / "accuracy.json"
    _report({"published": None, "rejected": str(rejected) if kept else None, "error": str(exc),
             "accuracy": json.loads(accuracy.read_text()) if kept and accuracy.is_file() else None})
    _progress(f"failed: {exc}; no engine published" + (f"; reports in {rejected}" if kept else ""))


def _build(args: argparse.Namespace, scratch: Path, reports: Path) -> tuple[Path, dict, bool]:
    """Every step but publishing; each report lands in REPORTS as it is made."""
    model = _take_or_export(args.model, scratch)
    engine, summary, cached = _cached_or_built(model, args, scratch)
    (reports / "compile.json").write_text(json.dumps(summary, indent=1) + "\n")
    _gate(engine, model, args, reports / "accuracy.json")
    _smoke_run(engine, args.prompt, reports / "run.json")
    _llmc("bench", str(engine), "--requests", "8", "--prompt-len", "32", "--output-len", "16", "--json",
          stdout=reports / "bench.json")
    return engine, summary, cached


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face checkpoint folder, a built-in name or an ONNX file")
    parser.add_argument("--backend", choices=["onnxruntime", "tensorrt"], default="onnxruntime")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    parser.add_argument("--calib", help="calibration text (needed by int8, int8-weights, int4)")
    parser.add_argument("--heldout", required=True, help="held-out text for the accuracy gate")
    parser.add_argument("--max-ppl-increase", type=float, default=1.5, help="the gate, in percent")
    parser.add_argument("--cache", required=True, help="the build cache folder")
    parser.add_argument("--cache-entries", type=int, default=4, help="entries kept, most recently used first")
    parser.add_argument("--out", required=True, help="where published engines and rejected reports go")
    parser.add_argument("--prompt", default="def fibonacci(", help="the smoke run's prompt")
    args = parser.parse_args(argv)
    if "CALIB" in PRECISIONS[args.precision] and not args.calib:
        parser.error(f"--precision {args.precision} needs --calib")
    for option in ("calib", "heldout"):
        folder = getattr(args, option)
        if folder is not None and not Path(folder).is_dir():
            parser.error(f"--{option}: {folder} is not a folder")
    return args


def _take_or_export(model: str, scratch: Path) -> Path:
    if model.endswith(".onnx"):
        if not Path(model).is_file():
            raise StepFailed(f"{model}: no such file", 2)
        return Path(model)
    onnx = scratch / "model.onnx"
    _progress(f"export {model}")
    _llmc("export", model, "-o", str(onnx))
    return onnx


def _cached_or_built(model: Path, args: argparse.Namespace, scratch: Path) -> tuple[Path, dict, bool]:
    """The engine for MODEL and these options, from the cache when an intact entry is there."""
    options = [args.calib if a == "CALIB" else a for a in PRECISIONS[args.precision]]
    options += ["--backend", args.backend]
    key_material = {"graph": _sha256(model, Path(f"{model}.data")), "options": options,
                    "calibration": _folder_sha256(Path(args.calib)) if args.calib and "CALIB" in
                    PRECISIONS[args.precision] else None,
                    "llmc": _llmc("--version", capture=True).strip(), "tensorrt": _tensorrt_version(args.backend)}
    key = hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()[:32]
    cache = Path(args.cache)
    entry = cache / key
    if entry.is_dir():
        problem = _entry_problem(entry)
        if problem is None:
            _progress(f"cache hit {key}: engine unchanged, not rebuilt")
            os.utime(entry)
            return entry / "engine.plan", json.loads((entry / "compile.json").read_text()), True
        _progress(f"cache entry {key} is corrupted ({problem}): deleted, rebuilding")
        shutil.rmtree(entry)
    _progress(f"cache miss {key}: compiling ({args.backend}, {args.precision})")
    build = scratch / "build"
    build.mkdir()
    summary_text = _llmc("compile", str(model), "-o", str(build / "engine.plan"), *options, "--json", capture=True)
    (build / "compile.json").write_text(summary_text)
    (build / "key.json").write_text(json.dumps(key_material, indent=1) + "\n")
    cache.mkdir(parents=True, exist_ok=True)
    _replace(build, entry)
    _prune(cache, keep=args.cache_entries)
    return entry / "engine.plan", json.loads(summary_text), False


def _entry_problem(entry: Path) -> str | None:
    """Why a cache entry cannot be used, or None when it is intact."""
    try:
        summary = json.loads((entry / "compile.json").read_text())
        actual = _sha256(entry / "engine.plan")
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}"
    if actual != summary.get("sha256"):
        return f"engine sha256 {actual[:12]} is not the recorded {str(summary.get('sha256'))[:12]}"
    inspected = subprocess.run([*LLMC, "inspect", str(entry / "engine.plan"), "--json"], capture_output=True,
                               text=True)
    if inspected.returncode != 0:
        return (inspected.stderr.strip().splitlines() or ["llmc inspect failed"])[-1]
    return None


def _prune(cache: Path, keep: int) -> None:
    """Keep the most recently used entries (a CI cache is restored whole: it must not grow forever)."""
    entries = sorted((p for p in cache.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in entries[keep:]:
        shutil.rmtree(stale)


def _gate(engine: Path, model: Path, args: argparse.Namespace, report: Path) -> None:
    _progress(f"gate: perplexity on {args.heldout} within +{args.max_ppl_increase}% of {model.name}")
    done = subprocess.run([*LLMC, "check", str(engine), "--reference", str(model), "--data", args.heldout,
                           "--max-ppl-increase", str(args.max_ppl_increase), "--json"],
                          stdout=subprocess.PIPE, text=True)
    if done.returncode not in (0, 1) or not done.stdout.strip():
        raise StepFailed(f"llmc check exited {done.returncode}", done.returncode)
    report.write_text(done.stdout)
    if done.returncode == 1:
        accuracy = json.loads(done.stdout)
        raise StepFailed(f"the gate refused the engine: perplexity {accuracy['ppl_increase_pct']:+.3f}% "
                         f"past +{args.max_ppl_increase}% on {args.heldout}")


def _smoke_run(engine: Path, prompt: str, report: Path) -> None:
    completion = _llmc("run", str(engine), "--prompt", prompt, "--max-new-tokens", "16", "--json", capture=True)
    report.write_text(completion)
    if not json.loads(completion)["token_ids"]:
        raise StepFailed(f"llmc run: no tokens generated for {prompt!r}")
    _progress(f"smoke run: {json.loads(completion)['text']!r}")


def _llmc(*arguments: str, capture: bool = False, stdout: Path | None = None) -> str:
    """Run one llmc command, its progress on our stderr; its stdout returned (capture) or written to a file."""
    if stdout is not None:
        with open(stdout, "w") as f:
            done = subprocess.run([*LLMC, *arguments], stdout=f)
    else:
        done = subprocess.run([*LLMC, *arguments], stdout=subprocess.PIPE if capture else None, text=True)
    if done.returncode != 0:
        raise StepFailed(f"llmc {arguments[0]} exited {done.returncode}", 2 if done.returncode == 2 else 1)
    return done.stdout or ""


def _tensorrt_version(backend: str) -> str | None:
    if backend != "tensorrt":
        return None
    try:
        import tensorrt
    except ImportError:
        raise StepFailed("--backend tensorrt needs TensorRT: pip install 'llmc[tensorrt]'", 2) from None
    return tensorrt.__version__


def _sha256(*files: Path) -> str:
    digest = hashlib.sha256()
    for path in files:
        if path.is_file():
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def _folder_sha256(folder: Path) -> str:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return hashlib.sha256("".join(f"{p.relative_to(folder)}:{_sha256(p)}\n" for p in files).encode()).hexdigest()


def _replace(source: Path, target: Path) -> None:
    """Move a finished folder into place whole: a reader never sees it half written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    shutil.rmtree(staging)
    shutil.move(str(source), staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def _slug(model: str) -> str:
    name = Path(model.rstrip("/")).name.removesuffix(".onnx") or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def _github_output(**values: str) -> None:
    if "GITHUB_OUTPUT" in os.environ:
        with open(os.environ["GITHUB_OUTPUT"], "a") as f:
            f.writelines(f"{key}={value}\n" for key, value in values.items())


def _report(result: dict) -> None:
    print(json.dumps(result))


def _progress(message: str) -> None:
    print(f"build_engine: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
