"""Weight-only linears in TensorRT's form (DequantizeLinear → MatMul): the same weights as
MatMulNBits' where TensorRT's forms hold them (NumPy on the codes, and onnxruntime running both
graphs on the same input), int8 requantized per channel within its rounding bound otherwise, and
every emitted form one the dry run accepts (compiler/tensorrt_network.check_network)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmc.compiler.tensorrt_network import check_network
from llmc.errors import LlmcError
from llmc.passes import contrib_ops
from llmc.precision.dequantize_linear import matmulnbits_as_dequantize, signed_blocks
from llmc.precision.weight_only import pack, quantize_blocks, quantize_weights
from precision_graphs import matmul_model

RNG = np.random.default_rng(3)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_signed_codes_positive_scales_and_offsets_stand_for_the_same_weights(bits, symmetric):
    weight = RNG.standard_normal((64, 16)).astype(np.float32)
    weight[:32, 0] = 0  # a block of scale 0
    codes, scales, zeros = quantize_blocks(weight, bits, 32, symmetric)
    q, magnitudes, offsets = signed_blocks(codes, scales, zeros, bits)
    assert q.min() >= -(2 ** (bits - 1)) and q.max() <= 2 ** (bits - 1) - 1
    assert np.all(magnitudes > 0)
    reference = (codes.astype(np.float64) - zeros[..., None]) * scales[..., None]
    rebuilt = q.astype(np.float64) * magnitudes[..., None] + offsets[..., None]
    np.testing.assert_allclose(rebuilt, reference, rtol=0, atol=1e-6)
    if symmetric:
        assert np.any(scales < 0)  # the flipped case is exercised
    else:
        assert np.any(offsets != 0)


@pytest.mark.parametrize("k", [256, 200])  # 200: a partial last block, the input zero-padded
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block", [64, 128, 256])
def test_int4_blocks_tensorrt_takes_compute_what_matmulnbits_computes(block, symmetric, k):
    weight = RNG.standard_normal((k, 40)).astype(np.float32)
    model = matmul_model(weight)
    quantize_weights(model, 4, block_size=block, accuracy_level=0, symmetric=symmetric)  # 0: a float product
    a = RNG.standard_normal((1, 5, k)).astype(np.float32)
    expected = _run(model, a)
    assert matmulnbits_as_dequantize(model) == 1
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert "MatMulNBits" not in ops and ops.count("DequantizeLinear") == 1
    assert not any(o.domain == "com.microsoft" for o in model.opset_import)
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    assert len(dq.input) == 2  # no zero point: TensorRT quantizes symmetrically
    legal = min(block, 128)  # 256 is split into two blocks of 128, each with its scale
    assert helper.get_attribute_value(next(a for a in dq.attribute if a.name == "block_size")) == legal
    weights = {t.name: t for t in model.graph.initializer}
    whole = -(-k // legal) * legal
    assert weights[dq.input[0]].data_type == TensorProto.INT4
    assert list(weights[dq.input[0]].dims) == [whole, 40] and list(weights[dq.input[1]].dims) == [whole // legal, 40]
    np.testing.assert_allclose(_run(model, a), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert check_network(model).ok, check_network(model).unsupported


def test_int4_blocks_of_32_merge_only_where_their_scales_agree():
    k, n = 128, 8
    codes = RNG.integers(0, 16, (n, k // 32, 32), dtype=np.uint8)
    shared = np.repeat(RNG.uniform(0.01, 0.1, (n, k // 64)).astype(np.float32), 2, axis=1)  # pairs agree
    model = _matmulnbits_model(codes, shared, bits=4, block=32, k=k)
    a = RNG.standard_normal((1, 3, k)).astype(np.float32)
    expected = _run(model, a)
    matmulnbits_as_dequantize(model)
    dq = next(node for node in model.graph.node if node.op_type == "DequantizeLinear")
    assert helper.get_attribute_value(next(a for a in dq.attribute if a.name == "block_size")) == 64
    np.testing.assert_allclose(_run(model, a), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())

    weight = RNG.standard_normal((k, n)).astype(np.float32)
    model = matmul_model(weight)
    quantize_weights(model, 4, block_size=32)
    with pytest.raises(LlmcError, match=r"node proj: int4 weights in blocks of 32; .* --weights-block-size 64\|128"):
        matmulnbits_as_dequantize(model)


def test_int8_with_one_scale_per_column_stays_exact_per_channel():
    k, n = 96, 8
    codes = RNG.integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
    scales = np.repeat(RNG.uniform(0.001, 0.01, (n, 1)).astype(np.float32), k // 32, axis=1)
    model = _matmulnbits_model(codes, scales, bits=8, block=32, k=k)
    a = RNG.standard_normal((1, 4, k)).astype(np.float32)
    expected = _run(model, a)
    said = []
    matmulnbits_as_dequantize(model, said.append)
    assert said == []  # exact: nothing requantized
    _assert_per_channel(model, k, n)
    np.testing.assert_allclose(_run(model, a), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_blocks_are_requantized_per_channel_within_its_rounding(symmetric):
    k, n = 160, 24
    weight = RNG.standard_normal((k, n)).astype(np.float32)
    model = matmul_model(weight)
    quantize_weights(model, 8, block_size=32, accuracy_level=0, symmetric=symmetric)
    node = next(node for node in model.graph.node if node.op_type == "MatMulNBits")
    blocked = _dequantized(model, node, k, n)  # what MatMulNBits multiplies by
    a = RNG.standard_normal((1, 6, k)).astype(np.float32)
    said = []
    matmulnbits_as_dequantize(model, said.append)
    assert len(said) == 1 and "requantized per output channel" in said[0] and "proj" in said[0]
    _assert_per_channel(model, k, n)
    # Each weight moves by at most half a step of its column's scale, max|W[:, n]| / 127.
    steps = np.abs(blocked).max(axis=0) / 127
    bound = 0.5 * np.abs(a[0]) @ np.broadcast_to(steps, (k, n)) + 1e-4
    got, exact = _run(model, a)[0], a[0] @ blocked
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) - bound)
    assert np.max(np.abs(got - exact)) > 0  # requantized, not the same weights


def _assert_per_channel(model, k, n):
    dq = next(node for node in model.graph.node if node.op_type == "DequantizeLinear")
    weights = {t.name: t for t in model.graph.initializer}
    assert weights[dq.input[0]].data_type == TensorProto.INT8 and list(weights[dq.input[0]].dims) == [k, n]
    assert list(weights[dq.input[1]].dims) == [n]
    assert helper.get_attribute_value(next(a for a in dq.attribute if a.name == "axis")) == 1
    assert not any(a.name == "block_size" for a in dq.attribute)
    assert check_network(model).ok, check_network(model).unsupported


def _matmulnbits_model(codes: np.ndarray, scales: np.ndarray, bits: int, block: int, k: int) -> onnx.ModelProto:
    """One MatMulNBits from codes [N, blocks, block] and scales [N, blocks], zero points the default."""
    contrib_ops.register()
    n = codes.shape[0]
    node = helper.make_node("MatMulNBits", ["a", "b", "scales"], ["y"], name="proj", domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, "t", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "t", n])],
                              [numpy_helper.from_array(pack(codes, bits), "b"),
                               numpy_helper.from_array(scales.reshape(-1), "scales")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def _dequantized(model, node, k, n) -> np.ndarray:
    """The [K, N] weights a MatMulNBits node stands for, by NumPy (its product at accuracy level 0)."""
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    block = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "block_size")
    codes = weights[node.input[1]].reshape(n, -1, block).astype(np.float64)
    scales = weights[node.input[2]].reshape(n, -1)
    zeros = weights[node.input[3]].reshape(n, -1) if len(node.input) > 3 else np.full_like(scales, 128)
    return ((codes - zeros[..., None]) * scales[..., None]).reshape(n, -1)[:, :k].T


def _run(model, a):
    # No graph optimizations: onnxruntime would fuse DequantizeLinear → MatMul into its own
    # MatMulNBits at accuracy level 4 (int8 activations), not the graph's float product.
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"a": a})[0]
