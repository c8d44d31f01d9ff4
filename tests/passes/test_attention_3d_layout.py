"""attention-3d-layout: Attention and its rotaries read the 3-D projections directly."""

import copy

import onnx
from pass_testing import op_counts, run_pass

from llmc.compiler.pipeline import optimize, refresh_shapes
from llmc.passes.attention_3d_layout import Attention3dLayout

FUSED = ["fuse-rms-norm", "fuse-rotary", "fuse-attention"]


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


def test_attention_output_read_in_4d_is_left_alone(tiny_llama_onnx):
    model = fused_tiny_llama(tiny_llama_onnx)
    attention = next(n for n in model.graph.node if n.op_type == "Attention")
    # Another reader of the 4-D output: the layout can no longer change.
    model.graph.output.append(onnx.helper.make_tensor_value_info(
        attention.output[0], onnx.TensorProto.FLOAT, ["batch", 4, "sequence", 64]))
    refresh_shapes(model)
    result = run_pass(Attention3dLayout(), copy.deepcopy(model))
    assert result.matches == 3
    assert attention.output[0] in {n.output[0] for n in result.model.graph.node if n.op_type == "Attention"}
