"""The `llmc` command line: parses options and calls the public Python API, nothing more."""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import traceback
from pathlib import Path

import click
from click.core import ParameterSource

from llmc.errors import LlmcError, first_line, missing_extra


class _Group(click.Group):
    """Applies the error policy: a user's mistake is one line and exit 2, anything else is a bug.

    LlmcError, and an OSError about a path (missing, unreadable, a folder where a file belongs)
    or the disk (full, read-only), print `llmc: error: <message>` and exit 2. Any other exception
    is a bug: one `llmc: internal error:` line and exit 1, with the traceback under --debug or
    LLMC_DEBUG=1, except an optional dependency that is not installed: one line naming the extra
    that installs it (errors.EXTRA_MODULES), exit 2. Ctrl-C exits 130; a closed output pipe exits 141 without a word. click's own
    usage errors pass through (exit 2).
    """

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except LlmcError as exc:
            _fail(f"llmc: error: {first_line(exc, 1000)}", 2)
        except ModuleNotFoundError as exc:
            message = missing_extra(exc, ctx.invoked_subcommand)
            if message is None:
                _internal_error(exc, ctx)
            _fail(f"llmc: error: {message}", 2)
        except KeyboardInterrupt:
            _fail("llmc: interrupted", 130)
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # the reader went away (`llmc run ... | head`): stop quietly
                _silence_stdout()
                sys.exit(128 + 13)  # as if killed by SIGPIPE, which Python ignores
            if not _is_users_os_error(exc):
                _internal_error(exc, ctx)
            where = f"{exc.filename}: " if exc.filename else ""
            reason = exc.strerror or first_line(exc)
            _fail(f"llmc: error: {where}{reason[:1].lower()}{reason[1:]}", 2)
        except Exception as exc:
            _internal_error(exc, ctx)


# The disk, not the program: full, over quota, read-only, or a file past the size limit.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def _is_users_os_error(exc: OSError) -> bool:
    """An OSError about a path the user gave, or about the disk: not a bug in llmc."""
    about_path = isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError))
    return (about_path and exc.filename is not None) or exc.errno in _ENVIRONMENT_ERRNOS


def _internal_error(exc: Exception, ctx: click.Context) -> None:
    text = str(exc).strip()
    what = type(exc).__name__ + (f": {text.splitlines()[0][:300]}" if text else "")
    if ctx.params.get("debug"):
        click.echo("".join(traceback.format_exception(exc)).rstrip(), err=True)
        _fail(f"llmc: internal error: {what} (this is a bug; the traceback is above)", 1)
    _fail(f"llmc: internal error: {what} (this is a bug; rerun with --debug for the traceback)", 1)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush does not fail on the closed pipe."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass  # not a real file (e.g. click's test runner)


def _fail(line: str, status: int) -> None:
    click.echo(line, err=True)
    sys.exit(status)


def _progress(message: str) -> None:
    click.echo(f"llmc: {message}", err=True)


@click.group(cls=_Group)
@click.version_option(package_name="llmc")
@click.option("--debug", is_flag=True, envvar="LLMC_DEBUG",
              help="On an internal error, print the traceback (also LLMC_DEBUG=1).")
def main(debug):
    """Compile decoder language models into engines and run them."""


# Set by `entry` (the `llmc` command, `python -m llmc.cli`): the process is llmc's own, so its
# sessions may share one spinning thread pool (formats/sessions.py), which onnxruntime makes
# process-wide. Not when a test or a host program calls `main` in a process of its own.
_owns_process = False


def entry() -> None:
    """The `llmc` command."""
    global _owns_process
    _owns_process = True
    main()


def _share_threads(threads: int | None) -> None:
    if _owns_process:
        from llmc.formats.sessions import share_threads

        share_threads(threads)


@main.command()
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="ONNX file to write.")
@click.option("--no-check", is_flag=True, help="Skip the onnxruntime-vs-PyTorch parity check.")
@click.option("--exporter", default="auto", show_default=True, type=click.Choice(["auto", "torchscript", "dynamo"]),
              help="torch.onnx's exporter: torchscript traces once (fast), dynamo uses torch.export; auto "
                   "is torchscript.")
def export(model, output, no_check, exporter):
    """Export MODEL (a built-in name or a Hugging Face checkpoint folder) to ONNX."""
    from llmc.compiler.export import export as export_model

    check = export_model(model, output, check=not no_check, exporter=exporter, progress=_progress)
    click.echo(f"wrote {output}")
    if check is not None:
        click.echo(f"parity vs PyTorch: max abs diff {check.max_abs:.2e} (prefill logits "
                   f"{check.prefill_logits:.2e}, decode logits {check.decode_logits:.2e}, "
                   f"present {max(check.prefill_present, check.decode_present):.2e})")


def _pipeline_options(command):
    """--level, --passes and --verify, shared by optimize and compile."""
    command = click.option("--verify", is_flag=True,
                           help="Check the graph and compare outputs with the original after every pass.")(command)
    command = click.option("--passes", help="Comma-separated pass names to run instead of a level.")(command)
    return click.option("--level", default=None, help="Optimization level: 0, 1, 2 (default) or 3.")(command)


# run, serve and bench: the engine's prompt-lookup guesses per step (`Engine`'s speculative_tokens).
_speculative_tokens_option = click.option(
    "--speculative-tokens", type=int, default=None,
    help="Tokens a step may guess ahead for a greedy request, from its own text (prompt lookup; beside other "
    "requests only guesses likely to be kept; greedy outputs unchanged). 0 turns it off. Default: 4 for an fp32 engine, "
    "and for a weight-only (int4/int8) one alone in its step where its logits check out bit for bit at load; else 0.")


def _pass_names(passes: str | None) -> list[str] | None:
    return None if passes is None else [p.strip() for p in passes.split(",") if p.strip()]


@main.command()
@click.argument("onnx_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="ONNX file to write.")
@_pipeline_options
@click.option("--report", type=click.Path(dir_okay=False), help="Write the per-pass report as JSON.")
def optimize(onnx_file, output, level, passes, verify, report):
    """Run graph optimization passes over ONNX_FILE."""
    from llmc.compiler.pipeline import optimize_file

    entries = optimize_file(onnx_file, output, level=level, passes=_pass_names(passes), verify=verify,
                            report=report, progress=_progress)
    before = entries[0]["nodes_before"] if entries else "?"
    after = entries[-1]["nodes_after"] if entries else "?"
    click.echo(f"wrote {output}: {before} → {after} nodes")


# --weights-block-size with --backend tensorrt: one of TensorRT's int4 block sizes
# (precision/dequantize_linear.py INT4_BLOCK_SIZES) that divides common hidden sizes (SmolLM2's 576,
# which 128 does not).
TENSORRT_WEIGHTS_BLOCK_SIZE = 64


@main.command(name="compile")
@click.argument("onnx_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Engine file to write.")
@click.option("--backend", default="onnxruntime", show_default=True,
              help="Runtime the engine targets: onnxruntime (CPU) or tensorrt (NVIDIA GPU).")
@click.option("--tokenizer", type=click.Path(), help="tokenizer.json or its folder (default: embedded or beside the ONNX file).")
@_pipeline_options
@click.option("--paged/--no-paged", default=True, show_default=True,
              help="KV cache in blocks of one pool (llmc::paged_attention) or contiguous past/present.")
@click.option("--block-size", default=None, type=int, help="Tokens per KV block (default 16, by measurement).")
@click.option("--max-batch", default=64, show_default=True, type=int, help="Sequences per step (seats).")
@click.option("--max-seq-len", default=None, type=int, help="Longest sequence (default: the model's positions).")
@click.option("--kv-pool-mb", default=None, type=float, help="KV pool size (default: up to 16 full-length sequences, capped at "
              "load by half the memory available then).")
@click.option("--kv-cache-dtype", default="auto", show_default=True,
              help="KV pool element type: auto (the model's), fp16 or fp32.")
@click.option("--fp16", is_flag=True, help="Compute in fp16, with fp32 norms, attention and residual sums.")
@click.option("--int8-calib", type=click.Path(), help="Static int8 (Q/DQ) for linear layers, calibrated on "
              "this folder's .txt/.jsonl/.npy/.npz.")
@click.option("--calibrator", default="minmax", show_default=True, help="minmax, percentile or entropy.")
@click.option("--smoothquant", type=float, default=None,
              help="SmoothQuant strength for int8 (0 turns it off; default: chosen per activation by measurement).")
@click.option("--int8-dynamic", is_flag=True, help="int8 (Q/DQ) for linear layers with per-token activation scales "
              "computed at run time: no calibration.")
@click.option("--calib-tokens", default=4096, show_default=True, type=int, help="Calibration tokens read at most.")
@click.option("--weights", default=None, help="Weight-only int8 or int4 for linear layers (activations stay float).")
@click.option("--weights-block-size", default=None, type=int, help="Weights per scale for --weights (default 32; "
              f"{TENSORRT_WEIGHTS_BLOCK_SIZE} with --backend tensorrt, whose int4 blocks hold 64 or 128).")
@click.option("--weights-symmetric", is_flag=True, help="Weight-only blocks without zero points (onnxruntime-genai's "
              "scheme; a little faster, less accurate than the default asymmetric blocks).")
@click.option("--precision-config", type=click.Path(), help="Mixed precision: JSON mapping layers or op types "
              "to fp32/fp16/int8/int8-dynamic/int8-weights/int4.")
@click.option("--calib", type=click.Path(), help="Text like your traffic (.txt/.jsonl/.npy/.npz folder) to check a "
              "quantized engine's accuracy on (and to smooth int8 with), when --int8-calib does not name it.")
@click.option("--max-ppl-increase", default=3.0, show_default=True, type=float,
              help="Refuse a quantized engine whose perplexity on held-back data rises more (percent).")
@click.option("--force", is_flag=True, help="Write the engine even past --max-ppl-increase, or without data to check it.")
@click.option("--dry-run", is_flag=True, help="TensorRT: check every node against TensorRT 11's ONNX parser and "
              "print what would be built; build nothing (needs no GPU). Exit 2 names each unsupported node.")
@click.option("--max-num-tokens", default=2048, show_default=True, type=int,
              help="TensorRT: packed tokens in one step (the profile's largest).")
@click.option("--builder-optimization-level", default=3, show_default=True, type=int, help="TensorRT: 0-5.")
@click.option("--timing-cache", type=click.Path(dir_okay=False), help="TensorRT: timing cache file, read and updated.")
@click.option("--workspace-mb", type=float, default=None, help="TensorRT: builder workspace limit (default: the GPU's memory).")
@click.option("--hardware-compatible", is_flag=True, help="TensorRT: an engine for any Ampere-or-newer GPU.")
@click.option("--version-compatible", is_flag=True, help="TensorRT: an engine later TensorRT 11 releases can run.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout (engine, sha256, backend, "
              "precision, geometry, passes, build time, warnings); progress stays on stderr.")
def compile_command(onnx_file, output, backend, tokenizer, level, passes, verify, paged, block_size,
                    max_batch, max_seq_len, kv_pool_mb, kv_cache_dtype, fp16, int8_calib, calibrator, smoothquant,
                    int8_dynamic, calib_tokens, weights, weights_block_size, weights_symmetric, precision_config, calib,
                    max_ppl_increase, force, dry_run, max_num_tokens, builder_optimization_level, timing_cache, workspace_mb,
                    hardware_compatible, version_compatible, as_json):
    """Compile a decoder ONNX_FILE into one engine file (running the optimization passes first).

    Options that cannot go together, or that the others would leave without effect, are refused
    before any work, in one line naming them.
    """
    from llmc.compiler.build import compile_model
    from llmc.compiler.paged_engine import KV_DTYPES, PagedOptions
    from llmc.compiler.tensorrt_network import TensorRTOptions
    from llmc.precision.plan import PrecisionOptions, check_options
    from llmc.precision.weight_only import DEFAULT_BLOCK_SIZE

    ctx = click.get_current_context()
    given = {name for name in ctx.params if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE}
    _refuse_engine_options(given, backend, paged)
    if weights_block_size is None:
        weights_block_size = TENSORRT_WEIGHTS_BLOCK_SIZE if backend == "tensorrt" else DEFAULT_BLOCK_SIZE
    precision = PrecisionOptions(fp16, int8_calib, calibrator, smoothquant, calib_tokens, weights, weights_block_size,
                                 weights_symmetric, precision_config, int8_dynamic, calib, max_ppl_increase, force)
    # compile_model checks them again (its callers need not be this CLI); here the precisions they
    # ask for also tell which options given on the command line would do nothing.
    _refuse_precision_options(given, precision, precision.precisions(check_options(precision, backend)))
    tensorrt = TensorRTOptions(max_num_tokens=max_num_tokens, optimization_level=builder_optimization_level,
                               timing_cache=timing_cache, workspace_mb=workspace_mb,
                               hardware_compatible=hardware_compatible, version_compatible=version_compatible,
                               dry_run=dry_run)
    options = None
    if paged:
        if kv_cache_dtype not in KV_DTYPES:
            raise LlmcError(f"--kv-cache-dtype: '{kv_cache_dtype}' is not one of {', '.join(KV_DTYPES)}")
        options = PagedOptions(max_batch=max_batch, max_seq_len=max_seq_len, kv_pool_mb=kv_pool_mb,
                               kv_dtype=KV_DTYPES[kv_cache_dtype],
                               **({"block_size": block_size} if block_size is not None else {}))
    warnings: list[str] = []

    def progress(message: str) -> None:
        if message.startswith("warning:"):
            warnings.append(message[len("warning:"):].strip())
        _progress(message)

    start = time.perf_counter()
    manifest = compile_model(onnx_file, output, backend=backend, tokenizer=tokenizer, level=level,
                             passes=_pass_names(passes), verify=verify, paged=options, precision=precision,
                             tensorrt=tensorrt, progress=progress)
    if dry_run:
        if as_json:
            click.echo(json.dumps({"dry_run": True, "backend": backend, **manifest["tensorrt_check"]}))
            if manifest["tensorrt_check"]["unsupported"]:
                sys.exit(2)
            return
        _report_dry_run(manifest)
        return
    if as_json:
        click.echo(json.dumps(_compile_summary(Path(output), manifest, time.perf_counter() - start, warnings)))
        return
    steps = manifest["optimization"]
    if steps:
        fused = ", ".join(f"{e['pass']} {e['matches']}" for e in steps
                          if e["matches"] and not e["pass"].startswith(("eliminate-", "fold-")))
        click.echo(f"optimized: {manifest['source']['nodes']} → {steps[-1]['nodes_after']} nodes ({fused or 'no fusions'})")
    g = manifest["geometry"]
    click.echo(f"wrote {output}: {manifest['backend']}, {_precision_summary(manifest)}, {g['num_layers']} layers, "
               f"vocab {g['vocab_size']}, {g['max_positions']} positions")


def _precision_summary(manifest: dict) -> str:
    """The model's dtype and, when a precision option rewrote it, what its linear layers became
    ("float32 model; linears: int8 ×90, int8-weights ×31; fp16 elsewhere")."""
    precision = manifest.get("precision")
    if not precision:
        return manifest["dtype"]
    counts: dict[str, int] = {}
    for kind in precision["linears"].values():
        counts[kind] = counts.get(kind, 0) + 1
    linears = ", ".join(f"{kind} ×{count}" for kind, count in sorted(counts.items(), key=lambda item: -item[1]))
    return f"{manifest['dtype']} model; linears: {linears}" + ("; fp16 elsewhere" if precision.get("fp16") else "")


# compile's options that only a TensorRT build reads, and those only a paged engine reads.
_TENSORRT_OPTIONS = ("dry_run", "max_num_tokens", "builder_optimization_level", "timing_cache", "workspace_mb",
                     "hardware_compatible", "version_compatible")
_PAGED_OPTIONS = ("block_size", "max_batch", "max_seq_len", "kv_pool_mb", "kv_cache_dtype")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _refuse_engine_options(given: set[str], backend: str, paged: bool) -> None:
    """Refuse, before any work, an option given on the command line that the backend or the
    cache layout would ignore or cannot build: whoever gave it expects an engine that has it."""
    for name in _TENSORRT_OPTIONS:
        if name in given and backend != "tensorrt":
            raise LlmcError(f"{_flag(name)}: only for --backend tensorrt")
    if backend == "tensorrt" and not paged:
        raise LlmcError("--no-paged and --backend tensorrt: TensorRT engines are paged (the llmc::paged_attention "
                        "plugin)")
    for name in _PAGED_OPTIONS:
        if name in given and not paged:
            raise LlmcError(f"{_flag(name)} and --no-paged: only a paged engine has KV blocks and seats")


def _refuse_precision_options(given: set[str], precision, asked: frozenset[str]) -> None:
    """Refuse, before any work, a precision option given for something the others leave out
    (`asked`: the precisions the options ask for, precision/plan.py)."""
    from llmc.precision.plan import QUANTIZED

    quantized = "quantized layers (--int8-calib, --int8-dynamic, --weights or --precision-config)"
    needs = {"smoothquant": (bool(asked & {"int8", "int8-dynamic"}),
                             "int8 activations (--int8-calib, --int8-dynamic or int8 in --precision-config)"),
             "calibrator": ("int8" in asked, "calibrated int8 (--int8-calib, or int8 in --precision-config)"),
             "weights_block_size": (bool(asked & QUANTIZED), quantized),
             "weights_symmetric": (bool(asked & QUANTIZED), quantized),
             "calib_tokens": (precision.data is not None, "data (--int8-calib or --calib)")}
    for name, (used, what) in needs.items():
        if name in given and not used:
            raise LlmcError(f"{_flag(name)}: only with {what}")


def _compile_summary(engine: Path, manifest: dict, seconds: float, warnings: list[str]) -> dict:
    """`llmc compile --json`: what a CI job records of a build."""
    import hashlib

    digest = hashlib.sha256()
    with open(engine, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    precision = manifest.get("precision") or {}
    paged = manifest.get("paged")
    return {"engine": str(engine), "sha256": digest.hexdigest(), "bytes": engine.stat().st_size,
            "backend": manifest["backend"], "dtype": manifest["dtype"],
            "precision": None if not precision else {
                "fp16": precision.get("fp16", False), "accuracy": precision.get("accuracy"),
                **({"weights_symmetric": precision["weights_symmetric"]} if "weights_symmetric" in precision else {}),
                "linears": {kind: list(precision["linears"].values()).count(kind)
                            for kind in sorted(set(precision.get("linears", {}).values()))}},
            "geometry": manifest["geometry"],
            "paged": None if not paged else {k: paged[k] for k in ("block_size", "max_batch", "max_seq_len", "num_blocks",
                                                                   "kv_dtype")},
            "nodes": {"source": manifest["source"]["nodes"],
                      "final": manifest["optimization"][-1]["nodes_after"] if manifest["optimization"] else None},
            "passes": {e["pass"]: e["matches"] for e in manifest["optimization"]},
            "source_sha256": manifest["source"]["sha256"], "llmc_version": manifest["llmc_version"],
            **({"tensorrt": manifest["tensorrt"]} if manifest.get("tensorrt") else {}),
            "build_s": round(seconds, 2), "warnings": warnings}


def _report_dry_run(manifest: dict) -> None:
    """What a TensorRT build would parse; exit 2 naming every node it could not."""
    check, g = manifest["tensorrt_check"], manifest["geometry"]
    plugins = ", ".join(f"{plugin} ×{count}" for plugin, count in check["plugins"].items()) or "none"
    click.echo(f"tensorrt dry run: {check['nodes']} nodes ({len(check['ops'])} op types), plugins {plugins}; "
               f"{manifest['dtype']}, {g['num_layers']} layers, vocab {g['vocab_size']}")
    ranges: dict[str, list[str]] = {}  # inputs with the same range on one line (a pool per layer and part)
    for name, (low, opt, high) in check["profile"].items():
        if low != high:
            ranges.setdefault(f"min {low} opt {opt} max {high}", []).append(name)
    for shapes, names in ranges.items():
        click.echo(f"  profile {', '.join(names) if len(names) <= 2 else f'{names[0]} … {names[-1]} ({len(names)})'}: {shapes}")
    if check["unsupported"]:
        for line in check["unsupported"]:
            click.echo(f"  unsupported: {line}", err=True)
        click.echo(f"llmc: error: {len(check['unsupported'])} node(s) TensorRT 11 cannot build (listed above)", err=True)
        sys.exit(2)
    click.echo("ok: every node is one TensorRT 11's ONNX parser imports or an llmc plugin (nothing built)")


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print as JSON; for an engine, with \"deploy\": whether it "
              "runs on this machine (exit 2 if not).")
def inspect(path, as_json):
    """Show what is inside an engine file or an ONNX model."""
    from llmc.formats.engine_file import MAGIC, read_manifest

    with open(_existing(path), "rb") as f:
        is_engine = f.read(len(MAGIC)) == MAGIC
    if not is_engine:
        _inspect_onnx(path, as_json)
        return
    engine = path
    manifest = read_manifest(engine)
    if as_json:
        from llmc.runtime.deploy_check import deploy_checks

        checks = deploy_checks(engine)
        runs_here = all(c["ok"] for c in checks)
        click.echo(json.dumps({**manifest, "deploy": {"runs_here": runs_here, "checks": checks}}, indent=2))
        if not runs_here:
            sys.exit(2)
        return
    g = manifest["geometry"]  # read_manifest checked every field against the schema
    lines = [f"engine        {engine} (format {manifest['format_version']}, llmc {manifest['llmc_version']})",
             f"backend       {manifest['backend']}   dtype {manifest['dtype']}",
             f"geometry      {g['num_layers']} layers, {g['num_heads']} heads, "
             f"{g['num_kv_heads']} kv heads, head dim {g['head_dim']}, "
             f"vocab {g['vocab_size']}, {g['max_positions']} positions",
             f"source        {manifest['source']['file']} ({manifest['source']['nodes']} nodes, "
             f"sha256 {manifest['source']['sha256'][:16]}…)",
             f"build options {_build_options(manifest['build_options'])}",
             f"kv cache      {_kv_cache(manifest)}"]
    if manifest.get("tensorrt"):
        t = manifest["tensorrt"]
        portable = [kind for kind in ("hardware", "version") if t[f"{kind}_compatible"]]
        lines.append(f"tensorrt      {t['version']}, built on {t['gpu']} (compute capability {t['compute_capability']}"
                     f"{'; ' + ' and '.join(portable) + ' compatible' if portable else ''}), builder level "
                     f"{t['optimization_level']}, plugins {', '.join(f'{k} v{v}' for k, v in t['plugins'].items())}")
    lines += [f"section       {s['name']}: {s['length']:,} bytes" for s in manifest["sections"]]
    if manifest.get("tensorrt"):
        from llmc.formats.engine_file import read_engine
        from llmc.runtime.backends.tensorrt import layer_information

        lines.append(f"layers        {layer_information(read_engine(engine))}")
    click.echo("\n".join(lines))


@main.command()
@click.argument("engine", type=click.Path(dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--model-name", help="The model name clients pass (default: the engine file's name without .plan).")
@click.option("--max-waiting", default=256, show_default=True, type=int,
              help="Requests admitted beyond the running seats; past it, HTTP 429 with Retry-After.")
@click.option("--max-num-seqs", type=int, help="Scheduler: sequences per step (default: the engine's max batch).")
@click.option("--max-num-batched-tokens", type=int, help="Scheduler: tokens per step (default 512).")
@click.option("--max-wait-ms", default=0.0, show_default=True, type=float,
              help="Scheduler: hold new requests this long to fill a batch (latency for throughput).")
@click.option("--policy", default="priority", show_default=True,
              help="Scheduler: priority (a request's \"priority\" field, lower first, then arrival) or fifo.")
@click.option("--threads", type=int, help="CPU threads (default: every core).")
@click.option("--kv-pool-mb", type=float, help="KV pool size (default: the compiled size or the load-time rule).")
@click.option("--ray", "use_ray", is_flag=True, help="Serve replicas as Ray Serve deployments behind Ray's HTTP proxy "
              "(a local Ray cluster, or RAY_ADDRESS's).")
@click.option("--replicas", default=2, show_default=True, type=int, help="With --ray: engine replicas.")
@_speculative_tokens_option
def serve(engine, host, port, model_name, max_waiting, max_num_seqs, max_num_batched_tokens, max_wait_ms, policy,
          threads, kv_pool_mb, use_ray, replicas, speculative_tokens):
    """Serve ENGINE over an OpenAI-compatible HTTP API (completions, chat, models, health, metrics)."""
    import importlib.util

    from llmc.formats.engine_file import read_manifest
    from llmc.runtime.engine import Engine
    from llmc.runtime.scheduler import SchedulerConfig
    from llmc.server import ServerOptions, create_app, serve as run_server

    missing = [m for m in ("starlette", "uvicorn", "prometheus_client", "jinja2") if importlib.util.find_spec(m) is None]
    if missing:
        raise LlmcError(f"llmc serve needs {', '.join(missing)}: pip install 'llmc[serve]'")

    if max_waiting < 0:
        raise LlmcError(f"--max-waiting: must be ≥ 0, got {max_waiting}")
    if replicas < 1:
        raise LlmcError(f"--replicas: must be ≥ 1, got {replicas}")
    paged = read_manifest(_existing(engine))["paged"]
    if not paged:
        raise LlmcError(f"{engine}: llmc serve needs a paged engine (compiled without --no-paged)")
    scheduler = {"max_num_seqs": max_num_seqs or paged["max_batch"], "max_wait_ms": max_wait_ms, "policy": policy,
                 **({"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {})}
    config = SchedulerConfig(**scheduler)  # a bad value fails here, before any replica starts
    name = model_name or Path(engine).stem
    if use_ray:
        from llmc import server_ray

        cores = os.cpu_count() or 1
        app = server_ray.application(str(Path(engine).resolve()), ServerOptions(model_name=name, max_waiting=max_waiting),
                                     scheduler, replicas, cpus_per_replica=cores / replicas,
                                     threads=threads or max(1, cores // replicas), kv_pool_mb=kv_pool_mb,
                                     speculative_tokens=speculative_tokens)
        click.echo(f"serving {name} on http://{host}:{port}/v1 with {replicas} Ray Serve replicas (Ctrl-C or "
                   f"SIGTERM stops)", err=True)
        server_ray.run(app, host, port)
        return
    _share_threads(threads)
    loaded = Engine(engine, config, threads=threads, kv_pool_mb=kv_pool_mb, concurrent=config.max_num_seqs > 1,
                    speculative_tokens=speculative_tokens)
    app = create_app(loaded, ServerOptions(model_name=name, max_waiting=max_waiting))
    click.echo(f"serving {name} on http://{host}:{port}/v1 (Ctrl-C or SIGTERM drains and stops)", err=True)
    run_server(app, host, port)


@main.command()
@click.argument("engine", type=click.Path(dir_okay=False))
@click.option("--prompt", "prompts", multiple=True, help="A prompt; repeat for several.")
@click.option("--prompts-file", type=click.Path(dir_okay=False),
              help="Prompts, one per line, or JSONL objects with a 'prompt' field.")
@click.option("--max-new-tokens", default=32, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 is greedy.")
@click.option("--top-k", default=0, show_default=True, type=int, help="0 disables.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--min-p", default=0.0, show_default=True, type=float, help="0 disables.")
@click.option("--repetition-penalty", default=1.0, show_default=True, type=float, help="1 disables.")
@click.option("--presence-penalty", default=0.0, show_default=True, type=float, help="0 disables.")
@click.option("--seed", type=int, help="Seed for sampling (per request).")
@click.option("--stream", is_flag=True, help="Print tokens as they are generated.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per completion.")
@_speculative_tokens_option
def run(engine, prompts, prompts_file, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
        presence_penalty, seed, stream, as_json, speculative_tokens):
    """Generate completions with an ENGINE file."""
    from llmc.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                            presence_penalty=presence_penalty, seed=seed)
    prompts = list(prompts) + (_read_prompts(Path(prompts_file)) if prompts_file else [])
    if not prompts:
        raise LlmcError("--prompt: give at least one prompt (or --prompts-file)")
    for index, prompt in enumerate(prompts):
        _check_prompt_text(prompt, index)
    _share_threads(None)
    llm = LLM(engine, speculative_tokens=speculative_tokens)
    for index, prompt in enumerate(prompts):
        llm.encode(prompt, index)  # reject a bad prompt before generating for any
    if stream:
        for prompt in prompts:
            _stream_one(llm, prompt, params, as_json)
        llm.section_check.wait()  # the weights' checksum, hashed while generating
        return
    completions = llm.generate(prompts, params)
    llm.section_check.wait()  # the weights' checksum, hashed while generating: before any output
    for completion in completions:
        if as_json:
            click.echo(json.dumps({"prompt": completion.prompt, "text": completion.text,
                                   "token_ids": completion.token_ids,
                                   "prompt_token_ids": completion.prompt_token_ids,
                                   "finish_reason": completion.finish_reason}))
        else:
            click.echo(completion.prompt + completion.text)


def _kv_cache(manifest: dict) -> str:
    paged = manifest["paged"]
    if not paged:
        return f"contiguous past/present ({manifest['not_paged']})"
    return (f"paged: {paged['num_blocks']} blocks of {paged['block_size']} tokens ({paged['pool_mb']} MiB, "
            f"{paged['kv_dtype']}), max batch {paged['max_batch']}, max sequence {paged['max_seq_len']}"
            + (f", {len(paged['segments'])} segments" if paged["segments"] else ""))


def _build_options(options: dict) -> str:
    passes = options.get("passes", [])
    level = f"level {options['level']}" if options.get("level") is not None else "passes " + ",".join(passes)
    return f"backend {options.get('backend')}, {level} ({len(passes)} passes), verify {options.get('verify')}"


def _inspect_onnx(path: str, as_json: bool) -> None:
    from llmc.compiler.onnx_summary import summarize

    summary = summarize(path)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    lines = [f"model         {path} (opset {summary['opsets']}, {summary['nodes']} nodes, "
             f"{summary['parameters']:,} parameters, {summary['bytes']:,} bytes)"]
    lines += [f"input         {v['name']}: {v['dtype']} {v['shape']}" for v in summary["inputs"]]
    lines += [f"output        {v['name']}: {v['dtype']} {v['shape']}" for v in summary["outputs"]]
    lines += [f"op            {count:5d}  {op}" for op, count in summary["ops"].items()]
    click.echo("\n".join(lines))


def _existing(path: str) -> str:
    if not Path(path).is_file():
        raise LlmcError(f"{path}: no such file")
    return path


def _stream_one(llm, prompt: str, params, as_json: bool) -> None:
    if not as_json:
        click.echo(prompt, nl=False)
    for chunk in llm.stream(prompt, params):
        if as_json:
            click.echo(json.dumps({"prompt": prompt, "token_id": chunk.token_id, "text": chunk.text,
                                   "finish_reason": chunk.finish_reason}))
        else:
            click.echo(chunk.text, nl=False)
            sys.stdout.flush()
    if not as_json:
        click.echo()


def _check_prompt_text(prompt: str, index: int) -> None:
    """Refuse an empty prompt, and text that is not Unicode: a command-line argument whose bytes were
    not UTF-8 arrives holding surrogate escapes (U+DC80-U+DCFF), as can a JSON string's lone \\ud800."""
    if not prompt:
        raise LlmcError(f"prompt {index}: empty: give some text to continue")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(prompt[e.start])
        what = (f"byte 0x{code - 0xDC00:02x} is not UTF-8" if 0xDC80 <= code <= 0xDCFF
                else f"lone surrogate U+{code:04X}")
        raise LlmcError(f"prompt {index}: not valid text: {what} (character {e.start})") from None


def _read_prompts(path: Path) -> list[str]:
    if not path.is_file():
        raise LlmcError(f"{path}: no such file")
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
    try:
        # Only newlines end a line: str.splitlines would also split a prompt at U+2028 or a form feed.
        lines = [line.removesuffix("\r") for line in data.decode("utf-8").split("\n")]
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise LlmcError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise LlmcError(f"{path}:{number}: not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise LlmcError(f"{path}:{number}: expected an object with a string 'prompt'")
        prompts.append(record["prompt"])
    return prompts


@main.command()
@click.argument("engine_path", metavar="ENGINE", type=click.Path(dir_okay=False))
@click.option("--requests", default=None, type=int, help="Requests to send (default 64, or one per prompt of --prompts-file).")
@click.option("--prompt-len", default=128, show_default=True, type=int, help="Prompt tokens (low end with --prompt-len-max).")
@click.option("--prompt-len-max", default=None, type=int, help="Draw prompt lengths uniformly up to this.")
@click.option("--output-len", default=64, show_default=True, type=int, help="Output tokens (low end with --output-len-max).")
@click.option("--output-len-max", default=None, type=int, help="Draw output lengths uniformly up to this.")
@click.option("--prompts-file", type=click.Path(dir_okay=False),
              help="Text prompts (lines, or JSONL with 'prompt') instead of random token ids.")
@click.option("--rate", default=None, type=float, help="Requests/s, Poisson arrivals (default: all at t=0).")
@click.option("--batch", default=None, type=int,
              help="Closed loop: at most this many requests in the engine, the next added as one finishes; "
                   "1 runs them one at a time (single-request latency; adds batch and decode_tok_s).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--max-num-seqs", default=None, type=int, help="Scheduler: sequences per step.")
@click.option("--max-num-batched-tokens", default=None, type=int, help="Scheduler: tokens per step.")
@click.option("--threads", default=None, type=int, help="CPU threads (default: every core).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write TTFT/TPOT histograms and throughput over time (PNG).")
@click.option("--url", help="Send the workload to this OpenAI-compatible server (e.g. `llmc serve ENGINE`'s "
              "http://127.0.0.1:8000) as streamed requests instead of running ENGINE here; ENGINE still draws it.")
@click.option("--model", help="With --url: the model name to ask for (default: the server's first).")
@_speculative_tokens_option
def bench(engine_path, requests, prompt_len, prompt_len_max, output_len, output_len_max, prompts_file, rate, batch,
          seed, max_num_seqs, max_num_batched_tokens, threads, as_json, plot, url, model, speculative_tokens):
    """Serve a synthetic workload with ENGINE (or the server at --url) and report throughput and latency."""
    from llmc.runtime import bench as serving

    if batch is not None and batch < 1:
        raise LlmcError(f"--batch: must be ≥ 1, got {batch}")
    if batch is not None and rate is not None:
        raise LlmcError("--batch and --rate: choose one (--batch adds requests as others finish)")
    if speculative_tokens is not None and url is not None:
        raise LlmcError("--speculative-tokens: not with --url (the server's own option: llmc serve --speculative-tokens)")

    prompts = _read_prompts(Path(prompts_file)) if prompts_file else None
    for index, prompt in enumerate(prompts or []):
        _check_prompt_text(prompt, index)
    if requests is None:
        requests = len(prompts) if prompts else 64
    spec = serving.WorkloadSpec(requests=requests, prompt_len=prompt_len, prompt_len_max=prompt_len_max,
                                output_len=output_len, output_len_max=output_len_max, rate=rate, seed=seed)
    if url is not None:
        _bench_url(url, model, _existing(engine_path), spec, prompts, batch, as_json, plot, max_num_seqs,
                   max_num_batched_tokens)
        return
    if model is not None:
        raise LlmcError("--model: only with --url")
    if plot:
        serving.require_matplotlib()
    _share_threads(threads)
    engine, workload = serving.prepare(_existing(engine_path), spec, prompts=prompts, max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=max_num_batched_tokens, threads=threads,
                                       concurrent=batch != 1, speculative_tokens=speculative_tokens)
    with click.progressbar(length=sum(r.output_len for r in workload), label="llmc bench", file=sys.stderr) as bar:
        result = serving.run_workload(engine, workload, progress=bar.update, concurrency=batch)
    summary = serving.summarize(result)
    click.echo(json.dumps(summary) if as_json else serving.render(summary))
    if plot:
        serving.plot(result, plot, title=f"llmc bench {Path(engine_path).name}: {summary['requests']} requests")
        _progress(f"wrote {plot}")


def _bench_url(url, model, engine_path, spec, prompts, batch, as_json, plot, max_num_seqs, max_num_batched_tokens):
    """`llmc bench --url`: the workload ENGINE draws, through the server's HTTP API."""
    from llmc.formats.engine_file import read_engine
    from llmc.runtime import bench as serving
    from llmc.runtime.bench_http import run_http_workload
    from llmc.runtime.engine import load_tokenizer

    for option, value in (("--plot", plot), ("--max-num-seqs", max_num_seqs),
                          ("--max-num-batched-tokens", max_num_batched_tokens)):
        if value is not None:
            raise LlmcError(f"{option}: not with --url (the server's own settings apply)")
    engine = read_engine(engine_path, verify=False)
    tokenizer = load_tokenizer(engine)
    ids = None if prompts is None else [tokenizer.encode(p) for p in prompts]
    workload = serving.make_workload(spec, engine.manifest.geometry.vocab_size, ids)
    with click.progressbar(length=sum(r.output_len for r in workload), label=f"llmc bench {url}",
                           file=sys.stderr) as bar:
        result = run_http_workload(url, model, workload, progress=bar.update, concurrency=batch)
    summary = serving.summarize(result)
    click.echo(json.dumps(summary) if as_json else serving.render(summary))


@main.command()
@click.argument("engine_path", type=click.Path(dir_okay=False))
@click.option("--reference", required=True, type=click.Path(dir_okay=False),
              help="ONNX model to compare with (usually the one the engine was compiled from).")
@click.option("--data", required=True, type=click.Path(), help="Folder of held-out .txt/.jsonl/.npy/.npz.")
@click.option("--window", default=256, show_default=True, type=int, help="Tokens per evaluation window.")
@click.option("--max-tokens", default=4096, show_default=True, type=int, help="Tokens read from --data at most.")
@click.option("--generate", default=32, show_default=True, type=int, help="Greedy tokens compared.")
@click.option("--max-ppl-increase", default=None, type=float,
              help="Exit 1 when perplexity rises more than this many percent (CI gate).")
@click.option("--threads", default=None, type=int, help="CPU threads (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check(engine_path, reference, data, window, max_tokens, generate, max_ppl_increase, threads, as_json):
    """Accuracy of an engine against a reference model: perplexity, agreement, KL, divergence."""
    from llmc.llm import LLM
    from llmc.precision.check import ReferenceModel, check as run_check

    _share_threads(threads)
    engine = LLM(_existing(engine_path), threads)
    report = run_check(engine, ReferenceModel(_existing(reference), threads), data, window=window,
                       max_tokens=max_tokens, generate=generate, progress=_progress)
    engine.section_check.wait()
    failed = max_ppl_increase is not None and report.ppl_increase_pct > max_ppl_increase
    if as_json:
        click.echo(json.dumps({**report.to_dict(), "max_ppl_increase": max_ppl_increase, "passed": not failed}))
    else:
        rows = [("tokens compared", f"{report.tokens} in {report.windows} windows"),
                ("perplexity", f"{report.reference_ppl:.4f} reference, {report.engine_ppl:.4f} engine"),
                ("perplexity increase", f"{report.ppl_increase_pct:+.3f}%"),
                ("top-1 agreement", f"{report.top1_agreement:.4f}"),
                ("mean KL (ref ‖ engine)", f"{report.mean_kl:.3g} nats"),
                ("logit cosine", f"{report.logit_cosine:.6f}"),
                ("first greedy divergence", "none" if report.first_divergence is None
                 else f"token {report.first_divergence} of {report.generated}")]
        click.echo("\n".join(f"{name:<25} {value}" for name, value in rows))
    if failed:
        click.echo(f"llmc: check failed: perplexity +{report.ppl_increase_pct:.3f}% exceeds "
                   f"--max-ppl-increase {max_ppl_increase}%", err=True)
        sys.exit(1)


@main.command()
@click.argument("onnx_file", type=click.Path(dir_okay=False))
@click.option("--int8-calib", required=True, type=click.Path(), help="Calibration folder (.txt/.jsonl/.npy/.npz).")
@click.option("--data", type=click.Path(), help="Evaluation folder (default: the calibration folder).")
@click.option("--precision", "target", default="int8", show_default=True,
              help="int8, int8-dynamic, int8-weights or int4.")
@click.option("--calibrator", default="minmax", show_default=True, help="minmax, percentile or entropy.")
@click.option("--tokens", default=1024, show_default=True, type=int, help="Tokens of each folder used at most.")
@click.option("--accuracy-budget", type=float, default=None,
              help="Largest perplexity increase (percent): spare the most sensitive layers until it holds.")
@click.option("--exhaustive", is_flag=True, help="Rank by quantizing each layer alone (one evaluation per layer) "
              "instead of each layer's added error in one run.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the mixed-precision file here.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def sensitivity(onnx_file, int8_calib, data, target, calibrator, tokens, accuracy_budget, exhaustive, output, as_json):
    """Rank linear layers by the error quantizing each alone causes; fit an accuracy budget."""
    from llmc.compiler.build import find_tokenizer
    from llmc.formats.decoder_interface import recognize_decoder
    from llmc.formats.onnx_io import load_onnx, validate, write_text_atomic
    from llmc.compiler.pipeline import optimize
    from llmc.precision.calibration import check_calibrator
    from llmc.precision.data import read_documents, windows
    from llmc.precision.sensitivity import TARGETS, analyze

    if target not in TARGETS:
        raise LlmcError(f"--precision: '{target}' is not one of {', '.join(TARGETS)}")
    path = Path(_existing(onnx_file))
    model = load_onnx(path)
    validate(model, path)
    geometry = recognize_decoder(model, path).geometry
    tokenizer = find_tokenizer(model, path, None)
    length = min(256, geometry.max_positions)
    calibration = windows(read_documents(int8_calib, tokenizer, geometry.vocab_size, "--int8-calib"), length, tokens)
    check_calibrator(calibrator, sum(len(w) for w in calibration))
    evaluation = calibration if data is None else windows(
        read_documents(data, tokenizer, geometry.vocab_size, "--data"), length, tokens)
    _progress(f"optimizing {len(model.graph.node)} nodes")
    model, _ = optimize(model)
    result = analyze(model, target, calibration, evaluation, calibrator=calibrator, budget_pct=accuracy_budget,
                     exhaustive=exhaustive, progress=_progress)
    if output:
        write_text_atomic(output, json.dumps(result.config, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps({"target": target, "ranking": result.ranking, "kept_fp32": result.kept_fp32,
                               "ppl_fp32": result.ppl_fp32, "ppl_quantized": result.ppl_quantized,
                               "ppl_increase_pct": result.ppl_increase_pct, "config": result.config,
                               "seconds": round(result.seconds, 1)}))
        return
    click.echo(f"{'layer':<24} " + (f"mean KL when only it is {target}" if exhaustive else f"added error as {target}"))
    click.echo("\n".join(f"{name:<24} {kl:.3e}" for name, kl in result.ranking))
    kept = f", {len(result.kept_fp32)} kept in fp32 ({', '.join(result.kept_fp32)})" if result.kept_fp32 else ""
    click.echo(f"all {target}{kept}: perplexity {result.ppl_fp32:.4f} → {result.ppl_quantized:.4f} "
               f"({result.ppl_increase_pct:+.3f}%) in {result.seconds:.0f} s" + (f"; wrote {output}" if output else ""))


if __name__ == "__main__":
    entry()
