from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from pass_testing import edges, export_module, op_counts, run_pass, small_model

from llmc.passes.eliminate_dead_code import EliminateDeadCode

F = TensorProto.FLOAT



def _eliminate(model: onnx.ModelProto):
    return run_pass(EliminateDeadCode(), model)



def test_unread_nodes_and_initializers_are_removed():
    model = small_model(
        [helper.make_node("Add", ["x", "w"], ["dead1"]),
         helper.make_node("Relu", ["dead1"], ["dead2"]),
         helper.make_node("Neg", ["x"], ["y"])],
        ["x", "unused_input"], ["y"], [("w", np.float32([1, 2])), ("v", np.float32([3, 4]))])
    result = _eliminate(model)
    assert result.matches == 4  # Add, Relu, w, v
    assert edges(result.model) == [("Neg", ["x"], ["y"])]
    assert not result.model.graph.initializer
    assert [i.name for i in result.model.graph.input] == ["x", "unused_input"]


def test_identity_readers_are_rewired_to_its_input():
    model = small_model(
        [helper.make_node("Identity", ["x"], ["a"]), helper.make_node("Identity", ["a"], ["b"]),
         helper.make_node("Add", ["a", "b"], ["y"])],
        ["x"], ["y"])
    result = _eliminate(model)
    assert result.matches == 2
    assert edges(result.model) == [("Add", ["x", "x"], ["y"])]


def test_a_cast_to_its_inputs_own_type_is_an_identity():
    # x is float: Cast(to=FLOAT) is a no-op and goes; Cast(to=DOUBLE) and back changes values'
    # type and stays (the pair is not folded: rounding through another type is not a no-op).
    model = small_model(
        [helper.make_node("Cast", ["x"], ["same"], to=TensorProto.FLOAT),
         helper.make_node("Cast", ["same"], ["wide"], to=TensorProto.DOUBLE),
         helper.make_node("Cast", ["wide"], ["narrow"], to=TensorProto.FLOAT),
         helper.make_node("Add", ["same", "narrow"], ["y"])],
        ["x"], ["y"])
    model = onnx.shape_inference.infer_shapes(model)
    result = _eliminate(model)
    assert result.matches == 1
    assert edges(result.model) == [("Cast", ["x"], ["wide"]), ("Cast", ["wide"], ["narrow"]),
                                   ("Add", ["x", "narrow"], ["y"])]


def test_identity_to_a_graph_output_renames_the_producer():
    model = small_model(
        [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Identity", ["n"], ["i"]),
         helper.make_node("Identity", ["i"], ["y"]), helper.make_node("Relu", ["n"], ["z"])],
        ["x"], ["y", "z"])
    result = _eliminate(model)
    assert result.matches == 2
    assert [o.name for o in result.model.graph.output] == ["y", "z"]
    assert edges(result.model) == [("Neg", ["x"], ["y"]), ("Relu", ["y"], ["z"])]


def test_identity_that_cannot_be_renamed_away_is_kept():
    model = small_model(
        [helper.make_node("Identity", ["x"], ["from_input"]),
         helper.make_node("Identity", ["w"], ["from_initializer"]),
         helper.make_node("Neg", ["x"], ["n"]),
         helper.make_node("Identity", ["n"], ["first"]),
         helper.make_node("Identity", ["n"], ["second"])],
        ["x"], ["from_input", "from_initializer", "first", "second"], [("w", np.float32([1, 2]))])
    result = _eliminate(model)
    assert result.matches == 1
    assert [o.name for o in result.model.graph.output] == ["from_input", "from_initializer",
                                                           "first", "second"]
    assert sorted(edges(result.model)) == [
        ("Identity", ["first"], ["second"]), ("Identity", ["w"], ["from_initializer"]),
        ("Identity", ["x"], ["from_input"]), ("Neg", ["x"], ["first"])]


def test_identity_read_inside_a_subgraph_is_kept():
    branch = helper.make_graph([helper.make_node("Neg", ["i"], ["b"])], "branch", [],
                               [helper.make_tensor_value_info("b", F, [2])])
    model = small_model(
        [helper.make_node("Identity", ["x"], ["i"]),
         helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)],
        ["x"], ["y"], [("cond", np.bool_(True))])
    result = _eliminate(model)
    assert result.matches == 0
    assert op_counts(result.model) == {"Identity": 1, "If": 1}


class _Aliases(torch.nn.Module):
    def forward(self, x):
        doubled = x * 2
        return x, x.clone(), doubled, doubled.clone()


def test_exported_output_aliases_keep_their_names():
    # The dynamo exporter writes each aliased output as an Identity; none can go.
    model = export_module(_Aliases(), (torch.randn(2, 4),))
    result = _eliminate(model)
    assert result.matches == 0
    assert [o.name for o in result.model.graph.output] == [o.name for o in model.graph.output]


def test_tiny_llama_parity(tiny_llama_onnx):
    model = onnx.load(tiny_llama_onnx)
    original = op_counts(model)
    nodes = list(model.graph.node)
    extra = []
    for node in nodes:
        if node.op_type == "MatMul":  # route every weight through an Identity
            extra.append(helper.make_node("Identity", [node.input[1]], [node.input[1] + "/alias"]))
            node.input[1] += "/alias"
    extra.append(helper.make_node("Softmax", [nodes[-1].output[0]], ["never_read"]))
    model.graph.node.extend(extra)
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), "unused"))
    # The export's own no-op Casts (a float32 value cast to float32) go too: the pass reads the
    # types the pipeline's shape inference leaves in value_info.
    model = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input]}
    no_op_casts = sum(n.op_type == "Cast" and types.get(n.input[0]) == n.attribute[0].i for n in nodes)
    identities = original.pop("Identity", 0)  # the export's own go as well
    result = _eliminate(model)
    assert result.matches == len(extra) + 1 + no_op_casts + identities
    assert op_counts(result.model) == {**original, "Cast": original.get("Cast", 0) - no_op_casts}
