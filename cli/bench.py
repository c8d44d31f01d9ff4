"""`llmc bench`: a synthetic workload through an engine or a server (runtime/bench.py)."""

import json
import sys
from pathlib import Path

import click

from llmc.cli.common import existing, main, progress, prompts_from, share_threads, speculative_tokens_option
from llmc.errors import LlmcError


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
@click.option("--api-key", envvar="LLMC_API_KEY", show_envvar=True,
              help="With --url: the server's API key (sent as Authorization: Bearer KEY).")
@click.option("--profile", is_flag=True,
              help="Then run the workload again with the profiler on and add where its time went, per step kind "
                   "(as `llmc profile`; under \"profile\" with --json).")
@speculative_tokens_option
def bench(engine_path, requests, prompt_len, prompt_len_max, output_len, output_len_max, prompts_file, rate, batch,
          seed, max_num_seqs, max_num_batched_tokens, threads, as_json, plot, url, model, api_key, profile,
          speculative_tokens):
    """Serve a synthetic workload with ENGINE (or the server at --url) and report throughput and latency."""
    from llmc.runtime import bench as serving

    if batch is not None and batch < 1:
        raise LlmcError(f"--batch: must be ≥ 1, got {batch}")
    if batch is not None and rate is not None:
        raise LlmcError("--batch and --rate: choose one (--batch adds requests as others finish)")
    if speculative_tokens is not None and url is not None:
        raise LlmcError("--speculative-tokens: not with --url (the server's own option: llmc serve --speculative-tokens)")
    if profile and url is not None:
        raise LlmcError("--profile: not with --url (the server's engine runs in another process: "
                        "llmc profile ENGINE, or llmc bench ENGINE --profile here)")

    prompts = prompts_from((), prompts_file) if prompts_file else None
    if requests is None:
        requests = len(prompts) if prompts else 64
    spec = serving.WorkloadSpec(requests=requests, prompt_len=prompt_len, prompt_len_max=prompt_len_max,
                                output_len=output_len, output_len_max=output_len_max, rate=rate, seed=seed)
    if url is not None:
        _bench_url(url, model, api_key, existing(engine_path), spec, prompts, batch, as_json, plot, max_num_seqs,
                   max_num_batched_tokens)
        return
    if model is not None:
        raise LlmcError("--model: only with --url")
    if plot:
        serving.require_matplotlib()
    share_threads(threads)
    options = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens, "threads": threads,
               "concurrent": batch != 1, "speculative_tokens": speculative_tokens}
    engine, workload = serving.prepare(existing(engine_path), spec, prompts=prompts, **options)
    tokens = sum(r.output_len for r in workload)
    with click.progressbar(length=tokens, label="llmc bench", file=sys.stderr) as bar:
        result = serving.run_workload(engine, workload, progress=bar.update, concurrency=batch)
    summary = serving.summarize(result)
    breakdown = None
    if profile:
        del engine  # its pool and sessions: the profiled run loads its own
        with click.progressbar(length=tokens, label="llmc bench --profile", file=sys.stderr) as bar:
            breakdown = serving.profile_workload(engine_path, workload, concurrency=batch, progress=bar.update,
                                                 **options)
    if as_json:
        click.echo(json.dumps(summary if breakdown is None else {**summary, "profile": breakdown}))
    else:
        click.echo(serving.render(summary))
        if breakdown is not None:
            from llmc.runtime.profile import render_breakdown

            click.echo("\nwhere the time went (the workload again, under the profiler: read shares, not speeds)")
            click.echo(render_breakdown(breakdown))
    if plot:
        serving.plot(result, plot, title=f"llmc bench {Path(engine_path).name}: {summary['requests']} requests")
        progress(f"wrote {plot}")


def _bench_url(url, model, api_key, engine_path, spec, prompts, batch, as_json, plot, max_num_seqs,
               max_num_batched_tokens):
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
        result = run_http_workload(url, model, workload, progress=bar.update, concurrency=batch, api_key=api_key)
    summary = serving.summarize(result)
    click.echo(json.dumps(summary) if as_json else serving.render(summary))
