import onnx
import pytest

from llmc.compiler.pipeline import optimize


@pytest.fixture(scope="module")
def level2(tiny_llama_onnx):
    """tiny-llama's optimized (level-2) graph: fused attention, merged q/k/v and gate/up. Tests copy it."""
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    return model
