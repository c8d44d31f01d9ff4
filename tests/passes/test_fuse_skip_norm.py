"""fuse-skip-norm: residual Add + norm → com.microsoft Skip(Simplified)LayerNormalization."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from pass_testing import assert_unchanged, export_module, llmc_rms_norm, op_counts, run_pass

from llmc.compiler.pipeline import refresh_shapes
from llmc.passes.fuse_layer_norm import FuseLayerNorm
from llmc.passes.fuse_rms_norm import FuseRmsNorm
from llmc.passes.fuse_skip_norm import FuseSkipNorm

HIDDEN = 8


def make_model(nodes, *, inputs=("a", "b"), outputs=("y",), shapes=None, opset=23):
    shapes = shapes or {}
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(size).astype(np.float32), name)
             for name, size in (("gamma", HIDDEN), ("beta", HIDDEN), ("bias", HIDDEN), ("W", (HIDDEN, HIDDEN)))]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, shapes.get(name, ["batch", 4, HIDDEN]))
    graph = helper.make_graph(nodes, "g", [value(n) for n in inputs], [value(n) for n in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    refresh_shapes(model)
    return model


def rms(src="sum", axis=-1, scale="gamma"):
    return helper.make_node("RMSNormalization", [src, scale], ["y"], axis=axis, epsilon=1e-5)


def fused(result):
    return [n for n in result.model.graph.node if n.domain == "com.microsoft"]


def test_sum_read_elsewhere_comes_from_output_3():
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]), rms(),
             helper.make_node("Add", ["sum", "y"], ["z"])]
    result = run_pass(FuseSkipNorm(), make_model(nodes, outputs=("z",)))
    assert result.matches == 1
    (node,) = fused(result)
    assert node.op_type == "SkipSimplifiedLayerNormalization"
    assert list(node.input) == ["a", "b", "gamma"] and list(node.output) == ["y", "", "", "sum"]
    add = next(n for n in result.model.graph.node if n.op_type == "Add")
    assert list(add.input) == ["sum", "y"]
    assert {o.domain: o.version for o in result.model.opset_import}["com.microsoft"] == 1


def test_sum_read_only_by_the_norm_is_not_output():
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]), rms()]
    result = run_pass(FuseSkipNorm(), make_model(nodes))
    assert result.matches == 1
    (node,) = result.model.graph.node
    assert list(node.output) == ["y"]


def test_sum_that_is_a_graph_output_is_kept():
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]), rms()]
    result = run_pass(FuseSkipNorm(), make_model(nodes, outputs=("y", "sum")))
    assert result.matches == 1 and list(fused(result)[0].output) == ["y", "", "", "sum"]


def test_layer_norm_takes_the_projection_bias():
    nodes = [helper.make_node("MatMul", ["b", "W"], ["proj"]),
             helper.make_node("Add", ["bias", "proj"], ["proj_b"]),
             helper.make_node("Add", ["a", "proj_b"], ["sum"]),
             helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    result = run_pass(FuseSkipNorm(), make_model(nodes, opset=20))
    assert result.matches == 1
    (node,) = fused(result)
    assert node.op_type == "SkipLayerNormalization"
    assert list(node.input) == ["a", "proj", "gamma", "beta", "bias"]
    assert op_counts(result.model) == {"MatMul": 1, "com.microsoft.SkipLayerNormalization": 1}


def test_norms_limits_the_fused_types():
    """The single-sequence graph's form: RMS norms fused, a layer norm left as it is."""
    layer = [helper.make_node("Add", ["a", "b"], ["sum"]),
             helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    assert_unchanged(FuseSkipNorm(norms=("RMSNormalization",)), make_model(layer, opset=20))
    rms_form = make_model([helper.make_node("Add", ["a", "b"], ["sum"]), rms()])
    result = run_pass(FuseSkipNorm(norms=("RMSNormalization",)), rms_form)
    assert [n.op_type for n in fused(result)] == ["SkipSimplifiedLayerNormalization"]


def test_rms_norm_takes_the_projection_bias():
    nodes = [helper.make_node("MatMul", ["b", "W"], ["proj"]),
             helper.make_node("Add", ["proj", "bias"], ["proj_b"]),
             helper.make_node("Add", ["proj_b", "a"], ["sum"]), rms()]
    result = run_pass(FuseSkipNorm(), make_model(nodes))
    assert result.matches == 1
    assert list(fused(result)[0].input) == ["a", "proj", "gamma", "bias"]


# --- what must not fuse --------------------------------------------------------------------------



def test_broadcast_residual_is_refused():
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]), rms()]
    assert_unchanged(FuseSkipNorm(), make_model(nodes, shapes={"b": [1, 4, HIDDEN]}))


def test_unknown_shapes_are_refused():
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]), rms()]
    assert_unchanged(FuseSkipNorm(), make_model(nodes, shapes={"a": ["batch", "seq", HIDDEN], "b": ["batch", "other", HIDDEN],
                                        "y": ["batch", "seq", HIDDEN]}))


def test_norm_over_two_axes_is_refused():
    scale = numpy_helper.from_array(np.ones((4, HIDDEN), np.float32), "scale2")
    model = make_model([helper.make_node("Add", ["a", "b"], ["sum"]), rms(axis=-2, scale="scale2")])
    model.graph.initializer.append(scale)
    assert_unchanged(FuseSkipNorm(), model)


def test_norm_of_a_product_is_refused():
    assert_unchanged(FuseSkipNorm(), make_model([helper.make_node("Mul", ["a", "b"], ["sum"]), rms()]))


def test_layer_norm_statistics_read_elsewhere_are_refused():
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]),
             helper.make_node("LayerNormalization", ["sum", "gamma"], ["y", "mean"], axis=-1)]
    assert_unchanged(FuseSkipNorm(), make_model(nodes, outputs=("y", "mean"), shapes={"mean": ["batch", 4, 1]}, opset=20))


# --- exported modules ----------------------------------------------------------------------------

class Residual(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.norm = norm

    def forward(self, x, y):
        h = x + self.proj(y)
        return self.norm(h), h * 2


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("make_norm,op_type", [(llmc_rms_norm, "SkipSimplifiedLayerNormalization"),
                                               (lambda: torch.nn.LayerNorm(32), "SkipLayerNormalization")],
                         ids=["rms", "layer"])
def test_exported_residual_blocks(dynamo, make_norm, op_type):
    torch.manual_seed(0)
    model = export_module(Residual(make_norm()), (torch.randn(2, 3, 32), torch.randn(2, 3, 32)), dynamo=dynamo)
    for first in (FuseLayerNorm(), FuseRmsNorm()):
        refresh_shapes(model)  # as the pipeline does before every pass
        model = run_pass(first, model).model
    refresh_shapes(model)
    result = run_pass(FuseSkipNorm(), model)
    assert result.matches == 1
    (node,) = fused(result)
    assert node.op_type == op_type and node.output[3] and len(node.input) == (5 if op_type == "SkipLayerNormalization" else 4)


def test_tiny_llama(tiny_llama_onnx):
    model = run_pass(FuseRmsNorm(), onnx.load(tiny_llama_onnx)).model
    refresh_shapes(model)
    result = run_pass(FuseSkipNorm(), model)
    # 9 RMSNorms: all but layer 0's input norm (on the embeddings) read a residual Add; the
    # final norm's sum has no other reader, so 7 of the 8 also output the sum.
    assert result.matches == 8
    counts = op_counts(result.model)
    assert counts["com.microsoft.SkipSimplifiedLayerNormalization"] == 8 and counts["RMSNormalization"] == 1
    with_sum = [n for n in fused(result) if len(n.output) == 4 and n.output[3]]
    assert len(with_sum) == 7
