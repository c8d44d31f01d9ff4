"""Weight-only linears in TensorRT's form (DequantizeLinear block-wise → MatMul): the same weights
as MatMulNBits' — by NumPy on the codes, and onnxruntime running both graphs on the same input."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from llmc.precision.dequantize_linear import matmulnbits_as_dequantize, signed_blocks
from llmc.precision.weight_only import quantize_blocks, quantize_weights
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


@pytest.mark.parametrize("k", [96, 88])  # 88: a partial last block, the input zero-padded
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_form_computes_what_matmulnbits_computes(bits, symmetric, k):
    weight = RNG.standard_normal((k, 40)).astype(np.float32)
    model = matmul_model(weight)
    quantize_weights(model, bits, block_size=32, accuracy_level=0, symmetric=symmetric)  # 0: a float product
    a = RNG.standard_normal((1, 5, k)).astype(np.float32)
    expected = _run(model, a)
    assert matmulnbits_as_dequantize(model) == 1
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert "MatMulNBits" not in ops and ops.count("DequantizeLinear") == 1 and ops.count("Pad") == (k == 88)
    assert not any(o.domain == "com.microsoft" for o in model.opset_import)
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    assert len(dq.input) == 2  # no zero point: TensorRT quantizes symmetrically
    weights = {t.name: t for t in model.graph.initializer}
    assert weights[dq.input[0]].data_type == (TensorProto.INT4 if bits == 4 else TensorProto.INT8)
    assert list(weights[dq.input[0]].dims) == [96, 40] and list(weights[dq.input[1]].dims) == [3, 40]  # whole blocks
    got = _run(model, a)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def _run(model, a):
    # No graph optimizations: onnxruntime would fuse DequantizeLinear → MatMul into its own
    # MatMulNBits at accuracy level 4 (int8 activations), not the graph's float product.
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"a": a})[0]
