"""fuse-gelu: erf- and tanh-form GELU → one Gelu-20 node."""

import math

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from pass_testing import assert_unchanged, export_module, op_counts, run_pass

from llmc.passes.fuse_gelu import FuseGelu


def const(name, value):
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


CONSTANTS = {"half": 0.5, "one": 1.0, "sqrt2": math.sqrt(2), "inv_sqrt2": 1 / math.sqrt(2),
             "k": math.sqrt(2 / math.pi), "a": 0.044715, "three": 3.0, "two": 2.0}


def make_model(nodes, *, outputs=("y",), opset=17, constants=None):
    values = {**CONSTANTS, **(constants or {})}
    inits = [const(name, value) for name, value in values.items()]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 16])
    graph = helper.make_graph(nodes, "g", [value("x")], [value(n) for n in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def mul(a, b, out):
    return helper.make_node("Mul", [a, b], [out])


def erf_nodes(scale="div", order="half-first"):
    arg = (helper.make_node("Div", ["x", "sqrt2"], ["arg"]) if scale == "div"
           else mul("inv_sqrt2", "x", "arg"))
    nodes = [arg, helper.make_node("Erf", ["arg"], ["e"]), helper.make_node("Add", ["one", "e"], ["onep"])]
    if order == "half-first":
        nodes += [mul("x", "half", "hx"), mul("hx", "onep", "y")]
    elif order == "half-last":
        nodes += [mul("onep", "x", "xo"), mul("half", "xo", "y")]
    else:  # divided by two at the end
        nodes += [mul("x", "onep", "xo"), helper.make_node("Div", ["xo", "two"], ["y"])]
    return nodes


def tanh_nodes(cube="pow", factoring="sum"):
    if factoring == "sum":
        if cube == "pow":
            nodes = [helper.make_node("Pow", ["x", "three"], ["x3"])]
        elif cube == "mul":
            nodes = [mul("x", "x", "x2"), mul("x2", "x", "x3")]
        else:  # x · Pow(x, 2)
            nodes = [helper.make_node("Pow", ["x", "two"], ["x2"]), mul("x", "x2", "x3")]
        nodes += [mul("a", "x3", "ax3"), helper.make_node("Add", ["x", "ax3"], ["inner"]),
                  mul("inner", "k", "t_arg")]
    else:  # HF FastGELU: x · k · (1 + a·x·x)
        nodes = [mul("x", "x", "x2"), mul("x2", "a", "ax2"), helper.make_node("Add", ["one", "ax2"], ["inner"]),
                 mul("x", "k", "kx"), mul("kx", "inner", "t_arg")]
    return nodes + [helper.make_node("Tanh", ["t_arg"], ["t"]), helper.make_node("Add", ["t", "one"], ["onep"]),
                    mul("half", "x", "hx"), mul("hx", "onep", "y")]


def gelu_node(result):
    (node,) = result.model.graph.node
    assert node.op_type == "Gelu" and node.domain == ""
    assert list(node.input) == ["x"] and list(node.output) == ["y"]
    return helper.get_attribute_value(node.attribute[0]).decode()


@pytest.mark.parametrize("scale", ["div", "mul"])
@pytest.mark.parametrize("order", ["half-first", "half-last", "div-two"])
def test_erf_form(scale, order):
    result = run_pass(FuseGelu(), make_model(erf_nodes(scale, order)))
    assert result.matches == 1 and gelu_node(result) == "none"
    assert next(o.version for o in result.model.opset_import if o.domain == "") == 20


@pytest.mark.parametrize("cube,factoring", [("pow", "sum"), ("mul", "sum"), ("pow-mul", "sum"), ("mul", "factored")])
def test_tanh_form(cube, factoring):
    result = run_pass(FuseGelu(), make_model(tanh_nodes(cube, factoring)))
    assert result.matches == 1 and gelu_node(result) == "tanh"


def test_two_gelus_both_fuse():
    nodes = erf_nodes() + [helper.make_node("Neg", ["y"], ["x_2"])]
    second = erf_nodes()
    for node in second:
        node.input[:] = [{"x": "x_2"}.get(n, n + "_2" if n not in CONSTANTS else n) for n in node.input]
        node.output[:] = [n + "_2" for n in node.output]
    result = run_pass(FuseGelu(), make_model(nodes + second, outputs=("y_2",)))
    assert result.matches == 2 and op_counts(result.model) == {"Gelu": 2, "Neg": 1}


# --- what must not fuse --------------------------------------------------------------------------



def test_wrong_half_is_refused():
    assert_unchanged(FuseGelu(), make_model(erf_nodes(), constants={"half": 0.6}))


def test_wrong_erf_scale_is_refused():
    assert_unchanged(FuseGelu(), make_model(erf_nodes(), constants={"sqrt2": 2.0}))


def test_square_instead_of_cube_is_refused():
    assert_unchanged(FuseGelu(), make_model(tanh_nodes("pow"), constants={"three": 2.0}))


def test_wrong_tanh_coefficient_is_refused():
    assert_unchanged(FuseGelu(), make_model(tanh_nodes("mul"), constants={"a": 0.05}))


def test_reused_erf_is_refused():
    assert_unchanged(FuseGelu(), make_model(erf_nodes(), outputs=("y", "e")))


def test_reused_cube_is_refused():
    assert_unchanged(FuseGelu(), make_model(tanh_nodes("pow"), outputs=("y", "x3")))


def test_erf_of_another_tensor_is_refused():
    nodes = erf_nodes()
    nodes[0].input[0] = "z"
    model = make_model(nodes)
    model.graph.input.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 16]))
    assert_unchanged(FuseGelu(), model)


def test_missing_one_plus_is_refused():
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["arg"]), helper.make_node("Erf", ["arg"], ["e"]),
             mul("x", "half", "hx"), mul("hx", "e", "y")]
    assert_unchanged(FuseGelu(), make_model(nodes))


# --- exported modules ----------------------------------------------------------------------------

class ErfGelu(torch.nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


class ErfGeluMul(torch.nn.Module):
    def forward(self, x):
        return x * (1.0 + torch.erf(x * 0.7071067811865476)) * 0.5


class NewGelu(torch.nn.Module):
    """Hugging Face's NewGELUActivation (GPT-2's gelu_new)."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class FastGelu(torch.nn.Module):
    """Hugging Face's FastGELUActivation."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


class TorchGelu(torch.nn.Module):
    def __init__(self, approximate):
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        return torch.nn.functional.gelu(x, approximate=self.approximate)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("module,approximate", [(ErfGelu(), "none"), (ErfGeluMul(), "none"),
                                                (NewGelu(), "tanh"), (FastGelu(), "tanh")],
                         ids=["erf-div", "erf-mul", "hf-new-gelu", "hf-fast-gelu"])
def test_exported_formulas(dynamo, module, approximate):
    model = export_module(module, (torch.randn(2, 3, 32),), dynamo=dynamo)
    result = run_pass(FuseGelu(), model)
    assert result.matches == 1
    (node,) = result.model.graph.node
    assert node.op_type == "Gelu" and helper.get_attribute_value(node.attribute[0]).decode() == approximate


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_torchscript_decomposes_functional_gelu_and_we_fuse_it(approximate):
    model = export_module(TorchGelu(approximate), (torch.randn(2, 3, 32),), dynamo=False)
    assert op_counts(model)["Gelu"] == 0
    result = run_pass(FuseGelu(), model)
    assert result.matches == 1 and op_counts(result.model) == {"Gelu": 1}
