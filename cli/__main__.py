"""`python -m llmc.cli`: the `llmc` command."""

from llmc.cli import entry

entry()
