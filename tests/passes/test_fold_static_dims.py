"""fold-static-dims: Gather/Slice of a Shape whose selected dims are static become constants."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from pass_testing import op_counts, run_pass

from llmc.compiler.pipeline import refresh_shapes
from llmc.passes.fold_static_dims import FoldStaticDims
from llmc.formats.onnx_io import tensor_array


def shape_model(select, y_shape):
    """x [batch, 4, 16] → Shape → select → Cast to float → y (so the folded value is observable)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), *select,
             helper.make_node("Cast", ["selected"], ["y"], to=TensorProto.FLOAT)]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
             [("i2", 2), ("i0", 0), ("s1", [1]), ("e3", [3]), ("s0", [0])]]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 18)])
    refresh_shapes(model)
    return model


def test_gather_of_a_static_dim_folds():
    result = run_pass(FoldStaticDims(), shape_model([helper.make_node("Gather", ["shape", "i2"], ["selected"])], []))
    assert result.matches == 1
    assert op_counts(result.model) == {"Cast": 1}  # Shape is dead once its only reader folded
    folded = {t.name: tensor_array(t) for t in result.model.graph.initializer}["selected"]
    assert folded.tolist() == 16 and folded.dtype == np.int64


def test_slice_of_static_dims_folds():
    result = run_pass(FoldStaticDims(), shape_model(
        [helper.make_node("Slice", ["shape", "s1", "e3", "s0"], ["selected"])], [2]))
    assert result.matches == 1
    folded = {t.name: tensor_array(t) for t in result.model.graph.initializer}["selected"]
    assert folded.tolist() == [4, 16]


def test_dynamic_dim_is_left_alone():
    model = shape_model([helper.make_node("Gather", ["shape", "i0"], ["selected"])], [])
    result = run_pass(FoldStaticDims(), model)
    assert result.matches == 0 and op_counts(result.model) == {"Shape": 1, "Gather": 1, "Cast": 1}


def test_slice_reaching_a_dynamic_dim_is_left_alone():
    model = shape_model([helper.make_node("Slice", ["shape", "s0", "e3", "s0"], ["selected"])], [3])
    assert run_pass(FoldStaticDims(), model).matches == 0
    onnx.checker.check_model(model)
