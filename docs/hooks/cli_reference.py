"""mkdocs hook: the CLI reference page rendered from click's own help at build time.

docs/cli.md holds a marker line; on each build it is replaced by `llmc --help` and every
command's `--help`, taken from the click group in llmc.cli, so the page cannot drift from the
options the commands accept. A page without the marker fails the build (the reference would
silently vanish otherwise).
"""

from __future__ import annotations

import click
from mkdocs.exceptions import PluginError

MARKER = "<!-- cli-reference -->"
PAGE = "cli.md"
# Fixed width: click wraps help to the terminal, and the page must not depend on who builds it.
WIDTH = 100


def render() -> str:
    """Markdown for `llmc --help` and each command's `--help`, one section per command."""
    from llmc.cli import main

    group_ctx = click.Context(main, info_name="llmc", terminal_width=WIDTH, max_content_width=WIDTH)
    parts = ["## llmc", "", "```text", main.get_help(group_ctx), "```", ""]
    for name in sorted(main.commands):
        command = main.commands[name]
        ctx = click.Context(command, info_name=name, parent=group_ctx, terminal_width=WIDTH,
                            max_content_width=WIDTH)
        parts += [f"## llmc {name}", "", "```text", command.get_help(ctx), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"docs/{PAGE}: the marker {MARKER} is missing; the CLI reference has nowhere to go")
    return markdown.replace(MARKER, render())
