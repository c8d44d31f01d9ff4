"""fuse-layer-norm: decomposed LayerNorm → one LayerNormalization-17 node."""

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from pass_testing import assert_unchanged, export_module, op_counts, run_pass

from llmc.passes.fuse_layer_norm import FuseLayerNorm
from llmc.formats.onnx_io import tensor_array

EPS = 1e-5
HIDDEN = 8
REDUCED = {"mu", "var", "var_eps", "root", "inv"}  # values that are [batch, 4, 1]


def const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def ln_graph(*, square="pow", divide="div", weight=True, bias=True, opset=20, axes_attr=False,
             var_axes=(-1,), eps="eps", sub=("x", "mu"), outputs=("y",), inputs=("x",)):
    """(x - mean) / sqrt(var + eps) · w + b over x [batch, 4, 8], spelled as asked; output 'y'."""
    def mean(src, dst, axes):
        if axes_attr:
            return helper.make_node("ReduceMean", [src], [dst], axes=list(axes), keepdims=1)
        return helper.make_node("ReduceMean", [src, "last" if tuple(axes) == (-1,) else "other"], [dst])

    nodes = [mean("x", "mu", (-1,)), helper.make_node("Sub", list(sub), ["d"]),
             helper.make_node("Pow", ["d", "two"], ["sq"]) if square == "pow"
             else helper.make_node("Mul", ["d", "d"], ["sq"]),
             mean("sq", "var", var_axes), helper.make_node("Add", ["var", eps], ["var_eps"]),
             helper.make_node("Sqrt", ["var_eps"], ["root"])]
    stages = [name for name, on in (("scaled", weight), ("shifted", bias)) if on]
    names = ["normed", *stages]
    names[-1] = "y"
    if divide == "div":
        nodes.append(helper.make_node("Div", ["d", "root"], [names[0]]))
    else:
        nodes += [helper.make_node("Reciprocal", ["root"], ["inv"]),
                  helper.make_node("Mul", ["inv", "d"], [names[0]])]
    position = 1
    if weight:
        nodes.append(helper.make_node("Mul", ["w", names[0]], [names[position]]))
        position += 1
    if bias:
        nodes.append(helper.make_node("Add", [names[position - 1], "b"], [names[position]]))
    rng = np.random.default_rng(0)
    inits = [const("two", 2.0), const("eps", EPS), const("last", [-1], np.int64),
             const("other", list(var_axes), np.int64),
             const("w", rng.standard_normal(HIDDEN)), const("b", rng.standard_normal(HIDDEN))]

    def value(name):
        shape = ["batch", 4, 1] if name in REDUCED else ["batch", 4, HIDDEN]
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    graph = helper.make_graph(nodes, "g", [value(n) for n in inputs], [value(n) for n in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def opset(model):
    return next(o.version for o in model.opset_import if o.domain == "")


def test_weight_and_bias_become_inputs():
    result = run_pass(FuseLayerNorm(), ln_graph())
    assert result.matches == 1
    (node,) = result.model.graph.node
    assert node.op_type == "LayerNormalization"
    assert list(node.input) == ["x", "w", "b"] and list(node.output) == ["y"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["axis"] == -1 and attrs["epsilon"] == pytest.approx(EPS)
    assert opset(result.model) == 20


@pytest.mark.parametrize("square", ["pow", "mul"])
@pytest.mark.parametrize("divide", ["div", "reciprocal"])
@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, True), (False, False)])
def test_every_spelling(square, divide, weight, bias):
    result = run_pass(FuseLayerNorm(), ln_graph(square=square, divide=divide, weight=weight, bias=bias))
    assert result.matches == 1
    (node,) = result.model.graph.node
    assert node.op_type == "LayerNormalization" and len(node.input) == (3 if bias else 2)
    values = {t.name: tensor_array(t) for t in result.model.graph.initializer}
    if not weight:
        np.testing.assert_array_equal(values[node.input[1]], np.ones(HIDDEN, np.float32))


def test_opset_13_graph_is_raised_to_17():
    result = run_pass(FuseLayerNorm(), ln_graph(axes_attr=True, opset=13))
    assert result.matches == 1 and opset(result.model) == 17
    assert result.notes[0] == "opset 13 → 17" and "LayerNormalization-17" in result.notes[1]


# --- what must not fuse --------------------------------------------------------------------------



def test_reused_difference_blocks_the_fusion():
    assert_unchanged(FuseLayerNorm(), ln_graph(outputs=("y", "d")))


def test_reused_variance_blocks_the_fusion():
    assert_unchanged(FuseLayerNorm(), ln_graph(outputs=("y", "var")))


def test_epsilon_that_is_not_constant_is_refused():
    assert_unchanged(FuseLayerNorm(), ln_graph(eps="e", inputs=("x", "e")))


def test_variance_over_other_axes_is_refused():
    model = ln_graph(var_axes=(1,))
    assert_unchanged(FuseLayerNorm(), model)


def test_mean_minus_x_is_refused():
    assert_unchanged(FuseLayerNorm(), ln_graph(sub=("mu", "x")))


def test_missing_centring_is_refused():
    # mean(x) unused by the variance: x / sqrt(mean(x²) + eps) is an RMSNorm, not a LayerNorm.
    assert_unchanged(FuseLayerNorm(), ln_graph(sub=("x", "x")))


# --- exported modules ----------------------------------------------------------------------------

class ManualLayerNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(32) + 0.5)
        self.bias = torch.nn.Parameter(torch.randn(32))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        centred = x - mean
        return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight + self.bias


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_exported_manual_layer_norm(dynamo):
    torch.manual_seed(0)
    result = run_pass(FuseLayerNorm(), export_module(ManualLayerNorm(), (torch.randn(2, 3, 32),), dynamo=dynamo))
    assert result.matches == 1
    counts = op_counts(result.model)
    assert counts["LayerNormalization"] == 1 and counts["ReduceMean"] == counts["Sub"] == 0


def test_torchscript_opset_16_layer_norm():
    # Before opset 17 the TorchScript exporter decomposes nn.LayerNorm itself.
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(32)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    model = export_module(norm, (torch.randn(2, 3, 32),), dynamo=False, opset=16)
    assert op_counts(model)["LayerNormalization"] == 0
    result = run_pass(FuseLayerNorm(), model)
    assert result.matches == 1 and op_counts(result.model)["LayerNormalization"] == 1
    assert opset(result.model) == 17
