"""`llmc compile`: a decoder ONNX file into one engine file (llmc.compile).

The options arrive as the library's typed option objects (`PagedOptions`, `PrecisionOptions`,
`TensorRTOptions`); this module adds only what a command line knows and Python does not: which
options were typed, refused when the backend or the other options would leave them without effect.
"""

import json
import sys

import click

from llmc.cli.common import flag, given_options, main, option_group, pass_names, pipeline_options, progress
from llmc.errors import LlmcError


def _paged_options(paged, block_size, max_batch, max_seq_len, kv_pool_mb, kv_cache_dtype):
    from llmc.compiler.paged_engine import KV_DTYPES, PagedOptions

    if not paged:
        return None
    if kv_cache_dtype not in KV_DTYPES:
        raise LlmcError(f"--kv-cache-dtype: '{kv_cache_dtype}' is not one of {', '.join(KV_DTYPES)}")
    return PagedOptions(max_batch=max_batch, max_seq_len=max_seq_len, kv_pool_mb=kv_pool_mb,
                        kv_dtype=KV_DTYPES[kv_cache_dtype], **({"block_size": block_size} if block_size is not None else {}))


def _precision_options(**values):
    from llmc.precision.plan import PrecisionOptions

    return PrecisionOptions(**values)


def _tensorrt_options(**values):
    from llmc.compiler.tensorrt_network import TensorRTOptions

    return TensorRTOptions(**values)


engine_options = option_group(
    "paged", _paged_options,
    click.option("--paged/--no-paged", default=True, show_default=True,
                 help="KV cache in blocks of one pool (llmc::paged_attention) or contiguous past/present."),
    click.option("--block-size", default=None, type=int, help="Tokens per KV block (default 16, by measurement)."),
    click.option("--max-batch", default=64, show_default=True, type=int, help="Sequences per step (seats)."),
    click.option("--max-seq-len", default=None, type=int, help="Longest sequence (default: the model's positions)."),
    click.option("--kv-pool-mb", default=None, type=float, help="KV pool size (default: up to 16 full-length "
                 "sequences, capped at load by half the memory available then)."),
    click.option("--kv-cache-dtype", default="auto", show_default=True,
                 help="KV pool element type: auto (the model's), fp16 or fp32."))

precision_options = option_group(
    "precision", _precision_options,
    click.option("--fp16", is_flag=True, help="Compute in fp16, with fp32 norms, attention and residual sums."),
    click.option("--int8-calib", type=click.Path(), help="Static int8 (Q/DQ) for linear layers, calibrated on "
                 "this folder's .txt/.jsonl/.npy/.npz."),
    click.option("--calibrator", default="minmax", show_default=True, help="minmax, percentile or entropy."),
    click.option("--smoothquant", type=float, default=None,
                 help="SmoothQuant strength for int8 (0 turns it off; default: chosen per activation by measurement)."),
    click.option("--int8-dynamic", is_flag=True, help="int8 (Q/DQ) for linear layers with per-token activation "
                 "scales computed at run time: no calibration."),
    click.option("--calib-tokens", default=4096, show_default=True, type=int, help="Calibration tokens read at most."),
    click.option("--weights", default=None, help="Weight-only int8 or int4 for linear layers (activations stay float)."),
    click.option("--weights-block-size", default=None, type=int, help="Weights per scale for --weights (default 32; "
                 "64 with --backend tensorrt, whose int4 blocks hold 64 or 128)."),
    click.option("--weights-symmetric", is_flag=True, help="Weight-only blocks without zero points "
                 "(onnxruntime-genai's scheme; a little faster, less accurate than the default asymmetric blocks)."),
    click.option("--precision-config", "config", type=click.Path(), help="Mixed precision: JSON mapping layers or "
                 "op types to fp32/fp16/int8/int8-dynamic/int8-weights/int4."),
    click.option("--calib", type=click.Path(), help="Text like your traffic (.txt/.jsonl/.npy/.npz folder) to check a "
                 "quantized engine's accuracy on (and to smooth int8 with), when --int8-calib does not name it."),
    click.option("--max-ppl-increase", default=3.0, show_default=True, type=float,
                 help="Refuse a quantized engine whose perplexity on held-back data rises more (percent)."),
    click.option("--force", is_flag=True, help="Write the engine even past --max-ppl-increase, or without data to "
                 "check it."))

tensorrt_options = option_group(
    "tensorrt", _tensorrt_options,
    click.option("--dry-run", is_flag=True, help="TensorRT: check every node against TensorRT 11's ONNX parser and "
                 "print what would be built; build nothing (needs no GPU). Exit 2 names each unsupported node."),
    click.option("--max-num-tokens", default=2048, show_default=True, type=int,
                 help="TensorRT: packed tokens in one step (the profile's largest)."),
    click.option("--builder-optimization-level", "optimization_level", default=3, show_default=True, type=int,
                 help="TensorRT: 0-5."),
    click.option("--timing-cache", type=click.Path(dir_okay=False), help="TensorRT: timing cache file, read and "
                 "updated."),
    click.option("--workspace-mb", type=float, default=None, help="TensorRT: builder workspace limit (default: the "
                 "GPU's memory)."),
    click.option("--hardware-compatible", is_flag=True, help="TensorRT: an engine for any Ampere-or-newer GPU."),
    click.option("--version-compatible", is_flag=True, help="TensorRT: an engine later TensorRT 11 releases can run."))

# Engine options only a paged engine reads (--paged itself aside).
_PAGED_ONLY = ("block_size", "max_batch", "max_seq_len", "kv_pool_mb", "kv_cache_dtype")
_TENSORRT_ONLY = ("dry_run", "max_num_tokens", "optimization_level", "timing_cache", "workspace_mb",
                  "hardware_compatible", "version_compatible")


@main.command(name="compile")
@click.argument("onnx_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Engine file to write.")
@click.option("--backend", default="onnxruntime", show_default=True,
              help="Runtime the engine targets: onnxruntime (CPU), openvino (CPU: one OpenVINO model a step; "
              "pip install 'llmc[openvino]') or tensorrt (NVIDIA GPU).")
@click.option("--bf16", is_flag=True, help="--backend openvino: compute in bf16 on CPUs with avx512_bf16 or AMX (f32 "
              "elsewhere), once its accuracy is checked here (--calib's data, else llmc's general text).")
@click.option("--tokenizer", type=click.Path(), help="tokenizer.json or its folder (default: embedded or beside the "
              "ONNX file).")
@pipeline_options
@engine_options
@precision_options
@tensorrt_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout (engine, sha256, backend, "
              "precision, geometry, passes, build time, warnings); progress stays on stderr.")
def compile_command(onnx_file, output, backend, bf16, tokenizer, level, passes, verify, paged, precision, tensorrt,
                    as_json):
    """Compile a decoder ONNX_FILE into one engine file (running the optimization passes first).

    Options that cannot go together, or that the others would leave without effect, are refused
    before any work, in one line naming them.
    """
    from llmc.compiler.build import compile_model
    from llmc.compiler.targets import find_target

    target = find_target(backend)
    _refuse_unread_options(given_options(), target, paged is not None, precision)
    result = compile_model(onnx_file, output, backend=backend, tokenizer=tokenizer, level=level,
                           passes=pass_names(passes), verify=verify, paged=paged, precision=precision,
                           tensorrt=tensorrt, bf16=bf16, progress=progress)
    if tensorrt.dry_run:
        if as_json:
            click.echo(json.dumps({"dry_run": True, "backend": backend, **result.tensorrt_check}))
            if result.tensorrt_check["unsupported"]:
                sys.exit(2)
            return
        _report_dry_run(result)
        return
    if as_json:
        click.echo(json.dumps(result.summary()))
        return
    _report(result, output)


def _refuse_unread_options(given: set[str], target, paged: bool, precision) -> None:
    """Refuse, before any work, an option given on the command line that the backend, the cache
    layout or the other precision options would ignore: whoever gave it expects an engine that has it
    (compile_model refuses what no engine can have: --no-paged with TensorRT, say)."""
    from llmc.precision.plan import QUANTIZED, check_options

    for name in _TENSORRT_ONLY:
        if name in given and not target.reads_tensorrt_options:
            raise LlmcError(f"{flag(name)}: only for --backend tensorrt")
    for name in _PAGED_ONLY:
        if name in given and not paged:
            raise LlmcError(f"{flag(name)} and --no-paged: only a paged engine has KV blocks and seats")
    # compile_model checks the options again (its callers need not be this CLI); here the
    # precisions they ask for also tell which options given on the command line would do nothing.
    asked = precision.precisions(check_options(precision, target.name))
    quantized = "quantized layers (--int8-calib, --int8-dynamic, --weights or --precision-config)"
    needs = {"smoothquant": (bool(asked & {"int8", "int8-dynamic"}),
                             "int8 activations (--int8-calib, --int8-dynamic or int8 in --precision-config)"),
             "calibrator": ("int8" in asked, "calibrated int8 (--int8-calib, or int8 in --precision-config)"),
             "weights_block_size": (bool(asked & QUANTIZED), quantized),
             "weights_symmetric": (bool(asked & QUANTIZED), quantized),
             "calib_tokens": (precision.data is not None, "data (--int8-calib or --calib)")}
    for name, (used, what) in needs.items():
        if name in given and not used:
            raise LlmcError(f"{flag(name)}: only with {what}")


def _report(result, output: str) -> None:
    from llmc.formats.manifest import precision_summary

    manifest = result.manifest
    steps = manifest["optimization"]
    if steps:
        fused = ", ".join(f"{e['pass']} {e['matches']}" for e in steps
                          if e["matches"] and not e["pass"].startswith(("eliminate-", "fold-")))
        click.echo(f"optimized: {manifest['source']['nodes']} → {steps[-1]['nodes_after']} nodes "
                   f"({fused or 'no fusions'})")
    g = manifest["geometry"]
    click.echo(f"wrote {output}: {manifest['backend']}, {precision_summary(manifest)}, {g['num_layers']} "
               f"layers, vocab {g['vocab_size']}, {g['max_positions']} positions")


def _report_dry_run(result) -> None:
    """What a TensorRT build would parse; exit 2 naming every node it could not."""
    check, manifest = result.tensorrt_check, result.manifest
    g = manifest["geometry"]
    plugins = ", ".join(f"{plugin} ×{count}" for plugin, count in check["plugins"].items()) or "none"
    click.echo(f"tensorrt dry run: {check['nodes']} nodes ({len(check['ops'])} op types), plugins {plugins}; "
               f"{manifest['dtype']}, {g['num_layers']} layers, vocab {g['vocab_size']}")
    ranges: dict[str, list[str]] = {}  # inputs with the same range on one line (a pool per layer and part)
    for name, (low, opt, high) in check["profile"].items():
        if low != high:
            ranges.setdefault(f"min {low} opt {opt} max {high}", []).append(name)
    for shapes, names in ranges.items():
        shown = ", ".join(names) if len(names) <= 2 else f"{names[0]} … {names[-1]} ({len(names)})"
        click.echo(f"  profile {shown}: {shapes}")
    if check["unsupported"]:
        for line in check["unsupported"]:
            click.echo(f"  unsupported: {line}", err=True)
        click.echo(f"llmc: error: {len(check['unsupported'])} node(s) TensorRT 11 cannot build (listed above)", err=True)
        sys.exit(2)
    click.echo("ok: every node is one TensorRT 11's ONNX parser imports or an llmc plugin (nothing built)")
