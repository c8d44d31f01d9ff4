"""`llmc export`: a model to ONNX (llmc.export)."""

import click

from llmc.cli.common import main, progress


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

    check = export_model(model, output, check=not no_check, exporter=exporter, progress=progress)
    click.echo(f"wrote {output}")
    if check is not None:
        click.echo(f"parity vs PyTorch: max abs diff {check.max_abs:.2e} (prefill logits "
                   f"{check.prefill_logits:.2e}, decode logits {check.decode_logits:.2e}, "
                   f"present {max(check.prefill_present, check.decode_present):.2e})")
