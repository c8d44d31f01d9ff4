"""attention-3d-layout: Attention and its rotaries read the 3-D projections directly."""

import copy

import onnx
from pass_testing import op_counts, run_pass

from llmc.compiler.pipeline import CLEANUP, optimize, refresh_shapes
from llmc.passes.attention_3d_layout import Attention3dLayout

# The level-1 cleanup first: the fusions match the folded graph (as level 2 runs them).
FUSED = [*CLEANUP, "fuse-rms-norm", "fuse-rotary", "fuse-attention"]


def fused_tiny_llama(path):
    model, _ = optimize(onnx.load(path), passes=FUSED)
    refresh_shapes(model)
    return model


def test_every_layer_drops_its_head_reshapes(tiny_llama_onnx):
    model = fused_tiny_llama(tiny_llama_onnx)
    before = op_counts(model)
    result = run_pass(Attention3dLayout(), model, tolerance=1e-5)
    after = op_counts(result.model)
    assert result.matches == 4
    assert after["Attention"] == 4 and after["RotaryEmbedding"] == 8
    # Per layer: Q, K, V lose Reshape + Transpose, the output loses Transpose + Reshape.
    assert before["Transpose"] - after["Transpose"] == 4 * 4
    assert before["Reshape"] - after["Reshape"] == 4 * 4
    for node in result.model.graph.node:
        if node.op_type == "Attention":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert (attrs["q_num_heads"], attrs["kv_num_heads"]) == (4, 2)
            assert list(node.output[1:]) == [o for o in node.output[1:] if o.startswith("present.")]
        if node.op_type == "RotaryEmbedding":
            assert {a.name for a in node.attribute} == {"num_heads"}


def test_attention_output_read_in_4d_is_converted_back(tiny_llama_onnx):
    model = fused_tiny_llama(tiny_llama_onnx)
    attention = next(n for n in model.graph.node if n.op_type == "Attention")
    # Another reader of the 4-D output: that layer's output is turned back to 4-D by a Reshape
    # and a Transpose, so every Attention is 3-D (the paged lowering needs it).
    model.graph.output.append(onnx.helper.make_tensor_value_info(
        attention.output[0], onnx.TensorProto.FLOAT, ["batch", 4, "sequence", 64]))
    refresh_shapes(model)
    result = run_pass(Attention3dLayout(), copy.deepcopy(model))
    assert result.matches == 4
    producer = next(n for n in result.model.graph.node if attention.output[0] in n.output)
    assert producer.op_type == "Transpose"
    for node in result.model.graph.node:
        if node.op_type == "Attention":
            assert {a.name for a in node.attribute} >= {"q_num_heads", "kv_num_heads"}


def test_split_heads_read_by_shape_nodes_still_go(tiny_llama_onnx):
    """Shape readers of the split-head values (fuse-rotary's batch of the rotary input,
    fuse-attention's key length from the new K) are computed from the 3-D tensors instead; their
    values are graph outputs here, so run_pass compares them with the input graph's."""
    model = fused_tiny_llama(tiny_llama_onnx)
    attention = next(n for n in model.graph.node if n.op_type == "Attention")
    rotary = next(n for n in model.graph.node if n.output[0] == attention.input[1])
    readers = [("batch", rotary.input[0], {"start": 0, "end": 1}), ("key", attention.input[1], {}),
               ("value", attention.input[2], {"start": -2})]
    for name, read, bounds in readers:
        model.graph.node.append(onnx.helper.make_node("Shape", [read], [f"shape_of_{name}"], **bounds))
        model.graph.output.append(onnx.helper.make_tensor_value_info(f"shape_of_{name}", onnx.TensorProto.INT64, [None]))
    refresh_shapes(model)
    before = op_counts(model)
    result = run_pass(Attention3dLayout(), model, tolerance=1e-5)
    after = op_counts(result.model)
    assert result.matches == 4
    # The split layout goes in every layer, the readers' layer included (no conversions added).
    assert before["Transpose"] - after["Transpose"] == 4 * 4
    assert all(n.input[0] not in {read for _, read, _ in readers} for n in result.model.graph.node)


def _bare_4d_attention(query_heads_known: bool) -> onnx.ModelProto:
    """Attention-23 on 4-D inputs that come straight from graph inputs: no head split to undo."""
    value = onnx.helper.make_tensor_value_info
    float_ = onnx.TensorProto.FLOAT
    heads = 4 if query_heads_known else "heads"
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Attention", ["q", "k", "v", "", "past_k", "past_v"],
                               ["out", "present_k", "present_v"], scale=0.25)], "g",
        [value("q", float_, ["batch", heads, "seq", 16]), value("k", float_, ["batch", 2, "seq", 16]),
         value("v", float_, ["batch", 2, "seq", 16]), value("past_k", float_, ["batch", 2, "past", 16]),
         value("past_v", float_, ["batch", 2, "past", 16])],
        [value("out", float_, ["batch", heads, "seq", 16]), value("present_k", float_, ["batch", 2, "total", 16]),
         value("present_v", float_, ["batch", 2, "total", 16])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 23)])
    refresh_shapes(model)
    return model


def test_any_4d_attention_gets_explicit_conversions():
    result = run_pass(Attention3dLayout(), _bare_4d_attention(query_heads_known=True), tolerance=1e-5)
    assert result.matches == 1
    counts = op_counts(result.model)
    # Q, K, V: Transpose + Reshape each; the output back to 4-D: Reshape + Transpose.
    assert (counts["Transpose"], counts["Reshape"]) == (4, 4)
    attention = next(n for n in result.model.graph.node if n.op_type == "Attention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
    assert (attrs["q_num_heads"], attrs["kv_num_heads"], attrs["scale"]) == (4, 2, 0.25)


def test_unknown_query_heads_come_from_the_caller_or_metadata_or_the_match_is_left():
    model = _bare_4d_attention(query_heads_known=False)
    assert Attention3dLayout().run(copy.deepcopy(model)).matches == 0
    # The seeded comparison feeds 2 for a symbolic dim, so the model must say 2 heads.
    assert run_pass(Attention3dLayout(num_heads=2), copy.deepcopy(model), tolerance=1e-5).matches == 1
    onnx.helper.set_model_props(model, {"llmc.num_heads": "2"})
    assert run_pass(Attention3dLayout(), model, tolerance=1e-5).matches == 1
