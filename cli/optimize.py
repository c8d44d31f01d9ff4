"""`llmc optimize`: graph passes over an ONNX file (llmc.optimize)."""

import click

from llmc.cli.common import main, pass_names, pipeline_options, progress


@main.command()
@click.argument("onnx_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="ONNX file to write.")
@pipeline_options
@click.option("--report", type=click.Path(dir_okay=False), help="Write the per-pass report as JSON.")
def optimize(onnx_file, output, level, passes, verify, report):
    """Run graph optimization passes over ONNX_FILE."""
    from llmc.compiler.pipeline import optimize_file

    entries = optimize_file(onnx_file, output, level=level, passes=pass_names(passes), verify=verify,
                            report=report, progress=progress)
    before = entries[0]["nodes_before"] if entries else "?"
    after = entries[-1]["nodes_after"] if entries else "?"
    click.echo(f"wrote {output}: {before} → {after} nodes")
