"""name-cache-positions: positions computed from the past length take the name position_ids."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from pass_testing import run_pass

from llmc.passes.name_cache_positions import NameCachePositions


def _model(step: int = 1, with_input: bool = False) -> onnx.ModelProto:
    """y = float(Unsqueeze(Range(past, past + seq, step), 0)) · 1, as Optimum's Gemma exports
    compute positions (the Mul stands for the rotary that reads them)."""
    value = helper.make_tensor_value_info
    constants = {"two": np.array(2, np.int64), "one": np.array(1, np.int64),
                 "step": np.array(step, np.int64), "zero_axis": np.array([0], np.int64),
                 "unit": np.array(1.0, np.float32)}
    nodes = [
        helper.make_node("Shape", ["past_key_values.0.key"], ["past_shape"]),
        helper.make_node("Gather", ["past_shape", "two"], ["past"], axis=0),
        helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
        helper.make_node("Gather", ["ids_shape", "one"], ["seq"], axis=0),
        helper.make_node("Add", ["past", "seq"], ["total"]),
        helper.make_node("Range", ["past", "total", "step"], ["cache_position"]),
        helper.make_node("Unsqueeze", ["cache_position", "zero_axis"], ["positions"]),
        helper.make_node("Cast", ["positions"], ["positions_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["positions_f", "unit"], ["y"]),
    ]
    inputs = [value("input_ids", TensorProto.INT64, ["batch", "seq"]),
              value("past_key_values.0.key", TensorProto.FLOAT, ["batch", 2, "past", 4])]
    if with_input:
        inputs.append(value("position_ids", TensorProto.INT64, ["batch", "seq"]))
    graph = helper.make_graph(nodes, "g", inputs, [value("y", TensorProto.FLOAT, [1, "seq"])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_range_from_the_past_length_becomes_position_ids():
    result = run_pass(NameCachePositions(), _model())
    assert result.matches == 1
    unsqueeze = next(n for n in result.model.graph.node if n.op_type == "Unsqueeze")
    assert list(unsqueeze.output) == ["position_ids"]
    assert [n.input[0] for n in result.model.graph.node if n.op_type == "Cast"] == ["position_ids"]


def test_other_ranges_and_graphs_with_positions_are_left_alone():
    assert run_pass(NameCachePositions(), _model(step=2)).matches == 0
    assert run_pass(NameCachePositions(), _model(with_input=True)).matches == 0
