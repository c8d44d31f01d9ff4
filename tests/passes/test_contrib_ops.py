"""contrib_ops: our onnx schemas for com.microsoft ops match onnxruntime's and infer shapes."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, defs, helper, numpy_helper
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from llmc.passes import contrib_ops

OPS = ["QuickGelu", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"]


@pytest.mark.parametrize("name", OPS)
def test_schema_mirrors_onnxruntime(name):
    contrib_ops.register()
    contrib_ops.register()  # idempotent
    ours = defs.get_schema(name, 1, contrib_ops.DOMAIN)
    theirs = next(s for s in ort_state.get_all_operator_schema()
                  if s.name == name and s.domain == contrib_ops.DOMAIN)
    assert [(p.name, p.type_str) for p in ours.inputs] == [(p.name, p.typeStr) for p in theirs.inputs]
    assert [(p.name, p.type_str) for p in ours.outputs] == [(p.name, p.typeStr) for p in theirs.outputs]
    assert ({c.type_param_str: sorted(c.allowed_type_strs) for c in ours.type_constraints}
            == {c.type_param_str: sorted(c.allowed_type_strs) for c in theirs.type_constraints})
    assert sorted(ours.attributes) == sorted(theirs.attributes)


def test_shapes_flow_through_a_skip_norm():
    contrib_ops.register()
    nodes = [helper.make_node("SkipSimplifiedLayerNormalization", ["a", "b", "gamma"], ["y", "", "inv", "sum"],
                              domain=contrib_ops.DOMAIN, epsilon=1e-5),
             helper.make_node("QuickGelu", ["y"], ["q"], domain=contrib_ops.DOMAIN, alpha=1.0),
             helper.make_node("Add", ["q", "sum"], ["z"])]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT16, ["batch", "seq", 8])
    graph = helper.make_graph(nodes, "g", [value("a"), value("b")], [value("z")],
                              [numpy_helper.from_array(np.ones(8, np.float16), "gamma")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                    helper.make_opsetid(contrib_ops.DOMAIN, 1)])
    onnx.checker.check_model(model)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    shapes = {v.name: (v.type.tensor_type.elem_type,
                       [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
              for v in inferred.graph.value_info}
    assert shapes["q"] == shapes["sum"] == (TensorProto.FLOAT16, ["batch", "seq", 8])
    assert shapes["inv"] == (TensorProto.FLOAT, ["batch", "seq", 1])
