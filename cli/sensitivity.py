"""`llmc sensitivity`: rank linear layers by quantization error (compiler/sensitivity.py)."""

import json

import click

from llmc.cli.common import main, progress


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
    from llmc.compiler.sensitivity import sensitivity as rank_layers

    result = rank_layers(onnx_file, int8_calib, data=data, target=target, calibrator=calibrator,
                         tokens=tokens, budget_pct=accuracy_budget, exhaustive=exhaustive, output=output,
                         progress=progress)
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
