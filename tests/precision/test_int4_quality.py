"""int4 quality: asymmetric blocks and activation-aware scaling (AWQ), each against an independent
NumPy reference."""

import copy

import numpy as np
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from llmc.precision import awq
from llmc.precision.calibration import observe
from llmc.precision.linears import linear_layers
from llmc.precision.weight_only import dequantize_blocks, fake_quantize, quantize_blocks, quantize_weights
from llmc.formats.onnx_io import tensor_array
from precision_graphs import logits, matmul_model

RNG = np.random.default_rng(0)


def _reference_dequantize(weight, bits, block_size, symmetric):
    """Min-max block quantization written out block by block, apart from the module's code."""
    k, n = weight.shape
    out = np.zeros_like(weight)
    levels = 2 ** bits - 1
    for column in range(n):
        for start in range(0, k, block_size):
            w = weight[start:start + block_size, column]
            if symmetric:  # 2^bits levels, the extra one on the side whose step is then smaller
                half, top, bottom = 2 ** (bits - 1), max(w.max(), 0.0), max(-w.min(), 0.0)
                negative_side = max(bottom / half, top / (half - 1))   # codes -half .. half-1
                positive_side = max(top / half, bottom / (half - 1))   # codes -(half-1) .. half
                if negative_side <= positive_side:
                    step, q = negative_side, np.clip(np.rint(w / negative_side), -half, half - 1)
                else:
                    step, q = positive_side, np.clip(np.rint(w / positive_side), -(half - 1), half)
                out[start:start + block_size, column] = q * step
            else:
                lo, hi = min(w.min(), 0.0), max(w.max(), 0.0)
                step = (hi - lo) / levels
                zero = np.clip(np.rint(-lo / step), 0, levels)
                out[start:start + block_size, column] = (np.clip(np.rint(w / step) + zero, 0, levels) - zero) * step
    return out


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [64, 70])  # 70: a last, partial block
def test_codes_match_the_reference_and_round_trip_within_half_a_step(symmetric, bits, k):
    weight = (RNG.standard_normal((k, 24)) + RNG.uniform(-1, 1, (1, 24))).astype(np.float32)  # some all-positive blocks
    codes, scales, zeros = quantize_blocks(weight, bits, 32, symmetric)
    assert codes.max() <= 2 ** bits - 1 and zeros.max() <= 2 ** bits - 1
    restored = dequantize_blocks(codes, scales, zeros, k)
    np.testing.assert_allclose(restored, _reference_dequantize(weight, bits, 32, symmetric), atol=1e-6)
    step = np.abs(np.repeat(scales, 32, axis=1)[:, :k].T)
    assert np.all(np.abs(restored - weight) <= step / 2 + 1e-6)


def test_asymmetric_blocks_use_the_whole_range():
    # A block of positive weights: symmetric spends half its 16 levels on negatives it never holds.
    weight = np.linspace(0.1, 1.0, 32, dtype=np.float32)[:, None]
    errors = {sym: np.abs(fake_quantize(weight, 4, 32, sym) - weight).max() for sym in (True, False)}
    assert errors[False] <= 1.0 / 15 / 2 + 1e-6  # half of the asymmetric step (0..1 in 15 steps)
    assert errors[False] < 0.6 * errors[True]


@pytest.mark.parametrize("k", [96, 80])  # 80: three blocks, so the zero points' last byte is half padding
def test_onnxruntime_reads_asymmetric_weights_as_numpy_does(k):
    weight = (RNG.standard_normal((k, 40)) + 0.7).astype(np.float32)
    model = matmul_model(weight)
    quantize_weights(model, 4, block_size=32, accuracy_level=0, symmetric=False)
    node = model.graph.node[0]
    assert node.op_type == "MatMulNBits" and len(node.input) == 4
    # Unpack B and zero_points from the initializers by the contrib op's documented layout.
    arrays = {t.name: tensor_array(t) for t in model.graph.initializer}
    packed, scales, zeros = arrays[node.input[1]], arrays[node.input[2]], arrays[node.input[3]]
    blocks = -(-k // 32)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(40, blocks * 32).astype(np.float32)
    zero = np.stack([zeros & 15, zeros >> 4], axis=-1).reshape(40, -1)[:, :blocks].astype(np.float32)
    dequantized = ((codes - np.repeat(zero, 32, axis=1)) * np.repeat(scales.reshape(40, blocks), 32, axis=1))[:, :k].T
    np.testing.assert_allclose(dequantized, _reference_dequantize(weight, 4, 32, False), atol=1e-6)
    a = RNG.standard_normal((1, 5, k)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    np.testing.assert_allclose(got, a @ dequantized, rtol=1e-4, atol=1e-4)


# Activation-aware scaling on the tiny llama (level 2: fused attention, merged q/k/v and gate/up).

def _with_outlier_channels(level2, factor=100.0):
    """level2 with input channels 3 and 5 of every norm-fed layer scaled up by `factor` in the norm
    and down in the weights: the same float function, with the activation outliers AWQ is for."""
    model = copy.deepcopy(level2)
    weights = {t.name: t for t in model.graph.initializer}
    readers = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    for norm in [n for n in model.graph.node if n.op_type == "RMSNormalization"]:
        gamma = tensor_array(weights[norm.input[1]]).copy()
        gamma[[3, 5]] *= factor
        norm.input[1] = f"{norm.output[0]}.outlier_gamma"
        model.graph.initializer.append(numpy_helper.from_array(gamma, norm.input[1]))
        for matmul in readers[norm.output[0]]:
            w = tensor_array(weights[matmul.input[1]]).copy()
            w[[3, 5]] /= factor
            weights[matmul.input[1]].CopyFrom(numpy_helper.from_array(w, matmul.input[1]))
    return model


def _stats(model, windows):
    names = sorted({l.node.input[0] for l in linear_layers(model)})
    return observe(model, windows, names, histograms=False, sample_rows=256)


def test_scaling_keeps_the_float_function(level2, monkeypatch):
    model = _with_outlier_channels(level2)
    stats = _stats(model, [RNG.integers(3, 258, 64)])
    monkeypatch.setattr(awq, "EXPONENTS", (0.5,))  # forced: every foldable input is scaled
    nodes = [l.node for l in linear_layers(model)]
    chosen = awq.scale_inputs(model, nodes, stats, lambda w: fake_quantize(w, 4, 32))
    layers = len([n for n in model.graph.node if n.op_type == "Attention"])
    # per layer: q/k/v and gate/up (norms), down (up's columns), o (V's columns); lm_head (final norm)
    assert len(chosen) == 4 * layers + 1 and all(e == 0.5 for e, _ in chosen.values())
    assert not any(np.allclose(s, 1.0) for _, s in chosen.values())
    ids = RNG.integers(3, 258, 20)
    np.testing.assert_allclose(logits(model, ids), logits(level2, ids), atol=2e-4, rtol=1e-4)


def test_each_chosen_scale_is_no_worse_than_none_on_its_rows(level2):
    model = _with_outlier_channels(level2)
    stats = _stats(model, [RNG.integers(3, 258, 64) for _ in range(2)])
    original = {t.name: tensor_array(t).copy() for t in model.graph.initializer}
    groups = {}
    for l in linear_layers(model):
        groups.setdefault(l.node.input[0], []).append(original[l.weight])
    quantize = lambda w: fake_quantize(w, 4, 32)  # noqa: E731
    chosen = awq.scale_inputs(model, [l.node for l in linear_layers(model)], stats, quantize)
    assert any(e > 0 for e, _ in chosen.values())
    for x, (_, s) in chosen.items():
        rows, weight = stats[x].sample, np.concatenate(groups[x], axis=1)
        error = lambda s: np.square(rows @ weight - (rows / s) @ quantize(weight * s[:, None])).sum()  # noqa: E731
        assert error(s) <= error(np.ones_like(s)) * (1 + 1e-6), x


def test_activation_aware_int4_beats_plain_rounding_on_outlier_channels(level2):
    rng = np.random.default_rng(0)  # its own: the margin depends on the data (ratios 0.67 to 0.89 over seeds 0-3)
    model = _with_outlier_channels(level2)
    stats = _stats(model, [rng.integers(3, 258, 64) for _ in range(4)])
    ids = rng.integers(3, 258, 48)
    exact = logits(model, ids)
    seeded = {n.output[0] for n in model.graph.node if n.op_type == "RMSNormalization"}
    errors = {}
    for label, activations in (("plain", None), ("aware", stats)):
        trial = copy.deepcopy(model)
        # only the layers reading the seeded outliers: the others' rounding error would dilute the comparison
        done = quantize_weights(trial, 4, 32, accuracy_level=0, activations=activations,
                                select=lambda node: node.input[0] in seeded)
        assert len(done) == len(seeded)  # merged q/k/v and gate/up per layer, and lm_head
        errors[label] = float(np.abs(logits(trial, ids) - exact).mean())
    assert errors["aware"] < 0.9 * errors["plain"], errors
