"""RewritePass (passes/base.py, passes/graph.py): a match whose commit would break the graph is
skipped and counted with its reason; the others are committed; the graph stays runnable."""

import onnx
from onnx import TensorProto, helper

from llmc.compiler.compare import compare_models
from llmc.passes.base import RewritePass
from llmc.passes.graph import Graph, Rewrite


def _model(shape_chain: bool = True) -> onnx.ModelProto:
    """r = Relu(Neg(x) + b) twice. In the first, b is Cast(Shape(Neg(x))): a value computed from
    inside the match, as Optimum's exports slice the attention mask by Shape(repeated K)."""
    value = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Neg", ["x"], ["n"]),
        helper.make_node("Shape", ["n"], ["s"]),
        helper.make_node("Cast", ["s"], ["b"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["n", "b" if shape_chain else "c"], ["t"]),
        helper.make_node("Relu", ["t"], ["r"]),
        helper.make_node("Neg", ["w"], ["n2"]),
        helper.make_node("Add", ["n2", "c"], ["t2"]),
        helper.make_node("Relu", ["t2"], ["z"]),
    ]
    graph = helper.make_graph(nodes, "g", [value(name, TensorProto.FLOAT, [3]) for name in "xwc"],
                              [value(name, TensorProto.FLOAT, [3]) for name in "rz"])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


class ReluOfShiftedNeg(RewritePass):
    """Relu(Neg(a) + b) → Relu(b − a)."""

    name = "relu-of-shifted-neg"
    anchors = ("Relu",)

    def rewrite(self, graph: Graph, relu: onnx.NodeProto) -> Rewrite | None:
        add = graph.producer_of(relu.input[0], "Add")
        neg = add and graph.producer_of(add.input[0], "Neg")
        if neg is None:
            return None
        sub = graph.node("Sub", [add.input[1], neg.input[0]])
        return Rewrite([relu, add, neg], [sub, graph.node("Relu", sub.output, [relu.output[0]])])


def test_match_that_would_orphan_a_value_is_skipped_and_counted():
    model, reference = _model(), _model()
    result = ReluOfShiftedNeg().run(model)
    # The Shape reading 'n' dies with the first match, so the match is accepted; but its Sub
    # reads 'b', computed from 'n': committing it would leave 'b' uncomputed.
    assert result.matches == 1
    assert result.skipped == {"a value would be read but no longer computed": 1}
    assert any(note.startswith("skipped 1 match(es)") and "'n'" in note for note in result.notes)
    assert [n.op_type for n in model.graph.node].count("Neg") == 1
    onnx.checker.check_model(model, full_check=True)
    assert compare_models(reference, model).max_abs == 0.0


def test_sound_matches_commit_in_one_batch():
    model, reference = _model(shape_chain=False), _model(shape_chain=False)
    result = ReluOfShiftedNeg().run(model)
    assert result.matches == 2 and result.skipped == {}
    assert [n.op_type for n in model.graph.node].count("Neg") == 0
    onnx.checker.check_model(model, full_check=True)
    assert compare_models(reference, model).max_abs == 0.0


class ShiftByOwnShape(RewritePass):
    """Relu(Neg(a) + b) → Relu(Cast(Shape(r)) − a): the new Sub reads a value computed from the
    match's own output r, as fuse-attention would have done by slicing the mask it feeds to
    Shape(present) — a cycle."""

    name = "shift-by-own-shape"
    anchors = ("Relu",)

    def rewrite(self, graph: Graph, relu: onnx.NodeProto) -> Rewrite | None:
        add = graph.producer_of(relu.input[0], "Add")
        neg = add and graph.producer_of(add.input[0], "Neg")
        cast = graph.consumers.get(relu.output[0]) and next(
            (c for user in graph.consumers[relu.output[0]] if user.op_type == "Shape"
             for c in graph.consumers[user.output[0]] if c.op_type == "Cast"), None)
        if neg is None or cast is None:
            return None
        sub = graph.node("Sub", [cast.output[0], neg.input[0]])
        return Rewrite([relu, add, neg], [sub, graph.node("Relu", sub.output, [relu.output[0]])])


def test_match_that_would_close_a_cycle_is_skipped():
    value = helper.make_tensor_value_info
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Add", ["n", "c"], ["t"]),
             helper.make_node("Relu", ["t"], ["r"]), helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("Cast", ["s"], ["rs"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["r", "rs"], ["y"])]
    graph = helper.make_graph(nodes, "g", [value(name, TensorProto.FLOAT, [3]) for name in "xc"],
                              [value("y", TensorProto.FLOAT, [3])])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    reference = onnx.ModelProto()
    reference.CopyFrom(model)
    result = ShiftByOwnShape().run(model)
    assert result.matches == 0 and result.skipped == {"the rewritten graph would have a cycle": 1}
    onnx.checker.check_model(model, full_check=True)
    assert compare_models(reference, model).max_abs == 0.0
