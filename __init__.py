"""llmc: compile decoder language models into inference engines and run them.

    llmc.export("tiny-llama", "model.onnx")
    llmc.compile("model.onnx", "engine.plan", precision=llmc.PrecisionOptions(weights="int4", calib="data/"))
    llmc.inspect("engine.plan").text()
    llmc.LLM("engine.plan").generate(["def fibonacci("], llmc.SamplingParams(max_new_tokens=32))

Every `llmc` command calls these: `llmc optimize` is `llmc.optimize`, `llmc sensitivity` is
`llmc.sensitivity`, `llmc check` is `llmc.check` beside an `llmc.LLM`.

Names are imported on first use, so `import llmc` stays fast and torch loads only for export.
"""

import os

__version__ = "0.1.0"

# The CPU attention kernel's OpenMP threads must sleep as soon as it returns: left spinning
# (libgomp's default) they hold the cores while the onnxruntime segment after it runs (measured on
# the serving benchmark: 5.8 s instead of 7.2 s). Set at package import because libgomp reads it
# once, when it loads, and the kernel may run on torch's copy, which loads with torch: a process
# that imports torch before llmc keeps torch's spinning threads unless it sets this itself.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_PUBLIC = {
    "export": ("llmc.compiler.export", "export"),
    "optimize": ("llmc.compiler.pipeline", "optimize_file"),
    "compile": ("llmc.compiler.build", "compile_model"),
    "CompileResult": ("llmc.compiler.build", "CompileResult"),
    "PagedOptions": ("llmc.compiler.paged_engine", "PagedOptions"),
    "PrecisionOptions": ("llmc.precision.plan", "PrecisionOptions"),
    "TensorRTOptions": ("llmc.compiler.tensorrt_network", "TensorRTOptions"),
    "inspect": ("llmc.inspection", "inspect"),
    "sensitivity": ("llmc.compiler.sensitivity", "sensitivity"),
    "check": ("llmc.precision.check", "check"),
    "ReferenceModel": ("llmc.precision.check", "ReferenceModel"),
    "LLM": ("llmc.llm", "LLM"),
    "Engine": ("llmc.runtime.engine", "Engine"),
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
