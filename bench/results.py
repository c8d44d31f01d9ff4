"""bench/RESULTS.md and README.md's results table, generated from the benchmarks' JSON files.

Each benchmark with a headline figure writes one JSON object (`--save-json bench/results/<name>.json`)
that carries its figures and bench/record.py's record: the command, the machine and its load,
the commit, the UTC time. This script renders one section per benchmark from those files, so a
figure in RESULTS.md is always one a command printed; a benchmark without a file gets its
description and command only. It also fills README.md's block between `<!-- results:begin -->`
and `<!-- results:end -->` with the headline figures against the peers.

    python bench/results.py            # write bench/RESULTS.md and the README block
    python bench/results.py --check    # exit 1 if either differs from what the JSON files give

A file missing a field the rendering needs is refused in one line naming the file and the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from latency_bench import run_ratios  # noqa: E402  (stdlib only: the pairing the benchmark's ratios use)

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NOT_RUN = "No result recorded yet: run the command above."


class ResultsError(Exception):
    """A results file that cannot be rendered; the message names the file."""


class Result:
    """One benchmark's JSON object, read with field paths so a missing field names its file."""

    def __init__(self, path: Path, data: Any):
        if not isinstance(data, dict):
            raise ResultsError(f"{path}: not a JSON object")
        self.path, self.data = path, data

    def get(self, *keys: str | int, default: Any = ...) -> Any:
        value = self.data
        for key in keys:
            try:
                value = value[key]
            except (KeyError, IndexError, TypeError):
                if default is not ...:
                    return default
                raise ResultsError(f"{self.path}: missing field {'.'.join(map(str, keys))!r}") from None
        return value


def load(path: Path) -> Result:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResultsError(f"{path}: not readable as JSON ({exc})") from None
    return Result(path, data)


# --- formatting -----------------------------------------------------------------------------


def num(value: Any, digits: int = 3) -> str:
    """A figure as printed in the tables: `-` for none, 3 significant digits below 100."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def ratio(mine: Any, theirs: Any) -> str:
    if not isinstance(mine, (int, float)) or not isinstance(theirs, (int, float)) or not theirs:
        return "-"
    return f"{mine / theirs:.2f}"


def stored_ratio(value: Any) -> str:
    """A ratio the benchmark computed (latency_bench's are paired run by run), as printed."""
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"


def table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> list[str]:
    """A Markdown table: the first `text_columns` columns left-aligned, the figures right-aligned."""
    align = ["---"] * text_columns + ["---:"] * (len(header) - text_columns)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def provenance(result: Result) -> list[str]:
    """The command, machine, load, commit and time lines every section with figures starts with."""
    rec = ("record",)
    machine = result.get(*rec, "machine")
    load_start, load_end = (result.get(*rec, "machine", key) for key in ("loadavg_start", "loadavg_end"))
    git = result.get(*rec, "git")
    commit = result.get(*rec, "git", "commit")
    first = (lambda load: f"{load[0] if isinstance(load, list) else load:.2f}")
    started = result.get(*rec, "utc_start", default=None)
    when = f"{started} to {result.get(*rec, 'utc_end')}" if started else result.get(*rec, "utc_end")
    memory = machine.get("memory_gib")
    # recorded where a peer's default precision depends on them (OpenVINO: bf16 with avx512_bf16 or AMX)
    flags = machine.get("cpu_flags")
    return ["```bash", result.get(*rec, "command"), "```", "",
            f"- Machine: {result.get(*rec, 'machine', 'cpu')}, {result.get(*rec, 'machine', 'cores')} cores"
            + (f", {memory} GiB memory" if memory else "")
            + f"; 1-minute load average {first(load_start)} at the start, {first(load_end)} at the end",
            *([f"- CPU flags: {' '.join(flags) if flags else 'none of avx512*, amx*'}"] if flags is not None else []),
            f"- Commit: `{str(commit)[:10]}`" + (" (working tree with uncommitted changes)" if git.get("dirty") else ""),
            f"- UTC: {when}", ""] + (
        ["A quick run (`--quick`): smoke-test sizes, not a measurement.", ""] if result.get("quick", default=False) else [])


def time_went(row: str, profile: dict[str, Any]) -> list[str]:
    """Where llmc's time went in one row's measurement, from the breakdown of its profiled second
    run (runtime/profile.py): per step kind, the time of a step, its three largest parts, its
    bound on this machine and its slowest operator."""
    rows = []
    for kind, entry in profile["kinds"].items():
        step_ms = entry["step_ms"]
        parts = sorted(entry["parts_ms"].items(), key=lambda item: -item[1])[:3]
        top = entry["top_operators"][0] if entry["top_operators"] else None
        rows.append([kind, str(entry["steps"]), num(step_ms),
                     ", ".join(f"{part} {ms / step_ms:.0%}" for part, ms in parts),
                     _bound(entry["bound"]) if "bound" in entry else "-",
                     # a Markdown cell: a node name's "|" would end it
                     f"{top['op']} `{top['name'].replace('|', '/')}`: {num(top['ms_per_step'])} ms" if top else "-"])
    lines = ["", f"Where llmc's time went: {row} (the measurement again under the profiler, which slows it: "
                 "read the shares, not the speed).", ""]
    lines += table(["step", "steps", "ms/step", "largest parts", "bound", "slowest operator"], rows, text_columns=6)
    machine = profile.get("machine")
    if machine:
        lines += ["", f"Bounds from the machine's limits measured in that run ({machine['threads']} threads): memory "
                      f"{num(machine['memory_bytes_per_s'] / 1e9)} GB/s, fp32 peak {num(machine['flops_per_s'] / 1e9)} "
                      "GFLOP/s."]
    return lines


def _bound(bound: dict[str, Any]) -> str:
    from llmc.runtime.roofline import describe

    return describe(bound)


# --- one renderer per benchmark --------------------------------------------------------------


# OpenVINO GenAI's settings (latency_bench's columns, serving_bench's systems): its defaults and f32 compute.
OPENVINO = {"openvino": "OpenVINO GenAI", "openvino-f32": "OpenVINO GenAI f32"}


def openvino_note(versions: dict[str, str] | None) -> str:
    """What the OpenVINO GenAI columns or rows ran (bench/openvino_peer.py)."""
    return (f"OpenVINO GenAI{' ' + versions['openvino-genai'] if versions else ''} on `optimum-cli export openvino`'s "
            "model, with its defaults, which compute in bf16 where the CPU has "
            "avx512_bf16 or AMX, and with f32 compute (`INFERENCE_PRECISION_HINT`).")


def render_latency(result: Result) -> list[str]:
    # columns for the peers a file measured: a file from before they ran renders as it did
    peers = [name for name in OPENVINO if any(name in row for row in result.get("table"))]
    limits = any("limit" in row for row in result.get("table"))
    rows = []
    for row in result.get("table"):
        rows.append([row["measure"], num(row.get("llmc")), num(row.get("genai")),
                     *(num(row.get(name)) for name in peers), stored_ratio(row.get("ratio")),
                     *(stored_ratio(row.get(f"ratio_{name}")) for name in peers)])
        if limits:
            limit, share = row.get("limit"), row.get("llmc_share_of_limit")
            rows[-1] += [f"{num(limit['value'])} ({limit['bound']})" if limit else "-",
                         f"{share:.0%}" if share is not None else "-"]
    lines = table(["measure", "llmc", "onnxruntime-genai", *(OPENVINO[name] for name in peers), "llmc ÷ genai",
                   *(f"llmc ÷ {OPENVINO[name]}" for name in peers),
                   *(["machine limit", "llmc of the limit"] if limits else [])], rows)
    if limits:
        used = result.get("machine_limits", "used")
        lines += ["", "Machine limit: the fastest the row's work can run here, from this run's measured bandwidth "
                  f"({used['memory_bytes_per_s'] / 1e9:.1f} GB/s) and fp32 peak "
                  f"({used['flops_per_s'] / 1e9:.0f} GFLOP/s), {used['threads']} threads (the better of a "
                  "measurement before and after the runs): every weight read once a step and the attended keys "
                  "and values (memory), or 2 FLOPs per parameter per token and the attention's products (compute), "
                  "whichever takes longer. Speculation passes it (several tokens for one read of the weights); "
                  "so can a peer computing in bf16 (half the weight bytes, twice the peak with avx512_bf16)."]
    if peers:
        lines += ["", openvino_note((result.get("openvino", default=None) or {}).get("versions"))
                  + " Its int4: asymmetric, groups of 32. \"-\": a row its runs do not measure."]
    lines += render_llmc_openvino(result)
    lines += huge_pages_note(result)
    for what, error in (result.get("peer_errors", default=None) or {}).items():
        lines += ["", f"Not measured (\"-\" above): {what}: {error}"]
    for precision, agreement in (result.get("real_text_agreement", default=None) or {}).items():
        if agreement:
            lines += ["", f"Real text, {precision}: {agreement['same_as_genai']} of {agreement['prompts']} "
                          "greedy outputs token for token onnxruntime-genai's."]
    for what, error in (result.get("build_errors", default=None) or {}).items():
        lines += ["", f"Build failed: {what}: {error}"]
    for row in result.get("table"):
        if "profile" in row:
            lines += time_went(row["measure"], row["profile"])
    return lines


def huge_pages_note(result: Result) -> list[str]:
    """Each system's memory on 2 MiB pages once its fp32 model is loaded (the median over the
    runs), for a file whose workers reported it."""
    names = {"llmc": "llmc", "genai": "onnxruntime-genai", **OPENVINO,
             **{name: label for name, (label, _) in LLMC_OPENVINO.items()}}
    held = {}
    for system, by_precision in (result.get("runs", default=None) or {}).items():
        values = sorted(run["huge_pages_after_load_mib"] for run in by_precision.get("fp32", [])
                        if run.get("huge_pages_after_load_mib") is not None)
        if values:
            held[names.get(system, system)] = values[len(values) // 2]
    if not held:
        return []
    return ["", "Memory on 2 MiB pages once loaded, fp32 (MiB): "
            + ", ".join(f"{name} {num(mib)}" for name, mib in held.items())
            + ". llmc's processes start with malloc's heap on transparent huge pages, as `llmc serve` "
              "does (docs/running.md); the peers run as they ship."]


# llmc's own OpenVINO backend (latency_bench's LLMC_OPENVINO): system -> (its label, the peer it faces)
LLMC_OPENVINO = {"llmc-openvino": ("llmc --backend openvino --bf16", "openvino"),
                 "llmc-openvino-f32": ("llmc --backend openvino --kv-cache-dtype fp16", "openvino-f32")}


def render_llmc_openvino(result: Result) -> list[str]:
    """llmc's OpenVINO backend beside OpenVINO GenAI, each setting against its like, for the rows
    it ran; nothing for a file from before it."""
    systems = [name for name in LLMC_OPENVINO if any(row.get(name) for row in result.get("table"))]
    if not systems:
        return []
    header, rows = ["measure"], []
    for name in systems:
        label, peer = LLMC_OPENVINO[name]
        header += [label, OPENVINO[peer], "÷", "pairs' ÷"]
    header += ["machine limit", *(f"{LLMC_OPENVINO[name][0]} of the limit" for name in systems)]
    for row in result.get("table"):
        if not any(row.get(name) for name in systems):
            continue
        cells = [row["measure"]]
        for name in systems:
            cells += [num(row.get(name)), num(row.get(LLMC_OPENVINO[name][1])), stored_ratio(row.get(f"ratio_{name}")),
                      run_ratio_range(result, name, row)]
        limit = row.get("limit")
        cells.append(f"{num(limit['value'])} ({limit['bound']})" if limit else "-")
        cells += [f"{row[f'{name}_share_of_limit']:.0%}" if row.get(f"{name}_share_of_limit") is not None else "-"
                  for name in systems]
        rows.append(cells)
    return ["", "llmc's OpenVINO backend (`llmc compile --backend openvino`, with `--bf16`, and without it with "
            "`--kv-cache-dtype fp16`: the f16 KV cache OpenVINO GenAI keeps under f32 compute) against "
            "OpenVINO GenAI with the same compute precision, same run. The int4 rows: the same options and "
            "`--weights int4 --force` (llmc's default int4: asymmetric, groups of 32, int8 lm_head), against "
            "OpenVINO GenAI's int4 with the same compute precision (whose cache is u8 under f32); with `--bf16` "
            "on a CPU with AMX, llmc's int4 runs prompts in bf16 and decodes on a second model in f32 (docs/running.md). "
            "The machine limit is the fp32 one (int4's for the int4 rows): bf16 reads half the weight bytes and has "
            "twice the peak, so bf16 rows can pass it. \"pairs' ÷\": the lowest and highest of the paired "
            f"measurements' own ratios (each the two systems seconds apart; {timed_again(result)}), of "
            "which \"÷\" is the median.", ""] + table(header, rows)


def timed_again(result: Result) -> str:
    """Which rows a run took three times: the long prompt too, where the file's runs have it at a
    second take (latency_bench's files from before it was taken again have it once)."""
    again = any(r.get("take") and "ttft_long_ms" in r
                for by_precision in result.get("runs", default={}).values() for rs in by_precision.values() for r in rs)
    return "a run's rows that time a request three times" if again else "a run's short rows three times"


def run_ratio_range(result: Result, system: str, row: dict) -> str:
    """The range of `row`'s ratio pair by pair (`run_ratios`), `system` against its peer; a one-token-
    a-step row faces the peer's plain rate (it never guesses)."""
    runs, peer, key, precision = result.get("runs", default={}), LLMC_OPENVINO[system][1], row["key"], row["precision"]
    ratios = run_ratios(runs.get(system, {}).get(precision, []), runs.get(peer, {}).get(precision, []), key,
                        key.removeprefix("plain_"))
    return f"{min(ratios):.2f}–{max(ratios):.2f}" if len(ratios) > 1 else "-"


def render_serving(result: Result) -> list[str]:
    systems = result.get("systems")
    llmc = systems.get("llmc", {}).get("throughput_tok_s")
    limit = result.get("limit", default=None)  # absent from a file measured before it was
    rows = []
    for name, system in systems.items():
        rows.append([name, num(system.get("throughput_tok_s")), num(system.get("ttft_ms_p50")),
                     num(system.get("ttft_ms_p99")), ratio(llmc, system.get("throughput_tok_s"))])
        if limit:
            share = system.get("share_of_limit")
            rows[-1].append(f"{share:.0%}" if share is not None else "-")
    failed = {name for key in (result.get("errors", default=None) or {}) for name in key.split(", ")}
    rows += [[name, "-", "-", "-", "-", *(["-"] if limit else [])]
             for name in OPENVINO if name in failed and name not in systems]
    workload = result.get("workload")
    lines = [f"{workload['requests']} requests, {workload['prompt_tokens']:,} prompt and "
             f"{workload['output_tokens']:,} output tokens; {result.get('threads')} threads for every system.", ""]
    lines += table(["system", "useful tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "llmc ÷ system",
                    *(["of the machine limit"] if limit else [])], rows)
    if limit:
        used = result.get("machine_limits", "used")
        lines += ["", f"Machine limit: {num(limit['value'])} useful tok/s ({limit['bound']}-bound), from this run's "
                      f"measured bandwidth ({used['memory_bytes_per_s'] / 1e9:.1f} GB/s) and fp32 peak "
                      f"({used['flops_per_s'] / 1e9:.0f} GFLOP/s): every prompt and output token through the model "
                      "once with causal attention (compute), and at least as many steps as the longest output, each "
                      "reading every weight (memory). bf16 compute doubles the peak, so a bf16 system can pass it."]
    if any(name in systems for name in OPENVINO):
        versions = next((systems[name].get("versions") for name in OPENVINO if name in systems), None)
        lines += ["", f"openvino, openvino-f32: {openvino_note(versions)} Its continuous batching, each request "
                      "added at its arrival."]
    ratios = result.get("ratios", default=None) or {}
    alike = [f"{name} ÷ {peer}: {stored_ratio(ratios[f'{name}_vs_{peer}'])}" for name, (_, peer) in LLMC_OPENVINO.items()
             if f"{name}_vs_{peer}" in ratios]
    if alike:
        lines += ["", "llmc's OpenVINO backend (llmc-openvino: `--backend openvino --bf16`; llmc-openvino-f32: "
                      "`--backend openvino --kv-cache-dtype fp16`) against OpenVINO GenAI with the same compute "
                      "precision: " + "; ".join(alike) + "."]
    interference = result.get("interference", default=None)
    if interference:
        lines += ["", f"Interference: the short requests' p99 TTFT is {num(interference['ttft_ms_p99_alone'])} ms alone "
                      f"and {num(interference['ttft_ms_p99_with_long'])} ms with a {interference['long_prompt']:,}-token "
                      f"prompt in flight ({num(interference['p99_ratio'])}×)."]
    for name, message in (result.get("errors", default=None) or {}).items():
        lines += ["", f"Failed: {name}: {message}"]
    for name, system in systems.items():
        if "profile" in system:
            lines += time_went(f"{name}, useful tok/s", system["profile"])
    return lines


def render_product_command(result: Result) -> list[str]:
    rows = []
    for row in result.get("rows"):
        if "refused" in row:
            # the gate's message up to its list of layers: the figure it refused on
            rows.append([row["row"], f"refused: {str(row['refused']).split(';')[0]}", "-", "-"])
        else:
            rows.append([row["row"], num(row.get("ppl_increase_pct")), num(row.get("top1_agreement")),
                         num(row.get("gate_ppl_increase_pct"))])
    return table(["row", "perplexity increase (%)", "top-1 agreement", "gate's perplexity increase (%)"], rows)


def render_large_model(result: Result) -> list[str]:
    weights = result.get("checkpoint", "weights_gb")
    rows = [[step["step"], num(step.get("seconds")), num(step.get("peak_rss_gb")),
             ratio(step.get("peak_rss_gb"), weights), str(step.get("exit_code"))] for step in result.get("results")]
    lines = [f"Checkpoint: {num(weights)} GB of fp32 weights.", ""] + table(
        ["step", "wall (s)", "peak RSS (GB)", "peak ÷ weights", "exit"], rows)
    steps = {step["step"]: step for step in result.get("results")}
    pairs = []
    # checkpoint to ONNX against torch's exporter; checkpoint to a runnable model against genai's builder
    for mine, theirs in ((("llmc export",), "torch.onnx export (dynamo)"),
                         (("llmc export", "llmc compile"), "genai builder")):
        if all(step in steps for step in (*mine, theirs)):
            seconds = sum(steps[step].get("seconds") or 0 for step in mine)
            peak = max(steps[step].get("peak_rss_gb") or 0 for step in mine)
            pairs.append([f"{' + '.join(mine)} ÷ {theirs}", ratio(seconds, steps[theirs].get("seconds")),
                          ratio(peak, steps[theirs].get("peak_rss_gb"))])
    if pairs:
        lines += ["", *table(["against the peer of the same run", "wall", "peak RSS (the steps' highest)"], pairs)]
    return lines


def render_precision(result: Result) -> list[str]:
    rows = [[name, num(v.get("engine_ppl"), 4), num(v.get("ppl_increase_pct")), num(v.get("top1_agreement")),
             num(v.get("decode_tok_s")), num(v.get("decode_vs_fp32")), num(v.get("engine_mb"))]
            for name, v in result.get("variants").items()]
    lines = table(["variant", "perplexity", "increase (%)", "top-1", "decode tok/s", "× fp32", "engine MB"], rows)
    for name, message in (result.get("errors", default=None) or {}).items():
        lines += ["", f"Failed: {name}: {message}"]
    return lines


def render_export_paths(result: Result) -> list[str]:
    runs = result.get("runs")
    peer = {run["exporter"]: run.get("export_s") for run in runs if run["path"] == "transformers"}
    rows = [[run["path"], run["exporter"], num(run.get("load_s")), num(run.get("export_s")),
             ratio(run.get("export_s"), peer.get(run["exporter"])), num(run.get("parity")),
             num(run.get("nodes")), num(run.get("optimized"))] for run in runs]
    return table(["path", "exporter", "load (s)", "export (s)", "÷ transformers' module", "parity",
                  "nodes", "after optimize"], rows, text_columns=2)


def compare_renderer(scenarios: tuple[str, ...]) -> Callable[[Result], list[str]]:
    """A compare_commits renderer of the rows of `scenarios` (a file may hold more: the decode
    rates have a file of their own, measured over more batches)."""
    def render(result: Result) -> list[str]:
        trees = result.get("trees")
        lines = [f"A: `{trees['a']['commit']}`, B: `{trees['b']['commit']}`; {result.get('rounds')} rounds, "
                 "medians over rounds.", ""]
        rows = [[row["scenario"], row["metric"], num(row.get("a_median")), num(row.get("b_median")),
                 num(row.get("ratio_b_over_a")), "higher" if row.get("higher_is_better") else "lower"]
                for row in result.get("rows") if row.get("scenario") in scenarios]
        return lines + table(["scenario", "metric", "A", "B", "B ÷ A", "better"], rows, text_columns=2)
    return render


def render_optimize(result: Result) -> list[str]:
    latency = result.get("latency")
    shapes = list(next(iter(latency.values()), {}))
    versus = result.get("llmc_speedup", default=None) or {}
    header = ["variant"] + [f"{shape} (ms)" for shape in shapes] + [f"{shape}: ÷ llmc-O2" for shape in shapes]
    rows = [[name] + [num(per[shape]["median_ms"]) for shape in shapes]
            + [num(versus.get(name, {}).get(shape)) if name != "llmc-O2" else "1" for shape in shapes]
            for name, per in latency.items()]
    return ["Median latency per call; a variant's time ÷ llmc-O2's (above 1: llmc-O2 is faster).", ""] + table(header, rows)


def render_paged_attention(result: Result) -> list[str]:
    use = result.get("utilization")
    blocks = sorted(int(key.rsplit("_", 1)[1]) for key in use if key.startswith("paged_block_"))
    lines = [f"KV slots in use ÷ allocated over {use['requests']} requests:", ""]
    lines += table(["allocation", "utilization"], [["contiguous, max length", num(use["contiguous_max_len"])]]
                   + [[f"paged, block {block}", num(use[f"paged_block_{block}"])] for block in blocks])
    rows = result.get("latency")
    names = [key[:-3] for key in rows[0] if key.endswith("_us")] if rows else []
    lines += ["", "One decode token's attention (µs, median); ratio against dense Attention over a contiguous cache:", ""]
    lines += table(["batch", "context"] + names + [f"{name} ÷ dense" for name in names if name != "dense"],
                   [[str(row["batch"]), str(row["context"])] + [num(row[f"{name}_us"]) for name in names]
                    + [ratio(row[f"{name}_us"], row["dense_us"]) for name in names if name != "dense"] for row in rows],
                   text_columns=0)
    return lines


def render_soak(result: Result) -> list[str]:
    return table(["requests", "req/s", "RSS after warm-up (MiB)", "RSS at the end (MiB)", "growth (%)", "preemptions"],
                 [[num(result.get("requests")), num(result.get("requests_per_s")), num(result.get("rss_warm_up_mib")),
                   num(result.get("rss_end_mib")), num(result.get("growth_pct")), num(result.get("preemptions"))]],
                 text_columns=0)


def render_detokenize(result: Result) -> list[str]:
    lines = []
    engine = result.get("engine", default=None) or {}
    if engine:
        names = {"new": "this tree", "old": "--old"}
        lines += table(["tree", "commit", "tokens", "Python ms/token, first 512 (mean)", "last 512 ÷ first 512 (mean)"],
                       [[names.get(side, side), f"`{run.get('commit', '-')}`", num(run.get("tokens")),
                         num(run["windows"][0]["python_ms_mean"]), num(run.get("last_over_first_mean"))]
                        for side, run in engine.items()], text_columns=2) + [""]
    for name, rows in result.get("micro").items():
        lines += [f"{name} tokenizer, per token:", ""]
        lines += table(["output length", "incremental add (µs)", "full decode (µs)", "full ÷ incremental"],
                       [[str(row["length"]), num(row["incremental_add_us"]), num(row["full_decode_us"]),
                         num(row["full_over_incremental"])] for row in rows], text_columns=0) + [""]
    return lines[:-1] if lines and lines[-1] == "" else lines


@dataclasses.dataclass(frozen=True)
class Benchmark:
    file: str  # in bench/results/
    title: str
    about: str  # what it measures, 2-4 lines
    command: str  # the command that writes `file`
    render: Callable[[Result], list[str]]


BENCHMARKS = [
    Benchmark("latency_smollm2.json", "Latency, start-up and build: llmc against onnxruntime-genai",
              "SmolLM2-135M-Instruct built by each system's own tools: batch-1 and static batch-16 decode rates,\n"
              "time to first token, load + first token, resident memory and build times, in fp32 and int4\n"
              "weight-only. Medians of the runs, 2 threads each; the two systems compared stay loaded side by side\n"
              "and measure each row in turn (the short rows three times a run, alternating), and a ratio is the\n"
              "median of those paired measurements' own ratios.",
              "python bench/latency_bench.py --model smollm2 --save-json bench/results/latency_smollm2.json",
              render_latency),
    Benchmark("latency_smollm2_no_amx.json", "Latency on a CPU without AMX: SmolLM2-135M",
              "The same rows on a Xeon that shows avx512_bf16, avx512_fp16 and VNNI but not AMX: bf16 compute\n"
              "runs on AVX-512, no faster than f32 on a prompt, so llmc's `--bf16` OpenVINO engines run steps of\n"
              "more than 8 tokens on a second model at f32, and a weight-only one computes in f32 throughout\n"
              "(docs/running.md).",
              "python bench/latency_bench.py --model smollm2 --save-json bench/results/latency_smollm2_no_amx.json",
              render_latency),
    Benchmark("latency_smollm2_amd.json", "Latency on an AMD CPU: SmolLM2-135M",
              "The same rows on an AMD EPYC with avx512_bf16 and VNNI (no AMX), whose AVX-512 computes bf16\n"
              "products at twice the f32 rate: llmc's `--bf16` OpenVINO engines run every step on one bf16 model,\n"
              "a weight-only one computes in f32 throughout (docs/running.md).",
              "python bench/latency_bench.py --model smollm2 --save-json bench/results/latency_smollm2_amd.json",
              render_latency),
    Benchmark("latency_llama_1b.json", "Latency at 1B parameters: the same rows on a larger model",
              "The same measurements on a Llama of TinyLlama-1.1B's shape (random weights, 4.4 GB in fp32) with\n"
              "2,304 positions: 32 new tokens, no profiled runs; llmc's OpenVINO engines are built with `--force`\n"
              "(a reduced precision's check runs in memory, which 4.4 GB exceed). Random weights make greedy\n"
              "output repeat, which flatters llmc's guessing: read the one-token-a-step rows.",
              "python bench/latency_bench.py --model llama-1b --save-json bench/results/latency_llama_1b.json",
              render_latency),
    Benchmark("latency_llama_1b_no_amx.json", "Latency at 1B parameters on a CPU without AMX",
              "The 1B rows above on the Xeon without AMX of the SmolLM2 section before: llmc's `--bf16` OpenVINO\n"
              "engine runs steps of more than 8 tokens on its second model at f32, its weight-only build computes\n"
              "in f32 throughout. Random weights make greedy output repeat, which flatters llmc's guessing: read\n"
              "the one-token-a-step rows.",
              "python bench/latency_bench.py --model llama-1b --save-json bench/results/latency_llama_1b_no_amx.json",
              render_latency),
    Benchmark("latency_llama_1b_amd.json", "Latency at 1B parameters on an AMD CPU",
              "The 1B rows above on the AMD EPYC of the SmolLM2 section before: llmc's `--bf16` OpenVINO engine\n"
              "runs every step on one bf16 model, its weight-only build computes in f32 throughout. Random weights\n"
              "make greedy output repeat, which flatters llmc's guessing: read the one-token-a-step rows.",
              "python bench/latency_bench.py --model llama-1b --save-json bench/results/latency_llama_1b_amd.json",
              render_latency),
    Benchmark("serving.json", "Serving throughput: llmc against onnxruntime-genai and transformers",
              "A 32M-parameter Llama (random weights) serving 64 requests at once (prompts 16-512 tokens, outputs\n"
              "16-128): llmc's continuous batching against onnxruntime-genai and transformers' `generate` in static\n"
              "batches; useful tokens a second, each system's median of 3 rounds. The systems compared run back to\n"
              "back, and a ratio is the median of the rounds' own ratios. Also the short requests' p99 TTFT with a\n"
              "3,000-token prompt in flight.",
              "python bench/serving_bench.py --save-json bench/results/serving.json", render_serving),
    Benchmark("serving_smollm2.json", "Serving throughput on SmolLM2-135M: llmc against OpenVINO GenAI",
              "The same offline workload on SmolLM2-135M-Instruct, prompts cut from real text (held-out Python\n"
              "source): llmc on onnxruntime and on its OpenVINO backend, one token a step (no speculation),\n"
              "against onnxruntime-genai in static batches and OpenVINO GenAI's continuous batching; each\n"
              "system's median of 3 rounds, the systems compared back to back, a ratio the median of the rounds'.",
              "python bench/serving_bench.py --model smollm2 --save-json bench/results/serving_smollm2.json",
              render_serving),
    Benchmark("serving_smollm2_no_amx.json", "Serving throughput on a CPU without AMX: SmolLM2-135M",
              "The same SmolLM2-135M workload on the Xeon without AMX of the latency section above.",
              "python bench/serving_bench.py --model smollm2 --save-json bench/results/serving_smollm2_no_amx.json",
              render_serving),
    Benchmark("serving_smollm2_amd.json", "Serving throughput on an AMD CPU: SmolLM2-135M",
              "The same SmolLM2-135M workload on the AMD EPYC of the latency section above.",
              "python bench/serving_bench.py --model smollm2 --save-json bench/results/serving_smollm2_amd.json",
              render_serving),
    Benchmark("serving_smollm2_amd_small_pages.json", "Serving on an AMD CPU with llmc on 4 KiB pages: SmolLM2-135M",
              "The section above again with llmc's processes on malloc's default 4 KiB pages (`LLMC_HUGE_PAGES=0`):\n"
              "the peers run as they always do, so its ratios show what the heap's huge pages cost this workload.",
              "LLMC_HUGE_PAGES=0 python bench/serving_bench.py --model smollm2 "
              "--save-json bench/results/serving_smollm2_amd_small_pages.json", render_serving),
    Benchmark("serving_llama_1b.json", "Serving throughput at 1B parameters",
              "The same on a Llama of TinyLlama-1.1B's shape (random weights, prompts of real text), 32 requests;\n"
              "each system's median of 3 rounds, a ratio the median of the rounds' (single runs move by up to 30%).",
              "python bench/serving_bench.py --model llama-1b --requests 32 "
              "--save-json bench/results/serving_llama_1b.json", render_serving),
    Benchmark("serving_llama_1b_no_amx.json", "Serving throughput at 1B parameters on a CPU without AMX",
              "The 1B workload above on the Xeon without AMX of the latency sections.",
              "python bench/serving_bench.py --model llama-1b --requests 32 "
              "--save-json bench/results/serving_llama_1b_no_amx.json", render_serving),
    Benchmark("serving_llama_1b_amd.json", "Serving throughput at 1B parameters on an AMD CPU",
              "The 1B workload above on the AMD EPYC of the latency sections, two rounds (each system's median\n"
              "is the mean of two).",
              "python bench/serving_bench.py --model llama-1b --requests 32 --rounds 2 "
              "--save-json bench/results/serving_llama_1b_amd.json", render_serving),
    Benchmark("product_command.json", "Accuracy of the product's command on a real model",
              "`llmc compile model.onnx --fp16 --int8-calib DIR` on SmolLM2-135M-Instruct for the CPU and the\n"
              "graph TensorRT would receive: perplexity increase and top-1 agreement against the fp32 export on\n"
              "~4,000 held-out tokens of real text (`llmc check`).",
              "python bench/product_command_bench.py --save-json bench/results/product_command.json",
              render_product_command),
    Benchmark("large_model.json", "A 1B-parameter checkpoint: time and peak memory of each step",
              "A Llama of TinyLlama-1.1B's shape (random weights, fp32) through llmc export, compile and\n"
              "run, torch.onnx's exporter and onnxruntime-genai's builder, each in a process of its own: wall\n"
              "time and peak resident memory against the weights' size.",
              "python bench/large_model_bench.py --save-json bench/results/large_model.json",
              render_large_model),
    Benchmark("precision_smollm2.json", "Precision: accuracy and decode speed of every precision",
              "SmolLM2-135M-Instruct compiled in each of llmc's precisions and onnxruntime.quantization's:\n"
              "perplexity and its increase over fp32 on ~4,000 tokens of real text, top-1 agreement, batch-1\n"
              "decode rate and engine size.",
              "python bench/precision_bench.py --model smollm2 --save-json bench/results/precision_smollm2.json",
              render_precision),
    Benchmark("export_paths.json", "Export: llmc's module against transformers' module",
              "`llmc export` of one Llama (8 layers, hidden 512) through llmc's own module and through\n"
              "transformers' module, with each exporter: load and export time, parity with PyTorch, and the\n"
              "nodes before and after `llmc optimize`.",
              "python bench/export_paths_bench.py --save-json bench/results/export_paths.json",
              render_export_paths),
    Benchmark("optimize.json", "Graph optimization: llmc optimize against the raw export and onnxruntime's optimizers",
              "A 32M-parameter Llama (random weights) exported once and run by onnxruntime in five forms: the raw\n"
              "export, onnxruntime's session optimizer, onnxruntime.transformers' optimizer, `llmc optimize --level\n"
              "2`, and onnxruntime-genai's builder; latency per call on prefill and decode shapes.",
              "python bench/optimize_bench.py --save-json bench/results/optimize.json", render_optimize),
    Benchmark("paged_attention.json", "Paged attention: KV memory use and attention latency",
              "KV slots in use over slots allocated for paged blocks of several sizes against contiguous\n"
              "max-length allocation, and one decode token's attention against a cached context of 128-4,096\n"
              "tokens: the CPU backend's kernel and the op's ONNX form against dense attention.",
              "python bench/paged_attention_bench.py --save-json bench/results/paged_attention.json",
              render_paged_attention),
    Benchmark("soak.json", "Soak: resident memory over 10,000 requests",
              "10,000 short requests through one Engine, 32 in flight; resident memory sampled every 500:\n"
              "after the warm-up it should stay flat, and growth is a leak per request.",
              "python bench/soak_bench.py --save-json bench/results/soak.json", render_soak),
    Benchmark("detokenize.json", "Detokenization: Python time per token over a long output",
              "One 4,096-token output through the Engine: the engine's Python time per token (the backend's\n"
              "step subtracted) in the last 512 tokens against the first, and incremental detokenization against\n"
              "decoding the whole output each token.",
              "python bench/detokenize_bench.py --old 5d1f3e5 --save-json bench/results/detokenize.json", render_detokenize),
    Benchmark("compare_commits.json", "The runtime against its base commit: serving scenarios",
              "serving_bench's llmc scenarios run on two commits in one run, rounds alternating A and B, each\n"
              "tree compiling its own engine from the same ONNX model: B's change measured against its base\n"
              "under the same machine conditions.",
              "python bench/compare_commits.py --a 5d1f3e5 --b HEAD --rounds 3 --scenarios "
              "offline,offline-32,interference --save-json bench/results/compare_commits.json",
              compare_renderer(("offline", "offline-32", "interference"))),
    Benchmark("compare_commits_decode.json", "The runtime against its base commit: decode rates",
              "latency_bench's batch-1 and static batch-16 decode rates on two commits in one run, each\n"
              "round's rate the median of 5 batches.",
              "python bench/compare_commits.py --a 5d1f3e5 --b HEAD --rounds 5 --scenarios decode-1,decode-16 "
              "--save-json bench/results/compare_commits_decode.json",
              compare_renderer(("decode-1", "decode-16"))),
]


def render_results(results_dir: Path) -> str:
    known = {bench.file for bench in BENCHMARKS}
    for path in sorted(results_dir.glob("*.json")):
        if path.name not in known:
            raise ResultsError(f"{path}: no section renders this file (bench/results.py's BENCHMARKS names "
                               f"{', '.join(sorted(known))})")
    lines = ["# Benchmark results", "",
             f"Generated by `python bench/results.py` from the JSON files in bench/results/, one per benchmark; "
             "each section gives the command that wrote its file, the machine and its load, and the commit. "
             "Ratios compare systems measured in the same run.", ""]
    for bench in BENCHMARKS:
        lines += [f"## {bench.title}", "", *bench.about.splitlines(), ""]
        path = results_dir / bench.file
        if not path.is_file():
            lines += ["```bash", bench.command, "```", "", NOT_RUN, ""]
            continue
        result = load(path)
        try:
            lines += provenance(result) + bench.render(result) + [""]
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            # a field read inside a table's rows: the file's structure, not this script, is at fault
            raise ResultsError(f"{path}: missing or malformed field ({type(exc).__name__}: {exc})") from None
    return "\n".join(lines).rstrip() + "\n"


# --- README's headline table -----------------------------------------------------------------


HEADLINE_COLUMNS = ["measure", "llmc", "onnxruntime-genai", "OpenVINO GenAI", "transformers", "llmc ÷ peer"]


def headline(results_dir: Path) -> list[list[str]]:
    """Rows of HEADLINE_COLUMNS present in the files; a row's peer is the one it has a figure for."""
    rows = []

    def add(measure: str, llmc: Any, genai: Any = None, transformers: Any = None, ratio_: Any = None,
            openvino: Any = None) -> None:
        """ratio_: the benchmark's own llmc ÷ peer (onnxruntime-genai, or OpenVINO GenAI where
        `openvino` is given), where it computed one."""
        peer = openvino if openvino is not None else genai
        if llmc is not None:
            rows.append([measure, num(llmc), num(genai), num(openvino), num(transformers),
                         stored_ratio(ratio_) if ratio_ is not None else ratio(llmc, peer)])

    path = results_dir / "latency_smollm2.json"
    if path.is_file():
        result = load(path)
        entries = {(row["key"], row["precision"]): row for row in result.get("table")}
        sizes = result.get("sizes")
        # Batch 1 on real chat prompts: random prompts make a model repeat itself, which flatters
        # llmc's guessing of tokens from the sequence's own text.
        for key, label in (("text_decode_tok_s", "Decode, batch 1, SmolLM2 fp32, real text (tok/s)"),
                           ("batch_decode_tok_s", f"Decode, batch {sizes['batch']}, SmolLM2 fp32 (tok/s)"),
                           ("ttft_long_ms", f"Time to first token, {sizes['long_prompt']:,}-token prompt, SmolLM2 (ms)"),
                           ("load_first_token_s", "Start-up: load + first token, SmolLM2 (s)")):
            row = entries.get((key, "fp32"))
            if row:
                add(label, row.get("llmc"), row.get("genai"), ratio_=row.get("ratio"))
        # The OpenVINO backend in bf16 against the fastest CPU peer with its defaults (bf16 compute
        # where the CPU has it), one token a step on both sides.
        for key, precision, label in (
                ("plain_decode_tok_s", "fp32", "Decode, batch 1, one token a step, SmolLM2 bf16, `--backend openvino` "
                                               "(tok/s)"),
                ("plain_decode_tok_s", "int4", "Decode, batch 1, one token a step, SmolLM2 int4 bf16, "
                                               "`--backend openvino` (tok/s)"),
                ("batch_decode_tok_s", "fp32", f"Decode, batch {sizes['batch']}, SmolLM2 bf16, `--backend openvino` "
                                               "(tok/s)"),
                ("ttft_long_ms", "fp32", f"Time to first token, {sizes['long_prompt']:,}-token prompt, SmolLM2 bf16, "
                                         "`--backend openvino` (ms)")):
            row = entries.get((key, precision))
            if row and row.get("llmc-openvino") is not None:
                add(label, row["llmc-openvino"], ratio_=row.get("ratio_llmc-openvino"), openvino=row.get("openvino"))
    path = results_dir / "serving.json"
    if path.is_file():
        systems = load(path).get("systems")
        add("Serving throughput, 64 requests, 32M Llama (tok/s)", systems.get("llmc", {}).get("throughput_tok_s"),
            systems.get("genai", {}).get("throughput_tok_s"), systems.get("hf-static", {}).get("throughput_tok_s"))
    path = results_dir / "product_command.json"
    if path.is_file():
        cpu = [row for row in load(path).get("rows") if row.get("row") == "cpu"]
        if cpu:
            add("Perplexity increase, `llmc compile --fp16 --int8-calib`, SmolLM2 (%)", cpu[0].get("ppl_increase_pct"))
    return rows


def render_readme_block(results_dir: Path) -> str:
    rows = headline(results_dir)
    if not rows:
        body = ["No benchmark results recorded yet: see [bench/RESULTS.md](bench/RESULTS.md)."]
    else:
        body = table(HEADLINE_COLUMNS, rows)
        body += ["", "On a CPU with 2 threads per system; commands, machine and commit in "
                     "[bench/RESULTS.md](bench/RESULTS.md)."]
    return "\n".join([BEGIN, *body, END])


def splice_readme(text: str, block: str, readme: Path) -> str | None:
    """`text` with the block between the markers replaced, or None when the markers are absent."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < 0:
        return None
    if end < begin:
        raise ResultsError(f"{readme}: {END!r} comes before {BEGIN!r}")
    return text[:begin] + block + text[end + len(END):]


def write_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when RESULTS.md or the README block differ from what the JSON files give")
    parser.add_argument("--results-dir", type=Path, default=BENCH_DIR / "results")
    parser.add_argument("--output", type=Path, default=BENCH_DIR / "RESULTS.md")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = parser.parse_args(argv)
    try:
        results = render_results(args.results_dir)
        block = render_readme_block(args.results_dir)
        readme_text = args.readme.read_text() if args.readme.is_file() else ""
        readme = splice_readme(readme_text, block, args.readme)
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if readme is None:
        print(f"{args.readme}: no {BEGIN} ... {END} block; its results table is skipped", file=sys.stderr)
    stale = []
    if not args.output.is_file() or args.output.read_text() != results:
        stale.append(str(args.output))
    if readme is not None and readme != readme_text:
        stale.append(f"{args.readme} (the block between {BEGIN} and {END})")
    if args.check:
        for what in stale:
            print(f"{what} differs from what bench/results/*.json give: run python bench/results.py",
                  file=sys.stderr)
        return 1 if stale else 0
    if str(args.output) in stale:
        write_atomic(args.output, results)
    if readme is not None and readme != readme_text:
        write_atomic(args.readme, readme)
    for what in stale:
        print(f"wrote {what}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
