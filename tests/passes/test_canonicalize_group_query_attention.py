"""canonicalize-gqa: onnxruntime's GroupQueryAttention (genai's builder) → Attention-23.

The graphs are built in code the way onnxruntime-genai's builder writes one layer: a packed QKV
input, seqlens_k and total_sequence_length computed from attention_mask, rotary inside the op
from cos/sin caches. Parity is against onnxruntime running the unmodified graph (its own GQA
kernel), on the shapes that kernel accepts (a prompt over a past for one sequence; decode steps
and first prompts for a batch).
"""

import copy

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from pass_testing import op_counts

from llmc.compiler.compare import compare_outputs, run_onnx
from llmc.compiler.pipeline import refresh_shapes
from llmc.errors import LlmcError
from llmc.passes.canonicalize_group_query_attention import CanonicalizeGroupQueryAttention

H, KV, D, MAX_POS = 4, 2, 32, 64  # D 32: a half-rotary cos cache is then 8 wide, as GQA requires


def gqa_model(*, rotary_dim: int = D, window: int = -1, past_through_identity: bool = False,
              **extra_attributes) -> onnx.ModelProto:
    """One genai-style GQA layer: qkv [B, S, (H + 2·KV)·D] → out [B, S, H·D], present K/V."""
    value = helper.make_tensor_value_info
    inputs = [value("qkv", TensorProto.FLOAT, ["batch", "seq", (H + 2 * KV) * D]),
              value("attention_mask", TensorProto.INT64, ["batch", "total"])]
    inputs += [value(f"past_key_values.0.{part}", TensorProto.FLOAT, ["batch", KV, "past", "head"])
               for part in ("key", "value")]
    outputs = [value("out", TensorProto.FLOAT, ["batch", "seq", H * D])]
    outputs += [value(f"present.0.{part}", TensorProto.FLOAT, ["batch", KV, "total", "head"])
                for part in ("key", "value")]
    inv = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.outer(np.arange(MAX_POS), inv)
    initializers = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
                    numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache"),
                    numpy_helper.from_array(np.array([1], np.int64), "one"),
                    numpy_helper.from_array(np.array(1, np.int64), "one_scalar")]
    past = ["past_key_values.0.key", "past_key_values.0.value"]
    nodes = [helper.make_node("ReduceSum", ["attention_mask", "one"], ["lengths"], keepdims=0),
             helper.make_node("Sub", ["lengths", "one"], ["last"]),
             helper.make_node("Cast", ["last"], ["seqlens_k"], to=TensorProto.INT32),
             helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
             helper.make_node("Gather", ["mask_shape", "one_scalar"], ["total"], axis=0),
             helper.make_node("Cast", ["total"], ["total_sequence_length"], to=TensorProto.INT32)]
    if past_through_identity:  # the cache is not the graph's input itself
        nodes += [helper.make_node("Identity", [name], [f"{name}.copy"]) for name in past]
        past = [f"{name}.copy" for name in past]
    nodes.append(helper.make_node(
        "GroupQueryAttention", ["qkv", "", "", *past, "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"],
        ["out", "present.0.key", "present.0.value"], domain="com.microsoft", num_heads=H, kv_num_heads=KV,
        scale=D ** -0.5, local_window_size=window, do_rotary=1, rotary_interleaved=0, **extra_attributes))
    graph = helper.make_graph(nodes, "gqa", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    refresh_shapes(model)
    return model


def feeds(batch: int, seq: int, past: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"qkv": rng.standard_normal((batch, seq, (H + 2 * KV) * D)).astype(np.float32),
            "attention_mask": np.ones((batch, past + seq), np.int64),
            "past_key_values.0.key": rng.standard_normal((batch, KV, past, D)).astype(np.float32),
            "past_key_values.0.value": rng.standard_normal((batch, KV, past, D)).astype(np.float32)}


def test_structure():
    result = CanonicalizeGroupQueryAttention().run(gqa_model())
    assert result.matches == 1
    onnx.checker.check_model(result.model)
    onnx.shape_inference.infer_shapes(result.model, strict_mode=True)
    counts = op_counts(result.model)
    assert counts["com.microsoft.GroupQueryAttention"] == 0
    assert (counts["Attention"], counts["RotaryEmbedding"], counts["Split"]) == (1, 2, 1)
    attention = next(n for n in result.model.graph.node if n.op_type == "Attention")
    assert list(attention.input[4:]) == ["past_key_values.0.key", "past_key_values.0.value"]
    assert list(attention.output) == ["out", "present.0.key", "present.0.value"]
    attributes = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
    assert (attributes["q_num_heads"], attributes["kv_num_heads"]) == (H, KV)
    assert attributes["scale"] == pytest.approx(D ** -0.5)
    # Rotary at positions computed from the mask, in a value the paged lowering replaces.
    rotary = [n for n in result.model.graph.node if n.op_type == "RotaryEmbedding"]
    assert {n.input[3] for n in rotary} == {"position_ids"}
    assert [i.name for i in result.model.graph.input] == ["qkv", "attention_mask", "past_key_values.0.key",
                                                          "past_key_values.0.value"]
    # The symbolic head size is pinned where the lowering reads it.
    past = result.model.graph.input[2].type.tensor_type.shape.dim
    assert past[3].dim_value == D


@pytest.mark.parametrize("batch,seq,past", [(1, 3, 5), (2, 1, 6), (2, 4, 0), (1, 1, 0)],
                         ids=["prompt-over-past", "decode-batch", "first-prompt-batch", "first-token"])
@pytest.mark.parametrize("variant", ["full", "window-2", "partial-rotary"])
def test_outputs_equal_onnxruntime_gqa(variant, batch, seq, past):
    model = gqa_model(window=2 if variant == "window-2" else -1,
                      rotary_dim=D // 2 if variant == "partial-rotary" else D)
    result = CanonicalizeGroupQueryAttention().run(copy.deepcopy(model))
    assert result.matches == 1
    onnx.checker.check_model(result.model)
    inputs = feeds(batch, seq, past)
    comparison = compare_outputs(run_onnx(model, inputs), run_onnx(result.model, inputs))
    assert comparison.max_abs < 1e-5, comparison


@pytest.mark.parametrize("model", [gqa_model(past_through_identity=True), gqa_model(smooth_softmax=1)],
                         ids=["cache-not-a-graph-input", "smooth-softmax"])
def test_left_alone(model):
    before = op_counts(model)
    result = CanonicalizeGroupQueryAttention().run(copy.deepcopy(model))
    assert result.matches == 0 and op_counts(result.model) == before
    assert [i.name for i in result.model.graph.input] == [i.name for i in model.graph.input]
    inputs = feeds(1, 3, 5)
    assert compare_outputs(run_onnx(model, inputs), run_onnx(result.model, inputs)).max_abs == 0


def test_ring_buffer_cache_is_an_error_naming_the_node():
    model = gqa_model(window=4, sliding_window_cache=1)
    model.graph.node[-1].name = "layers.0/attn/GQA"
    with pytest.raises(LlmcError, match="node 'layers.0/attn/GQA'.*sliding_window_cache=1"):
        CanonicalizeGroupQueryAttention().run(model)


def test_a_position_ids_input_is_used():
    model = gqa_model()
    model.graph.input.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]))
    result = CanonicalizeGroupQueryAttention().run(copy.deepcopy(model))
    assert result.matches == 1
    assert "position_ids" not in {name for n in result.model.graph.node for name in n.output}
    inputs = {**feeds(1, 3, 5), "position_ids": np.arange(5, 8)[None]}
    assert compare_outputs(run_onnx(model, inputs), run_onnx(result.model, inputs)).max_abs < 1e-5
