"""merge-sibling-matmuls: sibling MatMuls on one input → one MatMul (+ Add) + Split."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from pass_testing import op_counts, run_pass

from llmc.passes.merge_sibling_matmuls import MergeSiblingMatMuls
from llmc.formats.onnx_io import tensor_array

RNG = np.random.default_rng(0)


def graph_with_siblings(widths, biased, weight_as_input=()):
    """x [2, 3, 8] → MatMul with W_i [8, widths[i]] (+ b_i when biased[i]) → outputs y_i."""
    nodes, inits, inputs = [], [], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])]
    outputs = []
    for i, (width, bias) in enumerate(zip(widths, biased)):
        if i in weight_as_input:
            inputs.append(helper.make_tensor_value_info(f"w{i}", TensorProto.FLOAT, [8, width]))
        else:
            inits.append(numpy_helper.from_array(RNG.standard_normal((8, width)).astype(np.float32), f"w{i}"))
        out = f"y{i}" if not bias else f"mm{i}"
        nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [out]))
        if bias:
            inits.append(numpy_helper.from_array(RNG.standard_normal(width).astype(np.float32), f"b{i}"))
            nodes.append(helper.make_node("Add", [out, f"b{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2, 3, width]))
    graph = helper.make_graph(nodes, "siblings", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_qkv_with_biases_becomes_one_matmul_add_split():
    result = run_pass(MergeSiblingMatMuls(), graph_with_siblings([8, 4, 4], [True] * 3), tolerance=1e-5)
    assert result.matches == 1
    assert op_counts(result.model) == {"MatMul": 1, "Add": 1, "Split": 1}
    split = next(n for n in result.model.graph.node if n.op_type == "Split")
    assert list(split.output) == ["y0", "y1", "y2"]
    sizes = {t.name: tensor_array(t) for t in result.model.graph.initializer}[split.input[1]]
    assert sizes.tolist() == [8, 4, 4]


def test_gate_up_without_biases():
    result = run_pass(MergeSiblingMatMuls(), graph_with_siblings([16, 16], [False, False]), tolerance=1e-5)
    assert result.matches == 1 and op_counts(result.model) == {"MatMul": 1, "Split": 1}


def test_mixed_biases_merge_matmuls_and_keep_adds():
    result = run_pass(MergeSiblingMatMuls(), graph_with_siblings([4, 4], [True, False]), tolerance=1e-5)
    assert result.matches == 1 and op_counts(result.model) == {"MatMul": 1, "Split": 1, "Add": 1}


def test_non_constant_weight_is_left_alone():
    model = graph_with_siblings([4, 4], [False, False], weight_as_input=(1,))
    result = run_pass(MergeSiblingMatMuls(), model)
    assert result.matches == 0 and op_counts(result.model) == {"MatMul": 2}


def test_single_matmul_is_left_alone():
    result = run_pass(MergeSiblingMatMuls(), graph_with_siblings([4], [True]))
    assert result.matches == 0 and op_counts(result.model) == {"MatMul": 1, "Add": 1}


def test_result_is_a_valid_graph():
    result = run_pass(MergeSiblingMatMuls(), graph_with_siblings([8, 4, 4], [True] * 3))
    onnx.checker.check_model(result.model, full_check=True)


def test_matmul_of_a_constant_with_itself_is_one_node_not_two_siblings():
    # Found by the property test: MatMul(c, c) is listed twice among c's consumers.
    square = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
        RNG.standard_normal((4, 4)).astype(np.float32)))
    graph = helper.make_graph([square, helper.make_node("MatMul", ["c", "c"], ["y"])], "square", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    result = run_pass(MergeSiblingMatMuls(), model)
    assert result.matches == 0 and op_counts(result.model) == {"Constant": 1, "MatMul": 1}
