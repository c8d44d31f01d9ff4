"""Level 2 on real exports: every family × exporter fuses one attention, its norms and its
projections per layer, and computes what the unoptimized graph computes."""

import onnx
import pytest
from exporters import export_decoder
from hf_checkpoints import write_hf_checkpoint

from llmc.compiler.compare import compare_models
from llmc.compiler.onnx_summary import op_name
from llmc.compiler.pipeline import optimize

LAYERS = 2  # tests/hf_checkpoints.py configs
CASES = [(family, exporter, "eager") for family in ("llama", "qwen2", "mistral", "gpt2")
         for exporter in ("llmc", "dynamo", "torchscript")]
CASES += [("llama", "dynamo", "sdpa"), ("llama", "torchscript", "sdpa"), ("gpt2", "dynamo", "sdpa")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = write_hf_checkpoint(tmp_path_factory.mktemp(family), family)
        return cache[family]

    return get


@pytest.mark.parametrize("family,exporter,attention", CASES)
def test_level2_fusion_counts_and_parity(checkpoints, tmp_path, family, exporter, attention):
    path = export_decoder(checkpoints(family), exporter, tmp_path / "model.onnx", attention=attention)
    raw = onnx.load(path)
    optimized, report = optimize(onnx.load(path), level=2, verify=True, tolerance=1e-4)
    matches = {entry["pass"]: entry["matches"] for entry in report}
    ops = [op_name(n) for n in optimized.graph.node]
    assert ops.count("Attention") == LAYERS and ops.count("Softmax") == 0
    if family == "gpt2":
        assert ops.count("LayerNormalization") == 2 * LAYERS + 1
        # QKV is one projection already (c_attn); it must reach the Split as one MatMul/Gemm.
        qkv = [n for n in optimized.graph.node if n.op_type == "Split"]
        assert len(qkv) == LAYERS
    else:
        assert ops.count("RMSNormalization") == 2 * LAYERS + 1
        assert ops.count("RotaryEmbedding") == 2 * LAYERS
        assert matches["merge-sibling-matmuls"] == 2 * LAYERS  # QKV and gate/up in every layer
    assert len(optimized.graph.node) < len(raw.graph.node)
    assert compare_models(raw, optimized).max_abs <= 1e-4
