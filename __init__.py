"""llmc: compile decoder language models into inference engines and run them.

    llmc.export("tiny-llama", "model.onnx")
    llmc.compile("model.onnx", "engine.plan")
    llmc.LLM("engine.plan").generate(["def fibonacci("], llmc.SamplingParams(max_new_tokens=32))

Names are imported on first use, so `import llmc` stays fast and torch loads only for export.
"""

__version__ = "0.1.0"

_PUBLIC = {
    "export": ("llmc.compiler.export", "export"),
    "compile": ("llmc.compiler.build", "compile_model"),
    "LLM": ("llmc.llm", "LLM"),
    "Completion": ("llmc.llm", "Completion"),
    "SamplingParams": ("llmc.runtime.sampling_params", "SamplingParams"),
    "LlmcError": ("llmc.errors", "LlmcError"),
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'llmc' has no attribute {name!r}")
    import importlib

    module, attribute = _PUBLIC[name]
    return getattr(importlib.import_module(module), attribute)
