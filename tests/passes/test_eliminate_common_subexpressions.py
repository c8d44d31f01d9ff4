from __future__ import annotations

import copy

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from pass_testing import edges, export_module, op_counts, run_pass, small_model

from llmc.passes.eliminate_common_subexpressions import EliminateCommonSubexpressions

F = TensorProto.FLOAT



def _merge(model: onnx.ModelProto):
    return run_pass(EliminateCommonSubexpressions(), model)



def test_identical_initializers_merge_by_dtype_shape_and_bytes():
    model = small_model(
        [helper.make_node("Sum", ["x", "a", "b", "c", "d"], ["y"])], ["x"], ["y"],
        [("a", np.float32([1, 2])), ("b", np.float32([1, 2])), ("c", np.float32([[1, 2]])),
         ("d", np.float32([1, 3]))])
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", F, [1, 2]))  # c broadcasts
    # Same values stored in float_data rather than raw_data.
    model.graph.initializer.append(helper.make_tensor("e", F, [2], [1.0, 2.0]))
    model.graph.node[0].input.append("e")
    result = _merge(model)
    assert result.matches == 2  # b and e into a; c differs in shape, d in bytes
    assert edges(result.model) == [("Sum", ["x", "a", "a", "c", "d", "a"], ["y"])]
    assert [t.name for t in result.model.graph.initializer] == ["a", "c", "d"]


def test_duplicate_chains_merge_in_one_sweep():
    model = small_model(
        [helper.make_node("Relu", ["x"], ["r1"]), helper.make_node("Relu", ["x"], ["r2"]),
         helper.make_node("Add", ["r1", "w1"], ["a1"]), helper.make_node("Add", ["r2", "w2"], ["a2"]),
         helper.make_node("Mul", ["a1", "a2"], ["y"])],
        ["x"], ["y"], [("w1", np.float32([1, 2])), ("w2", np.float32([1, 2]))])
    result = _merge(model)
    assert result.matches == 3  # w2, Relu, Add
    assert edges(result.model) == [("Relu", ["x"], ["r1"]), ("Add", ["r1", "w1"], ["a1"]),
                                    ("Mul", ["a1", "a1"], ["y"])]


def test_attributes_must_match_in_any_order():
    model = small_model(
        [helper.make_node("LeakyRelu", ["x"], ["l1"], alpha=0.1),
         helper.make_node("LeakyRelu", ["x"], ["l2"], alpha=0.2),
         helper.make_node("Selu", ["x"], ["s1"], alpha=2.0, gamma=3.0),
         helper.make_node("Selu", ["x"], ["s2"], alpha=2.0, gamma=3.0),
         helper.make_node("Sum", ["l1", "l2", "s1", "s2"], ["y"])],
        ["x"], ["y"])
    second_selu = model.graph.node[3]
    attributes = list(second_selu.attribute)  # make_node sorts them: reverse them
    del second_selu.attribute[:]
    second_selu.attribute.extend(reversed(attributes))
    assert [a.name for a in second_selu.attribute] == ["gamma", "alpha"]
    result = _merge(model)
    assert result.matches == 1
    assert op_counts(result.model) == {"LeakyRelu": 2, "Selu": 1, "Sum": 1}


def test_graph_outputs_keep_their_names():
    model = small_model(
        [helper.make_node("Neg", ["x"], ["y1"]), helper.make_node("Neg", ["x"], ["y2"])],
        ["x"], ["y1", "y2"], [("c1", np.float32([1, 2])), ("c2", np.float32([1, 2]))])
    model.graph.output.extend([helper.make_tensor_value_info(n, F, [2]) for n in ("c1", "c2")])
    result = _merge(model)
    assert result.matches == 0
    assert [o.name for o in result.model.graph.output] == ["y1", "y2", "c1", "c2"]
    assert op_counts(result.model) == {"Neg": 2}


def test_duplicate_of_a_graph_output_merges_into_it():
    model = small_model(
        [helper.make_node("Add", ["x", "w"], ["tmp"]), helper.make_node("Relu", ["tmp"], ["y"])],
        ["x"], ["y", "c"], [("w", np.float32([1, 2])), ("c", np.float32([1, 2]))])
    result = _merge(model)
    assert result.matches == 1
    assert edges(result.model)[0] == ("Add", ["x", "c"], ["tmp"])
    assert [t.name for t in result.model.graph.initializer] == ["c"]


def test_random_and_subgraph_nodes_are_not_merged():
    branch = helper.make_graph([helper.make_node("Neg", ["x"], ["b"])], "branch", [],
                               [helper.make_tensor_value_info("b", F, [2])])
    model = small_model(
        [helper.make_node("RandomUniformLike", ["x"], ["r1"]),
         helper.make_node("RandomUniformLike", ["x"], ["r2"]),
         helper.make_node("If", ["cond"], ["i1"], then_branch=branch, else_branch=branch),
         helper.make_node("If", ["cond"], ["i2"], then_branch=branch, else_branch=branch),
         helper.make_node("Sum", ["r1", "r2", "i1", "i2"], ["y"])],
        ["x"], ["y"], [("cond", np.bool_(True))])
    result = EliminateCommonSubexpressions().run(copy.deepcopy(model))
    onnx.checker.check_model(result.model)
    assert result.matches == 0
    assert op_counts(result.model) == {"RandomUniformLike": 2, "If": 2, "Sum": 1}


def test_values_read_by_subgraphs_are_not_merged_away():
    branch = helper.make_graph([helper.make_node("Neg", ["n2"], ["b"])], "branch", [],
                               [helper.make_tensor_value_info("b", F, [2])])
    model = small_model(
        [helper.make_node("Neg", ["x"], ["n1"]), helper.make_node("Neg", ["x"], ["n2"]),
         helper.make_node("If", ["cond"], ["i"], then_branch=branch, else_branch=branch),
         helper.make_node("Sum", ["n1", "i"], ["y"])],
        ["x"], ["y"], [("cond", np.bool_(True))])
    result = _merge(model)
    assert result.matches == 0
    assert op_counts(result.model) == {"Neg": 2, "If": 1, "Sum": 1}


class _SharedShapes(torch.nn.Module):
    """Reads the same sizes several times: TorchScript emits a Shape/Gather chain for each."""

    def forward(self, x, y):
        a = x.view(x.size(0), -1) + y.view(y.size(0), -1)
        return a.view(x.size(0), x.size(1), -1) * x.size(1)


def test_torchscript_export_parity():
    model = export_module(_SharedShapes(), (torch.randn(2, 3, 4), torch.randn(2, 3, 4)), dynamo=False)
    before = op_counts(model)
    result = _merge(model)
    assert result.matches > 0
    after = op_counts(result.model)
    assert after["Shape"] < before["Shape"]
    assert sum(after.values()) == sum(before.values()) - result.matches  # no initializers


def test_tiny_llama_parity(tiny_llama_onnx):
    model = onnx.load(tiny_llama_onnx)
    result = _merge(model)
    removed = (len(model.graph.node) - len(result.model.graph.node)
               + len(model.graph.initializer) - len(result.model.graph.initializer))
    assert result.matches == removed
