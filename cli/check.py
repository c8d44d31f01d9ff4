"""`llmc check`: an engine's accuracy against a reference model (precision/check.py)."""

import json
import sys

import click

from llmc.cli.common import existing, main, progress, share_threads


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

    share_threads(threads)
    engine = LLM(existing(engine_path), threads)
    report = run_check(engine, ReferenceModel(existing(reference), threads), data, window=window,
                       max_tokens=max_tokens, generate=generate, progress=progress)
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
