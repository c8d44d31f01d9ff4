"""The CLI's error policy: a user's mistake is one line and exit 2; anything else is a bug, exit 1.

Each case makes `llmc inspect` fail inside the function it calls (onnx_summary.summarize), so no
model is needed; one subprocess test checks the same lines and statuses from a real process.
"""

import errno
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import llmc.compiler.onnx_summary as onnx_summary
from llmc.cli import main
from llmc.errors import LlmcError

BUG_HINT = "(this is a bug; rerun with --debug for the traceback)"


@pytest.fixture
def inspect_failing(tmp_path, monkeypatch):
    """Runs `llmc [options] inspect model.onnx` with summarize raising what `fault` raises."""
    path = tmp_path / "model.onnx"
    path.write_bytes(b"not an engine file")

    def invoke(fault, *options, env=None):
        def broken(_path):
            raise fault() if callable(fault) and not isinstance(fault, BaseException) else fault

        monkeypatch.setattr(onnx_summary, "summarize", broken)
        return CliRunner().invoke(main, [*options, "inspect", str(path)], env=env)

    return invoke


def numpy_value_error():
    """A ValueError raised by NumPy itself, as a bug in our array code would raise it."""
    try:
        np.zeros(3).reshape(2)
    except ValueError as exc:
        return exc
    raise AssertionError("NumPy accepted a bad reshape")


def test_llmc_error_is_one_line_exit_2(inspect_failing):
    result = inspect_failing(LlmcError("model.onnx: not a decoder\nsecond line never shown"))
    assert result.exit_code == 2
    assert result.stderr == "llmc: error: model.onnx: not a decoder\n"


@pytest.mark.parametrize("error,message", [
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/m.onnx"),
     "/data/m.onnx: no such file or directory"),
    (PermissionError(errno.EACCES, "Permission denied", "/data/m.onnx"), "/data/m.onnx: permission denied"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/data"), "/data: is a directory"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/data/m.onnx/x"), "/data/m.onnx/x: not a directory"),
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
    (OSError(errno.EROFS, "Read-only file system", "/mnt/e.plan"), "/mnt/e.plan: read-only file system"),
])
def test_os_error_about_a_path_or_the_disk_is_one_line_exit_2(inspect_failing, error, message):
    result = inspect_failing(error)
    assert result.exit_code == 2
    assert result.stderr == f"llmc: error: {message}\n"


@pytest.mark.parametrize("fault,line", [
    (ZeroDivisionError("division by zero"), "ZeroDivisionError: division by zero"),
    (numpy_value_error(), "ValueError: cannot reshape array of size 3 into shape (2,)"),
    (KeyError("input_ids"), "KeyError: 'input_ids'"),
    (AssertionError(), "AssertionError"),
    # An OSError that names no path is the program's business (a bad descriptor, a pipe), not the user's.
    (OSError(errno.EBADF, "Bad file descriptor"), "OSError: [Errno 9] Bad file descriptor"),
    (FileNotFoundError("libfoo.so"), "FileNotFoundError: libfoo.so"),
])
def test_anything_else_is_an_internal_error_exit_1(inspect_failing, fault, line):
    result = inspect_failing(fault)
    assert result.exit_code == 1
    assert result.stderr == f"llmc: internal error: {line} {BUG_HINT}\n"


@pytest.mark.parametrize("options,env", [(["--debug"], None), ([], {"LLMC_DEBUG": "1"})])
def test_debug_prints_the_traceback(inspect_failing, options, env):
    result = inspect_failing(ZeroDivisionError("division by zero"), *options, env=env)
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "in broken" in result.stderr and "ZeroDivisionError: division by zero" in lines[-2]
    assert lines[-1] == ("llmc: internal error: ZeroDivisionError: division by zero "
                         "(this is a bug; the traceback is above)")


def test_debug_does_not_change_user_errors(inspect_failing):
    result = inspect_failing(LlmcError("model.onnx: bad"), "--debug")
    assert result.exit_code == 2 and result.stderr == "llmc: error: model.onnx: bad\n"


def test_llmc_debug_0_keeps_the_traceback_hidden(inspect_failing):
    result = inspect_failing(ZeroDivisionError("x"), env={"LLMC_DEBUG": "0"})
    assert result.exit_code == 1 and "Traceback" not in result.stderr


def test_keyboard_interrupt_exits_130(inspect_failing):
    result = inspect_failing(KeyboardInterrupt)
    assert result.exit_code == 130 and result.stderr == "llmc: interrupted\n"


def test_click_usage_errors_keep_clicks_behaviour(tmp_path):
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "x"), "--no-such-option"])
    assert result.exit_code == 2 and "No such option '--no-such-option'" in result.stderr


def test_llmc_error_is_still_a_value_error():
    # Library callers may catch ValueError; the CLI catches LlmcError itself (errors.py explains).
    assert issubclass(LlmcError, ValueError)


DRIVER = """
import sys
import llmc.compiler.onnx_summary as onnx_summary
from llmc.cli import main

def broken(path):
    return 1 / 0

onnx_summary.summarize = broken
main(sys.argv[1:])
"""


@pytest.mark.parametrize("debug", [False, True])
def test_a_real_process_reports_a_bug_with_status_1(tmp_path, debug):
    (tmp_path / "model.onnx").write_bytes(b"not an engine file")
    done = subprocess.run([sys.executable, "-c", DRIVER, *(["--debug"] if debug else []), "inspect",
                           str(tmp_path / "model.onnx")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert ("Traceback (most recent call last):" in done.stderr) is debug
    last = done.stderr.splitlines()[-1]
    assert last.startswith("llmc: internal error: ZeroDivisionError: division by zero (this is a bug;")
    assert debug or done.stderr.count("\n") == 1


def test_a_closed_output_pipe_ends_quietly(inspect_failing):
    result = inspect_failing(BrokenPipeError(errno.EPIPE, "Broken pipe"))
    assert result.exit_code == 141 and result.stderr == ""


PRINTER = """
import sys
import llmc.compiler.onnx_summary as onnx_summary
from llmc.cli import main

def summarize(path):  # a summary far longer than a pipe's buffer
    return {"opsets": {"": 21}, "nodes": 1, "parameters": 1, "bytes": 1, "inputs": [], "outputs": [],
            "ops": {f"Op{i}": 1 for i in range(100_000)}}

onnx_summary.summarize = summarize
main(sys.argv[1:])
"""


def test_a_real_reader_that_goes_away(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"not an engine file")
    process = subprocess.Popen([sys.executable, "-c", PRINTER, "inspect", str(tmp_path / "model.onnx")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # `llmc inspect ... | head -0`
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 141 and stderr == b""
