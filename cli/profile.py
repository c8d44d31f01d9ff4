"""`llmc profile`: where an engine's time goes, per step kind and per operator (runtime/profile.py)."""

import json
import sys
from pathlib import Path

import click

from llmc.cli.common import existing, main, progress, share_threads, speculative_tokens_option
from llmc.errors import LlmcError


@main.command()
@click.argument("engine_path", metavar="ENGINE", type=click.Path(dir_okay=False))
@click.option("--batch", default=8, show_default=True, type=int,
              help="Requests decoded together after the one alone (1: only the one).")
@click.option("--prompt-len", default=128, show_default=True, type=int, help="Prompt tokens per request.")
@click.option("--new-tokens", default=32, show_default=True, type=int, help="Tokens each request generates.")
@click.option("--text", type=click.Path(dir_okay=False),
              help="UTF-8 text to cut the prompts from (default: Python standard library source shipped with llmc).")
@click.option("--trace", type=click.Path(dir_okay=False),
              help="Also write a Chrome/Perfetto trace (JSON; open in ui.perfetto.dev or chrome://tracing).")
@click.option("--no-bounds", is_flag=True, help="Skip measuring the machine's memory bandwidth and peak (~2 s).")
@click.option("--threads", default=None, type=int, help="CPU threads (default: every core).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@speculative_tokens_option
def profile(engine_path, batch, prompt_len, new_tokens, text, trace, no_bounds, threads, as_json, speculative_tokens):
    """Run a short workload of real text through ENGINE and report where each kind of step spends its time."""
    from llmc.formats.onnx_io import write_text_atomic
    from llmc.runtime.profile import ProfileSpec, profile_engine, render, trace_events

    spec = ProfileSpec(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
    if text is not None:
        existing(text)
    if trace is not None and not Path(trace).resolve().parent.is_dir():
        raise LlmcError(f"--trace {trace}: folder {Path(trace).resolve().parent} does not exist")
    if threads is not None and threads < 1:
        raise LlmcError(f"--threads: must be ≥ 1, got {threads}")
    share_threads(threads)
    with click.progressbar(length=new_tokens * (1 + (batch if batch > 1 else 0)), label="llmc profile",
                           file=sys.stderr) as bar:
        report, timeline, start, end = profile_engine(existing(engine_path), spec, text=text, threads=threads,
                                                      speculative_tokens=speculative_tokens, bounds=not no_bounds,
                                                      progress=bar.update)
    if trace is not None:
        write_text_atomic(trace, json.dumps(trace_events(timeline, start, end)))
        progress(f"wrote {trace}")
    click.echo(json.dumps(report) if as_json else render(report))
