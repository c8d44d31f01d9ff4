"""Weight-only quantization: scales and codes by hand, round-trip error bounds, and onnxruntime's
MatMulNBits computing exactly A · dequantized(W)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from llmc.errors import LlmcError
from llmc.precision.weight_only import dequantize_blocks, pack, quantize_blocks, quantize_weights
from precision_graphs import matmul_model

RNG = np.random.default_rng(0)


def test_symmetric_scales_and_codes_by_hand():
    # One column, K = 4, blocks of 2. Block [1.2, -2]: the negative side is larger and gets the
    # extra level, so -2 = -8 steps, step 0.25, 1.2 → round(4.8) = 5. Block [0.5, 0.3]: positive,
    # so the scale is negative, 0.5 = -8 · (-0.5/8), 0.3 → round(-4.8) = -5.
    weight = np.array([[1.2], [-2.0], [0.5], [0.3]], np.float32)
    codes, scales, zeros = quantize_blocks(weight, bits=4, block_size=2, symmetric=True)
    np.testing.assert_allclose(scales, [[0.25, -0.5 / 8]], rtol=1e-6)
    assert zeros.tolist() == [[8, 8]]
    assert codes.tolist() == [[[8 + 5, 8 - 8], [8 - 8, 8 - 5]]]
    assert pack(codes, 4).tolist() == [[[13 | (0 << 4)], [0 | (3 << 4)]]]


def test_asymmetric_scales_and_codes_by_hand():
    # Block [1.2, -2]: range [-2, 1.2] in 15 steps of 3.2/15, zero point round(2 / step) = round(9.375) = 9.
    weight = np.array([[1.2], [-2.0], [0.5], [0.3]], np.float32)
    codes, scales, zeros = quantize_blocks(weight, bits=4, block_size=2, symmetric=False)
    np.testing.assert_allclose(scales, [[3.2 / 15, 0.5 / 15]], rtol=1e-6)
    assert zeros.tolist() == [[9, 0]]  # [0.5, 0.3]: the range starts at 0
    assert codes.tolist() == [[[9 + 6, 9 - 9], [15, 9]]]  # 1.2 / step = 5.6 → 6; 0.3 / step = 9


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [64, 70])  # 70: a last, partial block
def test_round_trip_error_is_at_most_half_a_step(bits, k, symmetric):
    weight = RNG.standard_normal((k, 24)).astype(np.float32)
    codes, scales, zeros = quantize_blocks(weight, bits, 32, symmetric)
    restored = dequantize_blocks(codes, scales, zeros, k)
    step = np.abs(np.repeat(scales, 32, axis=1)[:, :k].T)  # each weight's own block scale
    assert np.all(np.abs(restored - weight) <= step / 2 + 1e-6)
    # The bound is tight enough to mean something: relative error ~ 1/(2·(2^(bits-1)-1)).
    relative = np.abs(restored - weight).mean() / np.abs(weight).mean()
    assert relative < {4: 0.11, 8: 0.006}[bits]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_onnxruntime_matmulnbits_equals_the_dequantized_matmul(bits, symmetric):
    weight = RNG.standard_normal((96, 40)).astype(np.float32)
    model = matmul_model(weight)
    assert quantize_weights(model, bits, block_size=32, accuracy_level=0, symmetric=symmetric) == ["proj"]
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits"]
    assert not any(t.name == "w" for t in model.graph.initializer)  # the fp32 weight is gone
    a = RNG.standard_normal((1, 5, 96)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    expected = a @ dequantize_blocks(*quantize_blocks(weight, bits, 32, symmetric), 96)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_compute_stays_close_to_the_dequantized_matmul(bits):
    weight = RNG.standard_normal((96, 40)).astype(np.float32)
    model = matmul_model(weight)
    quantize_weights(model, bits, block_size=32)  # the default: int8 compute
    a = RNG.standard_normal((1, 5, 96)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    expected = a @ dequantize_blocks(*quantize_blocks(weight, bits, 32, symmetric=False), 96)
    # Activations rounded to int8 per block: relative error around 1/127 of each block's range.
    assert np.abs(got - expected).max() <= 0.02 * np.abs(expected).max()


def test_bad_settings_are_refused():
    with pytest.raises(LlmcError, match="int3"):
        quantize_weights(matmul_model(np.ones((4, 4), np.float32)), 3)
    with pytest.raises(LlmcError, match="--weights-block-size: 48"):
        quantize_weights(matmul_model(np.ones((4, 4), np.float32)), 4, block_size=48)
