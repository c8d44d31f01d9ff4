"""The one exception type users see, and the policy for everything else.

`LlmcError` means bad input: a file, graph, option or request llmc cannot use. Its message
names the file, node or option at fault first, e.g.
``model.onnx: not a decoder with past: no input 'past_key_values.0.key'``. The CLI prints it as
``llmc: error: <message>`` and exits 2 (so does an OSError about a path the user gave or about
the disk: missing, unreadable, full). Every other exception is a bug: the CLI prints one
``llmc: internal error: ...`` line, exits 1, and shows the traceback under ``--debug`` or
``LLMC_DEBUG=1``.

`LlmcError` still subclasses `ValueError`: library callers that catch ValueError around
`LLM(...)`, `load_model` or `compile_model` keep working. The subclass does not blur the
policy, because the CLI catches `LlmcError` itself, never ValueError: a ValueError raised deep
inside NumPy, ONNX or our own code is reported as the bug it is. Code that re-wraps an error to
add a file name catches `LlmcError`, not ValueError, for the same reason.
"""


class LlmcError(ValueError):
    """Bad input: a file, graph, option or request that llmc cannot use."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message cut to one line, for one-line errors wrapping a library's own."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:limit]


# The optional dependencies: each extra of pyproject.toml and the top-level modules it installs
# that llmc imports. `pip install llmc` holds only what running an engine needs.
EXTRA_MODULES = {
    "compile": {"onnx"},
    "export": {"onnx", "torch", "onnxscript", "onnx_ir", "safetensors", "transformers"},
    "serve": {"starlette", "uvicorn", "prometheus_client", "jinja2"},
    "ray": {"ray"},
    "openvino": {"openvino"},
    "tensorrt": {"tensorrt", "polygraphy"},
    "gpu": {"triton"},
    "bench": {"httpx", "matplotlib", "onnxruntime_genai"},
}


def missing_extra(exc: ModuleNotFoundError, command: str) -> str | None:
    """The one-line message for an optional dependency that is not installed, naming the extra
    that installs it: the command's own (`llmc export` needs llmc[export]) when that has it, else
    the first that does; None when the module is not one of llmc's optional ones (a bug)."""
    module = (exc.name or "").split(".")[0]
    extras = [e for e, modules in EXTRA_MODULES.items() if module in modules]
    if not extras:
        return None
    extra = command if command in extras else extras[0]
    return f"llmc {command} needs {module}, which is not installed: pip install 'llmc[{extra}]'"
