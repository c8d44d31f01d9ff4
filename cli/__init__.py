"""The `llmc` command line: one module per command, each parsing its options and calling the
public Python API (llmc/__init__.py); common.py holds the group and its error policy."""

from llmc.cli.common import entry, main
from llmc.cli import (bench, check, compile, export, inspect, optimize, profile, run,  # noqa: F401 (registers)
                      sensitivity, serve)

__all__ = ["entry", "main"]
