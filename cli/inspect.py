"""`llmc inspect`: what is inside an engine file or an ONNX model (llmc.inspect)."""

import json
import sys

import click

from llmc.cli.common import main


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print as JSON; for an engine, with \"deploy\": whether it "
              "runs on this machine (exit 2 if not).")
def inspect(path, as_json):
    """Show what is inside an engine file or an ONNX model."""
    from llmc.inspection import inspect as inspect_file

    report = inspect_file(path, deploy=as_json)
    if not as_json:
        click.echo(report.text())
        return
    click.echo(json.dumps(report.to_dict(), indent=2))
    if getattr(report, "runs_here", True) is False:
        sys.exit(2)
