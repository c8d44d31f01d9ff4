"""Structural names of linear layers: merged and unmerged projections, and graphs without fused
attention."""

import onnx

from llmc.compiler.pipeline import PIPELINES, optimize
from llmc.precision.linears import linear_layers


def test_level2_names_every_projection_of_every_layer(tiny_llama_onnx):
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    expected = [f"layers.{i}.{role}" for i in range(4) for role in ("qkv", "o", "mlp.up", "mlp.down")]
    assert [l.name for l in linear_layers(model)] == expected + ["lm_head"]


def test_unmerged_projections_get_their_own_names(tiny_llama_onnx):
    passes = [p for p in PIPELINES["2"] if p != "merge-sibling-matmuls"]
    model, _ = optimize(onnx.load(tiny_llama_onnx), passes=passes)
    names = [l.name for l in linear_layers(model)]
    assert names[:7] == ["layers.0.q", "layers.0.k", "layers.0.v", "layers.0.o",
                         "layers.0.mlp.gate", "layers.0.mlp.up", "layers.0.mlp.down"]
    assert len(names) == 4 * 7 + 1 and len(set(names)) == len(names) and names[-1] == "lm_head"


def test_without_fused_attention_layers_are_numbered(tiny_llama_onnx):
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=1)
    names = [l.name for l in linear_layers(model)]
    assert names == [f"linear.{i}" for i in range(len(names))] and len(names) == 29
