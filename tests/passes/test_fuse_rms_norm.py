"""fuse-rms-norm: every RMSNorm spelling → one RMSNormalization-23 node."""

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from pass_testing import assert_unchanged, export_module, llmc_rms_norm, op_counts, run_pass

from llmc.passes.fuse_rms_norm import FuseRmsNorm
from llmc.formats.onnx_io import tensor_array

SHAPE = [2, 4, 8]
EPS = 1e-5
REDUCED = {"mean", "var", "inv", "root"}  # values that are [batch, 4, 1]


def make_model(nodes, inits, *, opset=20, elem=TensorProto.FLOAT, outputs=("y",), inputs=("x",)):
    """x [batch, 4, 8] → outputs, [batch, 4, 8] or [batch, 4, 1] for the names in REDUCED."""
    def value(name):
        shape = ["batch", *SHAPE[1:-1], 1] if name in REDUCED else ["batch", *SHAPE[1:]]
        return helper.make_tensor_value_info(name, elem, shape)

    graph = helper.make_graph(nodes, "g", [value(name) for name in inputs],
                              [value(name) for name in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def rms_graph(*, square="pow", inverse="reciprocal", weight="after", axes_attr=False, eps="eps",
              axes=(-1,), opset=20, extra_nodes=(), outputs=("y",), inputs=("x",)):
    """The decomposed RMSNorm over x [batch, 4, 8], spelled as asked; output 'y'."""
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]) if square == "pow"
             else helper.make_node("Mul", ["x", "x"], ["sq"])]
    if axes_attr:
        nodes.append(helper.make_node("ReduceMean", ["sq"], ["mean"], axes=list(axes), keepdims=1))
    else:
        nodes.append(helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1))
    nodes.append(helper.make_node("Add", ["mean", eps], ["var"]))
    normed = "normed" if weight != "none" else "y"
    if inverse == "pow":
        nodes += [helper.make_node("Pow", ["var", "minus_half"], ["inv"])]
    else:
        nodes.append(helper.make_node("Sqrt", ["var"], ["root"]))
        if inverse == "reciprocal":
            nodes.append(helper.make_node("Reciprocal", ["root"], ["inv"]))
        elif inverse == "div-one":
            nodes.append(helper.make_node("Div", ["one", "root"], ["inv"]))
    if inverse == "div":
        nodes.append(helper.make_node("Div", ["x", "root"], [normed]))
    else:
        nodes.append(helper.make_node("Mul", ["x", "inv"] if weight != "before" else ["inv", "x"], [normed]))
    if weight == "after":
        nodes.append(helper.make_node("Mul", ["normed", "w"], ["y"]))
    elif weight == "before":
        nodes.append(helper.make_node("Mul", ["w", "normed"], ["y"]))
    inits = [const("two", 2.0), const("minus_half", -0.5), const("one", 1.0), const("eps", EPS),
             const("axes", list(axes), np.int64),
             const("w", np.random.default_rng(0).standard_normal(SHAPE[-1]))]
    return make_model(nodes + list(extra_nodes), inits, opset=opset, outputs=outputs, inputs=inputs)


def norm_nodes(model):
    return [n for n in model.graph.node if n.op_type == "RMSNormalization"]


def opset(model, domain=""):
    return next(o.version for o in model.opset_import if o.domain == domain)


def test_rsqrt_spelling_becomes_one_node():
    result = run_pass(FuseRmsNorm(), rms_graph())
    assert result.matches == 1
    (node,) = result.model.graph.node
    assert node.op_type == "RMSNormalization" and node.domain == ""
    assert list(node.input) == ["x", "w"] and list(node.output) == ["y"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["axis"] == -1 and attrs["epsilon"] == pytest.approx(EPS)
    assert opset(result.model) == 23
    assert result.notes[0] == "opset 20 → 23" and "RMSNormalization-23" in result.notes[1]


@pytest.mark.parametrize("square", ["pow", "mul"])
@pytest.mark.parametrize("inverse", ["reciprocal", "div-one", "pow", "div"])
@pytest.mark.parametrize("weight", ["after", "before", "none"])
def test_every_spelling(square, inverse, weight):
    result = run_pass(FuseRmsNorm(), rms_graph(square=square, inverse=inverse, weight=weight))
    assert result.matches == 1
    assert [n.op_type for n in result.model.graph.node] == ["RMSNormalization"]
    scale = result.model.graph.node[0].input[1]
    if weight == "none":
        values = {t.name: tensor_array(t) for t in result.model.graph.initializer}
        np.testing.assert_array_equal(values[scale], np.ones(SHAPE[-1], np.float32))
    else:
        assert scale == "w"


def test_axes_attribute_at_opset_17_is_moved_to_inputs_elsewhere():
    # A second ReduceMean (not an RMSNorm) keeps its meaning when the opset rises past 18.
    other = helper.make_node("ReduceMean", ["y"], ["z"], axes=[1], keepdims=1)
    model = rms_graph(axes_attr=True, opset=17, extra_nodes=[other], outputs=("z",))
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 1
    result = run_pass(FuseRmsNorm(), model)
    assert result.matches == 1 and opset(result.model) == 23
    reduce = next(n for n in result.model.graph.node if n.op_type == "ReduceMean")
    assert [a.name for a in reduce.attribute] == ["keepdims"] and len(reduce.input) == 2


def test_float16_with_float32_island_drops_both_casts():
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
             helper.make_node("Pow", ["xf", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["mean"]),
             helper.make_node("Add", ["mean", "eps"], ["var"]),
             helper.make_node("Sqrt", ["var"], ["root"]),
             helper.make_node("Reciprocal", ["root"], ["inv"]),
             helper.make_node("Mul", ["xf", "inv"], ["normed"]),
             helper.make_node("Cast", ["normed"], ["back"], to=TensorProto.FLOAT16),
             helper.make_node("Mul", ["w", "back"], ["y"])]
    inits = [const("two", 2.0), const("eps", EPS), const("axes", [-1], np.int64),
             const("w", np.linspace(0.5, 1.5, SHAPE[-1]), np.float16)]
    model = make_model(nodes, inits, elem=TensorProto.FLOAT16)
    result = run_pass(FuseRmsNorm(), model, tolerance=4e-3)
    assert result.matches == 1
    (node,) = result.model.graph.node
    assert node.op_type == "RMSNormalization" and list(node.input) == ["x", "w"]


def test_float32_cast_read_elsewhere_stays_for_its_reader():
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xf", "xf"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["mean"]),
             helper.make_node("Add", ["eps", "mean"], ["var"]),
             helper.make_node("Sqrt", ["var"], ["root"]),
             helper.make_node("Div", ["xf", "root"], ["normed"]),
             helper.make_node("Cast", ["normed"], ["back"], to=TensorProto.FLOAT16),
             helper.make_node("Mul", ["back", "w"], ["y"]),
             helper.make_node("Neg", ["xf"], ["neg"]),
             helper.make_node("Cast", ["neg"], ["z"], to=TensorProto.FLOAT16)]
    inits = [const("eps", EPS), const("axes", [-1], np.int64), const("w", np.full(SHAPE[-1], 2.0), np.float16)]
    model = make_model(nodes, inits, elem=TensorProto.FLOAT16, outputs=("y", "z"))
    result = run_pass(FuseRmsNorm(), model, tolerance=4e-3)
    assert result.matches == 1
    node = norm_nodes(result.model)[0]
    assert list(node.input) == ["x", "w"] and list(node.output) == ["y"]
    cast = next(n for n in result.model.graph.node if n.output[0] == "xf")
    assert [n.op_type for n in result.model.graph.node if "xf" in n.input] == ["Neg"]
    assert cast.op_type == "Cast"


def test_cast_after_the_norm_stays_and_the_weight_moves_before_it():
    # float32 input, normalized, cast to float16, scaled by a float16 weight.
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["mean"]),
             helper.make_node("Add", ["mean", "eps"], ["var"]),
             helper.make_node("Sqrt", ["var"], ["root"]),
             helper.make_node("Reciprocal", ["root"], ["inv"]),
             helper.make_node("Mul", ["x", "inv"], ["normed"]),
             helper.make_node("Cast", ["normed"], ["back"], to=TensorProto.FLOAT16),
             helper.make_node("Mul", ["w", "back"], ["y"])]
    inits = [const("two", 2.0), const("eps", EPS), const("axes", [-1], np.int64),
             const("w", np.linspace(0.5, 1.5, SHAPE[-1]), np.float16)]
    model = make_model(nodes, inits)
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    result = run_pass(FuseRmsNorm(), model, tolerance=4e-3)
    assert result.matches == 1
    norm, cast = result.model.graph.node
    assert norm.op_type == "RMSNormalization" and norm.input[0] == "x"
    assert cast.op_type == "Cast" and list(cast.input) == list(norm.output) and list(cast.output) == ["y"]
    scale = next(t for t in result.model.graph.initializer if t.name == norm.input[1])
    np.testing.assert_allclose(tensor_array(scale), np.linspace(0.5, 1.5, SHAPE[-1]), rtol=1e-3)
    assert scale.data_type == TensorProto.FLOAT


def test_weight_varying_along_rows_stays_outside():
    model = rms_graph()
    next(t for t in model.graph.initializer if t.name == "w").CopyFrom(
        const("w", np.random.default_rng(1).standard_normal((SHAPE[1], SHAPE[-1]))))
    result = run_pass(FuseRmsNorm(), model)
    assert result.matches == 1
    norm, mul = result.model.graph.node
    assert norm.op_type == "RMSNormalization" and mul.op_type == "Mul"
    assert list(mul.input) == [norm.output[0], "w"] and list(mul.output) == ["y"]


# --- what must not fuse --------------------------------------------------------------------------



def test_reused_mean_blocks_the_fusion():
    assert_unchanged(FuseRmsNorm(), rms_graph(outputs=("y", "mean")))


def test_reused_inverse_blocks_the_fusion():
    assert_unchanged(FuseRmsNorm(), rms_graph(extra_nodes=[helper.make_node("Mul", ["inv", "x"], ["z"])], outputs=("y", "z")))


def test_reused_square_blocks_the_fusion():
    assert_unchanged(FuseRmsNorm(), rms_graph(outputs=("y", "sq")))


def test_epsilon_that_is_not_constant_is_refused():
    assert_unchanged(FuseRmsNorm(), rms_graph(eps="e", inputs=("x", "e")))


def test_mean_over_a_middle_axis_is_refused():
    assert_unchanged(FuseRmsNorm(), rms_graph(axes=(1,)))


def test_cube_instead_of_square_is_refused():
    model = rms_graph()
    next(t for t in model.graph.initializer if t.name == "two").CopyFrom(const("two", 3.0))
    assert_unchanged(FuseRmsNorm(), model)


def test_missing_sqrt_is_refused():
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["mean"]),
             helper.make_node("Add", ["mean", "eps"], ["var"]),
             helper.make_node("Div", ["x", "var"], ["y"])]
    assert_unchanged(FuseRmsNorm(), make_model(nodes, [const("eps", EPS), const("axes", [-1], np.int64)]))


def test_centred_input_is_left_to_fuse_layer_norm():
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["mu"]),
             helper.make_node("Sub", ["x", "mu"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["mean"]),
             helper.make_node("Add", ["mean", "eps"], ["var"]),
             helper.make_node("Sqrt", ["var"], ["root"]),
             helper.make_node("Div", ["d", "root"], ["y"])]
    assert_unchanged(FuseRmsNorm(), make_model(nodes, [const("eps", EPS), const("axes", [-1], np.int64)]))


def test_old_opset_graph_is_converted_then_fused():
    result = run_pass(FuseRmsNorm(), rms_graph(axes_attr=True, opset=11))
    assert result.matches == 1 and opset(result.model) == 23
    assert [n.op_type for n in result.model.graph.node] == ["RMSNormalization"]


# --- exported modules ----------------------------------------------------------------------------

class DivRms(torch.nn.Module):
    """x / sqrt(mean(x·x) + eps), no weight."""

    def forward(self, x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)


class PowRms(torch.nn.Module):
    """T5-style x · (mean(x²) + eps)^-0.5 · weight."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x):
        return x * (x.pow(2).mean(-1, keepdim=True) + 1e-6) ** -0.5 * self.weight


def hf_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("factory", [llmc_rms_norm, hf_rms_norm, DivRms, PowRms],
                         ids=["llmc", "hf-llama", "div-sqrt", "pow-half"])
def test_exported_modules(dynamo, factory):
    torch.manual_seed(0)
    model = export_module(factory(), (torch.randn(2, 3, 32),), dynamo=dynamo)
    result = run_pass(FuseRmsNorm(), model)
    assert result.matches == 1
    counts = op_counts(result.model)
    assert counts["RMSNormalization"] == 1
    assert counts["ReduceMean"] == counts["Sqrt"] == counts["Cast"] == counts["Mul"] == 0


def test_tiny_llama_has_nine(tiny_llama_onnx):
    model = onnx.load(tiny_llama_onnx)
    result = run_pass(FuseRmsNorm(), model)
    assert result.matches == 9
    counts = op_counts(result.model)
    assert counts["RMSNormalization"] == 9 and counts["ReduceMean"] == 0 and counts["Reciprocal"] == 0
