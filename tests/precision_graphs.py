"""Graphs and runners shared by the precision tests (tests/ is on sys.path: see conftest.py)."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from llmc.formats.onnx_io import serialize
from llmc.precision.calibration import prefill_feeds


def matmul_model(weight: np.ndarray) -> onnx.ModelProto:
    """One MatMul by `weight` ([K, N]), input a: [1, t, K]."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"], name="proj")], "mm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, "t", weight.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "t", weight.shape[1]])],
        [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def logits(model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    """A decoder graph's logits for one sequence computed from scratch: [tokens, vocab]."""
    session = ort.InferenceSession(serialize(model)["model.onnx"], providers=["CPUExecutionProvider"])
    return session.run(["logits"], prefill_feeds(session, ids))[0][0]
