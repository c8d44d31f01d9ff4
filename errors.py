"""The one exception type users see.

`LlmcError` subclasses `ValueError` so that library callers can catch either; the CLI prints
its message as one line and exits with status 2. Messages name the file, node or option at
fault first, e.g. ``model.onnx: not a decoder with past: no input 'past_key_values.0.key'``.
"""


class LlmcError(ValueError):
    """Bad input: a file, graph, option or request that llmc cannot use."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message cut to one line, for one-line errors wrapping a library's own."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:limit]
