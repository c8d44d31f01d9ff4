"""fuse-silu: x · Sigmoid(α·x) → one com.microsoft QuickGelu node."""

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from pass_testing import assert_unchanged, export_module, op_counts, run_pass

from llmc.models.decoder import MLP as LlamaMLP
from llmc.models.decoder import DecoderArgs as LlamaArgs
from llmc.passes.fuse_silu import FuseSilu


def make_model(nodes, *, outputs=("y",), inputs=("x",)):
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 16])
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in (("alpha", 1.702), ("two", 2.0))]
    graph = helper.make_graph(nodes, "g", [value(n) for n in inputs], [value(n) for n in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def quick_gelu(result):
    (node,) = result.model.graph.node
    assert node.op_type == "QuickGelu" and node.domain == "com.microsoft"
    assert list(node.input) == ["x"] and list(node.output) == ["y"]
    assert {o.domain: o.version for o in result.model.opset_import}["com.microsoft"] == 1
    return helper.get_attribute_value(node.attribute[0])


@pytest.mark.parametrize("order", [["x", "s"], ["s", "x"]])
def test_silu_either_order(order):
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", order, ["y"])]
    result = run_pass(FuseSilu(), make_model(nodes))
    assert result.matches == 1 and quick_gelu(result) == 1.0


@pytest.mark.parametrize("scale", [["alpha", "x"], ["x", "alpha"]])
def test_scaled_sigmoid_keeps_alpha(scale):
    nodes = [helper.make_node("Mul", scale, ["ax"]), helper.make_node("Sigmoid", ["ax"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["y"])]
    result = run_pass(FuseSilu(), make_model(nodes))
    assert result.matches == 1 and quick_gelu(result) == pytest.approx(1.702)


# --- what must not fuse --------------------------------------------------------------------------



def test_reused_sigmoid_is_refused():
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    assert_unchanged(FuseSilu(), make_model(nodes, outputs=("y", "s")))


def test_sigmoid_of_another_tensor_is_refused():
    nodes = [helper.make_node("Sigmoid", ["z"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    assert_unchanged(FuseSilu(), make_model(nodes, inputs=("x", "z")))


def test_sigmoid_squared_is_refused():
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["s", "s"], ["y"])]
    assert_unchanged(FuseSilu(), make_model(nodes))


def test_sigmoid_of_a_shifted_input_is_refused():
    nodes = [helper.make_node("Add", ["x", "two"], ["ax"]), helper.make_node("Sigmoid", ["ax"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["y"])]
    assert_unchanged(FuseSilu(), make_model(nodes))


# --- exported modules ----------------------------------------------------------------------------

class Spelled(torch.nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("module", [torch.nn.SiLU(), Spelled()], ids=["nn-silu", "x-sigmoid-x"])
def test_exported_silu(dynamo, module):
    result = run_pass(FuseSilu(), export_module(module, (torch.randn(2, 3, 32),), dynamo=dynamo))
    assert result.matches == 1 and op_counts(result.model) == {"com.microsoft.QuickGelu": 1}


def test_llama_mlp():
    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=8, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                     num_kv_heads=1, max_position_embeddings=16)
    result = run_pass(FuseSilu(), export_module(LlamaMLP(args), (torch.randn(2, 3, 32),)))
    assert result.matches == 1
    counts = op_counts(result.model)
    assert counts["com.microsoft.QuickGelu"] == 1 and counts["Sigmoid"] == 0 and counts["Mul"] == 1
