"""The logits rows' gather moves up through row-wise nodes only, and the logits stay the same."""

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmc.passes.logit_rows import hoist_logit_rows

WIDTH, TOKENS = 8, 12


def _model(packed: bool) -> onnx.ModelProto:
    """x [sequences, tokens each, 8] → a token-mixing CumSum, then row-wise work reading both
    the CumSum's rows and a residual value that the CumSum also reads; the logits of the rows
    asked for (after the packing Reshape to [1, tokens, 8] where `packed`)."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32), f"w{i}")
               for i in range(3)]
    constants = weights + [numpy_helper.from_array(np.ones(WIDTH, np.float32), "scale"),
                           numpy_helper.from_array(np.array(1, np.int64), "axis"),
                           numpy_helper.from_array(np.full((1, 1, WIDTH), 0.5, np.float32), "half"),
                           numpy_helper.from_array(np.array([1, -1, 0], np.int64), "packing")]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["residual"]),
             helper.make_node("CumSum", ["residual", "axis"], ["mixed"]),  # each row reads the rows before
             helper.make_node("MatMul", ["mixed", "w1"], ["projected"]),
             helper.make_node("Add", ["residual", "projected"], ["summed"]),
             helper.make_node("RMSNormalization", ["summed", "scale"], ["normed"], axis=-1),
             helper.make_node("Sigmoid", ["normed"], ["gate"]),
             helper.make_node("Mul", ["gate", "half"], ["halved"]),  # a [1, 1, n] broadcast
             helper.make_node("MatMul", ["halved", "w2"], ["last"])]
    if packed:
        nodes += [helper.make_node("Reshape", ["last", "packing"], ["last_packed"]),
                  helper.make_node("Gather", ["last_packed", "logits_rows"], ["logits"], axis=1)]
    else:
        nodes.append(helper.make_node("Gather", ["last", "logits_rows"], ["logits"], axis=1))
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "rows", [value("x", TensorProto.FLOAT, ["sequences", "tokens", WIDTH]),
                        value("logits_rows", TensorProto.INT64, ["rows"])],
        [value("logits", TensorProto.FLOAT, [1, "rows", WIDTH])], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model)


def _run(model: onnx.ModelProto, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"x": x, "logits_rows": rows})[0]


@pytest.mark.parametrize("packed", [False, True])
def test_the_gather_moves_up_to_the_token_mixing_node_and_the_logits_are_the_same(packed):
    model = _model(packed)
    hoisted = copy.deepcopy(model)
    moved = hoist_logit_rows(hoisted)
    onnx.checker.check_model(hoisted, full_check=True)

    assert moved == 6  # the last MatMul, Mul, Sigmoid, the norm, the Add, the MatMul after the CumSum
    producers = {out: node for node in hoisted.graph.node for out in node.output}
    gathers = [node for node in hoisted.graph.node if node.op_type == "Gather"]
    sources = {producers[g.input[0]].input[0] if packed else g.input[0] for g in gathers}
    assert sources == {"mixed", "residual"}  # the CumSum's rows and the residual's, each gathered once
    cumsum = next(node for node in hoisted.graph.node if node.op_type == "CumSum")
    assert list(cumsum.input) == ["residual", "axis"]  # the mixing node still reads every token

    rng = np.random.default_rng(1)
    sequences = 2 if packed else 1
    x = rng.standard_normal((sequences, TOKENS, WIDTH)).astype(np.float32)
    for rows in (np.array([TOKENS - 1]), np.array([3, 5, sequences * TOKENS - 1]), np.arange(sequences * TOKENS)):
        np.testing.assert_allclose(_run(hoisted, x, rows), _run(model, x, rows), rtol=1e-6, atol=1e-6)


def test_a_value_the_graph_outputs_keeps_its_rows():
    model = _model(packed=False)
    model.graph.output.append(helper.make_tensor_value_info("halved", TensorProto.FLOAT, None))
    hoisted = copy.deepcopy(model)
    assert hoist_logit_rows(hoisted) == 1  # the last MatMul only: "halved" is read whole
    assert [node.op_type for node in hoisted.graph.node][-3:] == ["Mul", "Gather", "MatMul"]


def test_an_output_nothing_reads_is_kept_under_a_name_of_its_own():
    model = _model(packed=False)
    norm = next(node for node in model.graph.node if node.op_type == "RMSNormalization")
    norm.op_type = "LayerNormalization"
    norm.output.append("mean")  # nothing reads it
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(WIDTH, np.float32), "bias"))
    norm.input.append("bias")
    model = onnx.shape_inference.infer_shapes(model)
    hoisted = copy.deepcopy(model)
    assert hoist_logit_rows(hoisted) == 6
    onnx.checker.check_model(hoisted, full_check=True)
    x = np.random.default_rng(2).standard_normal((1, TOKENS, WIDTH)).astype(np.float32)
    rows = np.array([0, TOKENS - 1])
    np.testing.assert_allclose(_run(hoisted, x, rows), _run(model, x, rows), rtol=1e-6, atol=1e-6)


def test_a_norm_over_the_token_axis_stops_the_gather():
    model = _model(packed=False)
    norm = next(node for node in model.graph.node if node.op_type == "RMSNormalization")
    norm.attribute[0].i = 1  # over the tokens: each row reads them all
    hoisted = copy.deepcopy(model)
    assert hoist_logit_rows(hoisted) == 3  # the last MatMul, the Mul, the Sigmoid
    gather = next(node for node in hoisted.graph.node if node.op_type == "Gather")
    assert gather.input[0] == "normed"
