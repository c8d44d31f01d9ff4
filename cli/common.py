"""The `llmc` group, its error policy, and what several commands share (option groups, progress)."""

from __future__ import annotations

import errno
import functools
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

import click
from click.core import ParameterSource

from llmc.errors import LlmcError, first_line, missing_extra


class _Group(click.Group):
    """Applies the error policy: a user's mistake is one line and exit 2, anything else is a bug.

    LlmcError, and an OSError about a path (missing, unreadable, a folder where a file belongs)
    or the disk (full, read-only), print `llmc: error: <message>` and exit 2. Any other exception
    is a bug: one `llmc: internal error:` line and exit 1, with the traceback under --debug or
    LLMC_DEBUG=1, except an optional dependency that is not installed: one line naming the extra
    that installs it (errors.EXTRA_MODULES), exit 2. Ctrl-C exits 130; a closed output pipe exits
    141 without a word. click's own usage errors pass through (exit 2).
    """

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except LlmcError as exc:
            fail(f"llmc: error: {first_line(exc, 1000)}", 2)
        except ModuleNotFoundError as exc:
            message = missing_extra(exc, ctx.invoked_subcommand)
            if message is None:
                _internal_error(exc, ctx)
            fail(f"llmc: error: {message}", 2)
        except KeyboardInterrupt:
            fail("llmc: interrupted", 130)
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # the reader went away (`llmc run ... | head`): stop quietly
                _silence_stdout()
                sys.exit(128 + 13)  # as if killed by SIGPIPE, which Python ignores
            if not _is_users_os_error(exc):
                _internal_error(exc, ctx)
            where = f"{exc.filename}: " if exc.filename else ""
            reason = exc.strerror or first_line(exc)
            fail(f"llmc: error: {where}{reason[:1].lower()}{reason[1:]}", 2)
        except Exception as exc:
            _internal_error(exc, ctx)


# The disk, not the program: full, over quota, read-only, or a file past the size limit.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


def _is_users_os_error(exc: OSError) -> bool:
    """An OSError about a path the user gave, or about the disk: not a bug in llmc."""
    about_path = isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError))
    return (about_path and exc.filename is not None) or exc.errno in _ENVIRONMENT_ERRNOS


def _internal_error(exc: Exception, ctx: click.Context) -> None:
    text = str(exc).strip()
    what = type(exc).__name__ + (f": {text.splitlines()[0][:300]}" if text else "")
    if ctx.params.get("debug"):
        click.echo("".join(traceback.format_exception(exc)).rstrip(), err=True)
        fail(f"llmc: internal error: {what} (this is a bug; the traceback is above)", 1)
    fail(f"llmc: internal error: {what} (this is a bug; rerun with --debug for the traceback)", 1)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush does not fail on the closed pipe."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass  # not a real file (e.g. click's test runner)


def fail(line: str, status: int) -> None:
    """Print one line on stderr and exit with `status`."""
    click.echo(line, err=True)
    sys.exit(status)


def progress(message: str) -> None:
    """A long stage's progress line, on stderr."""
    click.echo(f"llmc: {message}", err=True)


@click.group(cls=_Group)
@click.version_option(package_name="llmc")
@click.option("--debug", is_flag=True, envvar="LLMC_DEBUG",
              help="On an internal error, print the traceback (also LLMC_DEBUG=1).")
def main(debug):
    """Compile decoder language models into engines and run them."""


# Set by `entry` (the `llmc` command, `python -m llmc.cli`): the process is llmc's own, so its
# sessions may share one spinning thread pool (formats/sessions.py), which onnxruntime makes
# process-wide. Not when a test or a host program calls `main` in a process of its own.
_owns_process = False


# The commands that keep an engine loaded to serve or measure it: their process starts again with
# malloc's heap on huge pages (runtime/huge_pages.py) before doing anything. Not `run` or `check`,
# which load one for a single job: a 1B fp32 engine took 17.7-21.2 s to load and give a first
# token on huge pages, against 6.6-14.7 s.
ENGINE_COMMANDS = ("bench", "profile", "serve")


def entry() -> None:
    """The `llmc` command."""
    global _owns_process
    _owns_process = True
    if _command(sys.argv[1:]) in ENGINE_COMMANDS:
        from llmc.runtime.huge_pages import restart_with_huge_pages

        restart_with_huge_pages()
    main()


def _command(args: list[str]) -> str | None:
    """The command `args` name: the first word that is not an option (the group's are flags)."""
    return next((arg for arg in args if not arg.startswith("-")), None)


def share_threads(threads: int | None) -> None:
    """In llmc's own process, let every onnxruntime session share one pool of `threads`."""
    if _owns_process:
        from llmc.formats.sessions import share_threads as share

        share(threads)


def existing(path: str) -> str:
    if not Path(path).is_file():
        raise LlmcError(f"{path}: no such file")
    return path


def given_options() -> set[str]:
    """The current command's parameters given on the command line (not left at their defaults)."""
    ctx = click.get_current_context()
    return {name for name in ctx.params if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE}


def flag(name: str) -> str:
    """The current command's long option for parameter `name` (`optimization_level` →
    `--builder-optimization-level`)."""
    for param in click.get_current_context().command.params:
        if param.name == name:
            return max(param.opts, key=len)
    raise KeyError(name)


def option_group(keyword: str, build: Callable[..., Any], *options: Callable) -> Callable:
    """Declare `options` on a command and hand it their values as one typed object,
    `build(**values)`, under `keyword`; the options keep their order in --help."""

    def decorate(command: Callable) -> Callable:
        @functools.wraps(command)  # shares the command's __click_params__ list
        def grouped(**params):
            values = {name: params.pop(name) for name in names}
            return command(**params, **{keyword: build(**values)})

        declared = grouped.__dict__.setdefault("__click_params__", [])
        before = len(declared)
        for option in reversed(options):  # click reverses what decorators append
            option(grouped)
        names = [param.name for param in declared[before:]]
        return grouped

    return decorate


def pipeline_options(command):
    """--level, --passes and --verify, shared by optimize and compile."""
    command = click.option("--verify", is_flag=True,
                           help="Check the graph and compare outputs with the original after every pass.")(command)
    command = click.option("--passes", help="Comma-separated pass names to run instead of a level.")(command)
    return click.option("--level", default=None, help="Optimization level: 0, 1, 2 (default) or 3.")(command)


def pass_names(passes: str | None) -> list[str] | None:
    return None if passes is None else [p.strip() for p in passes.split(",") if p.strip()]


# run, serve and bench: the engine's prompt-lookup guesses per step (`Engine`'s speculative_tokens).
speculative_tokens_option = click.option(
    "--speculative-tokens", type=int, default=None,
    help="Tokens a step may guess ahead for a greedy request, from its own text (prompt lookup; beside other "
    "requests only guesses likely to be kept; greedy outputs unchanged). 0 turns it off. Default: 4 for an engine whose "
    "linear layers compute in fp32, else 0 (on int4/int8 weight-only ones a guess costs about a third of a step).")


def prompts_from(prompts: Iterable[str], prompts_file: str | None) -> list[str]:
    """The prompts given as options, then those of a prompt file, each checked (precision/data.py)."""
    from llmc.precision.data import check_prompt, read_prompts

    found = list(prompts) + (read_prompts(prompts_file) if prompts_file else [])
    for index, prompt in enumerate(found):
        check_prompt(prompt, index)
    return found
