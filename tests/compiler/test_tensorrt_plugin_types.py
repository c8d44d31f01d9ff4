"""The dry run's rule for ``llmc::paged_attention``'s input types agrees with the plugin itself.

TensorRT asks the plugin for its output types while building (``get_output_data_types``, which the
wheel's real ``tensorrt.plugin`` package answers by calling llmc's register function); the dry run
(compiler/tensorrt_network.check_network) checks the same node's ONNX types before any of that. On
a grid of types both must accept or both refuse.
"""

from __future__ import annotations

import itertools
import sys
import types

import numpy as np
import pytest
from onnx import TensorProto, helper

from llmc.compiler.tensorrt_network import check_network, map_plugin_nodes
from llmc.errors import LlmcError
from llmc.plugins.paged_attention import PLUGIN_ID
from llmc.plugins.tensorrt_plugin import INPUT_NAMES

tensorrt_wheel = pytest.importorskip("tensorrt_wheel")
NAMESPACE, NAME = PLUGIN_ID.split("::")
TENSORRT_NAMES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
                  TensorProto.INT8: "int8", TensorProto.INT32: "int32", TensorProto.INT64: "int64"}
RANKS = (3, 3, 3, 4, 4, 2, 1, 1)
# query = key = value; the pools; context_lens (block tables and query_start_loc int64)
GRID = list(itertools.product(
    [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT8],
    [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT8],
    [TensorProto.INT32, TensorProto.INT64, TensorProto.FLOAT]))


@pytest.fixture(scope="module")
def plugin():
    """The plugin object TensorRT's builder would hold, made by the registered creator."""
    pytest.importorskip("triton", reason="triton is not installed (the plugin's registration needs it)")
    from llmc.plugins import tensorrt_plugin

    try:
        stub = tensorrt_wheel.StubTensorRT(tensorrt_wheel.wheel_folder())
    except RuntimeError as exc:
        pytest.skip(str(exc))
    # The core's plugin field containers, as plain values (the parser fills them from the node).
    stub.overrides["PluginField"] = lambda name, data, type: types.SimpleNamespace(name=name, data=data, type=type)
    stub.overrides["PluginFieldCollection"] = list
    saved = {m: sys.modules.pop(m) for m in list(sys.modules) if m == "tensorrt" or m.startswith("tensorrt.")}
    sys.modules["tensorrt"] = stub
    tensorrt_plugin.register_plugin.cache_clear()
    try:
        tensorrt_plugin.register_plugin()
        creator = next(c for c, namespace in stub.registered if namespace == NAMESPACE)
        fields = [types.SimpleNamespace(name=f.name, data=np.array([{"scale": 0.125}.get(f.name, 0)],
                                                                   np.float32 if f.name != "window" else np.int32))
                  for f in creator.field_names]
        yield stub, creator.create_plugin(NAME, NAMESPACE, fields, stub.TensorRTPhase.BUILD,
                                          stub.QuickPluginCreationRequest.PREFER_AOT)
    finally:
        tensorrt_plugin.register_plugin.cache_clear()
        for name in [m for m in sys.modules if m == "tensorrt" or m.startswith("tensorrt.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _node_types(query, pool, lens):
    return (query,) * 3 + (pool,) * 2 + (TensorProto.INT64, lens, TensorProto.INT64)


@pytest.mark.parametrize("query, pool, lens", GRID)
def test_the_dry_run_refuses_exactly_what_the_plugin_refuses(plugin, query, pool, lens):
    trt, built = plugin
    element_types = _node_types(query, pool, lens)
    try:
        built.get_output_data_types([getattr(trt, TENSORRT_NAMES[t]) for t in element_types], list(RANKS))
        refused = None
    except LlmcError as exc:
        refused = str(exc)
    names = [f"in.{name}" for name in INPUT_NAMES]
    node = helper.make_node("PagedAttention", names, ["out"], name="paged.0", domain="llmc", scale=0.125)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, element_types)],
                              [helper.make_tensor_value_info("out", query, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("llmc", 1)])
    map_plugin_nodes(model)
    report = check_network(model)
    plugin_lines = [line for line in report.unsupported if "(paged_attention)" in line]
    assert bool(plugin_lines) == (refused is not None), (refused, report.unsupported)
    if refused:  # the same reason, in the plugin's words
        assert refused.split(": ", 1)[1].split(";")[0].replace("DataType.INT8", "int8") in plugin_lines[0]
