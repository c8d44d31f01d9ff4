"""int8: calibrator thresholds by hand, Q/DQ placement (static and per-token), per-token
quantization against NumPy, SmoothQuant keeping the float function and never adding error."""

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from llmc.formats.onnx_io import serialize, tensor_array
from llmc.formats.sessions import open_session, session_options
from llmc.errors import LlmcError
from llmc.precision.calibration import BINS, TensorStats, check_calibrator, entropy_bins, observe, prefill_feeds, threshold
from llmc.precision.int8 import activation_groups, choose_smoothing, output_error, quantize_int8, write_qdq
from llmc.precision.linears import linear_layers
from precision_graphs import logits

RNG = np.random.default_rng(0)


def test_minmax_and_percentile_thresholds_by_hand():
    stats = TensorStats(absmax=4.0)
    assert threshold(stats, "minmax") == 4.0
    # 10,000 values: 9,999 in the first bin, one at the top. The 99.99th percentile is the first bin's edge.
    stats.histogram[0], stats.histogram[-1] = 9_999, 1
    assert threshold(stats, "percentile") == pytest.approx(4.0 / BINS)


def test_entropy_clips_a_lone_outlier_but_keeps_a_wide_distribution():
    wide = np.full(BINS, 100, np.int64)  # |x| uniform up to the max: clipping loses information
    assert entropy_bins(wide) == BINS
    peaked = np.zeros(BINS, np.int64)
    peaked[:200] = RNG.integers(1000, 2000, 200)  # mass near zero, one far outlier
    peaked[-1] = 1
    assert 128 <= entropy_bins(peaked) < BINS // 4


def test_too_little_data_and_unknown_calibrators_are_refused():
    with pytest.raises(LlmcError, match="entropy calibrator needs at least 512"):
        check_calibrator("entropy", 100)
    with pytest.raises(LlmcError, match="'kl' is not one of minmax, percentile, entropy"):
        check_calibrator("kl", 10_000)


def test_qdq_placement(level2):
    model = copy.deepcopy(level2)
    linears = linear_layers(model)
    windows = [RNG.integers(3, 258, 32) for _ in range(2)]
    groups = quantize_int8(model, linears, windows, "minmax")
    onnx.checker.check_model(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: tensor_array(t) for t in model.graph.initializer}
    per_token = {l.name for g in groups if g.per_token for l in g.layers}
    assert per_token == {l.name for l in linears if l.name.endswith("mlp.down")} != set()
    thresholds = {g.input: g.threshold for g in groups}
    for layer in linears:
        x, w = layer.node.input
        dq_w, dq_x = producer[w], producer[x]
        # Weights: int8, per output channel (axis 1), symmetric.
        assert dq_w.op_type == "DequantizeLinear" and inits[dq_w.input[0]].dtype == np.int8
        assert next(a.i for a in dq_w.attribute if a.name == "axis") == 1
        assert inits[dq_w.input[1]].shape == (inits[dq_w.input[0]].shape[1],)
        assert not inits[dq_w.input[2]].any()
        q = producer[dq_x.input[0]]
        assert (dq_x.op_type, q.op_type) == ("DequantizeLinear", "QuantizeLinear")
        if layer.name in per_token:  # scale computed from the row: blocked over the whole last axis
            assert q.input[1] not in inits and producer[q.input[1]].op_type == "Max"
            assert next(a.i for a in q.attribute if a.name == "block_size") == inits[w.replace(".dq", "")].shape[0]
        else:  # per tensor, scale = threshold / 127, zero point 0
            assert inits[q.input[1]].shape == () and inits[q.input[2]] == 0
            assert inits[q.input[1]] == pytest.approx(thresholds[q.input[0]] / 127)
    assert len(groups) == len({l.node.input[0] for l in linears})  # one pair per activation


def test_per_token_quantization_matches_numpy(level2):
    model = copy.deepcopy(level2)
    layer = linear_layers(model)[0]
    x_name = layer.node.input[0]
    write_qdq(model, [layer], {x_name: None})
    model.graph.output.extend([onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                               for n in (x_name, f"{x_name}.int8.dq")])
    session = ort.InferenceSession(serialize(model)["model.onnx"], providers=["CPUExecutionProvider"])
    x, dq = session.run([x_name, f"{x_name}.int8.dq"], prefill_feeds(session, RNG.integers(3, 258, 24)))
    step = np.abs(x).max(axis=-1, keepdims=True) / 127
    np.testing.assert_allclose(dq, np.clip(np.rint(x / step), -127, 127) * step, rtol=1e-6, atol=1e-7)
    assert np.abs(dq - x).max(axis=-1).max() <= 0.5 * step.max() * (1 + 1e-5)  # within half a step per row


def test_dynamic_mode_needs_no_calibration(level2):
    model = copy.deepcopy(level2)
    groups = quantize_int8(model, linear_layers(model), [], "minmax", dynamic=True)
    assert all(g.per_token and g.threshold is None for g in groups)
    ids = RNG.integers(3, 258, 20)
    exact, quantized = logits(level2, ids), logits(model, ids)
    assert np.abs(quantized - exact).max() < 0.05 * np.abs(exact).max()
    with pytest.raises(LlmcError, match="static int8 needs calibration data"):
        quantize_int8(copy.deepcopy(level2), linear_layers(level2), [], "minmax")


def _with_outlier_channel(level2, factor=64.0):
    """level2 with one input channel of every norm-fed layer scaled up by `factor` in the norm and
    down in the weights: the same float function, the outliers SmoothQuant exists for."""
    model = copy.deepcopy(level2)
    weights = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    for group in activation_groups(linear_layers(model), dynamic=False):
        norm = producer[group.input]
        if norm.op_type != "RMSNormalization":
            continue
        gamma = tensor_array(weights[norm.input[1]]).copy()
        gamma[5] *= factor
        own = f"{group.input}.outlier_gamma"
        model.graph.initializer.append(numpy_helper.from_array(gamma, own))
        norm.input[1] = own
        for layer in group.layers:
            w = tensor_array(weights[layer.weight]).copy()
            w[5] /= factor
            weights[layer.weight].CopyFrom(numpy_helper.from_array(w, layer.weight))
    return model


def test_smoothquant_keeps_the_float_function(level2):
    model = _with_outlier_channel(level2)
    groups = activation_groups(linear_layers(model), dynamic=False)
    names = [g.input for g in groups]
    stats = observe(model, [RNG.integers(3, 258, 32)], names, histograms=False, sample_rows=32)
    smoothed = choose_smoothing(model, groups, stats, alphas=(0.5,))  # forced: every foldable activation
    assert smoothed == len(groups) == 4 * 4 + 1  # per layer: two norms, gate·up, attention (o); the final norm
    ids = RNG.integers(3, 258, 20)
    np.testing.assert_allclose(logits(model, ids), logits(level2, ids), atol=2e-4, rtol=1e-4)


def test_smoothquant_never_adds_error_and_helps_outliers(level2):
    model = _with_outlier_channel(level2)
    windows = [RNG.integers(3, 258, 64) for _ in range(4)]
    ids = RNG.integers(3, 258, 48)
    exact = logits(model, ids)
    errors = {}
    for label, alpha in (("off", 0.0), ("searched", None)):
        trial = copy.deepcopy(model)
        groups = quantize_int8(trial, linear_layers(trial), windows, "minmax", smoothquant=alpha)
        errors[label] = float(np.abs(logits(trial, ids) - exact).mean())
        if alpha is None:  # each activation's chosen strength is no worse than none, on its own rows
            stats = observe(model, windows, [g.input for g in groups], histograms=False, sample_rows=512)
            weights = {t.name: tensor_array(t) for t in model.graph.initializer}
            for g in groups:
                rows, x_max = stats[g.input].sample, stats[g.input].channel_absmax
                unsmoothed = output_error(rows, [weights[l.weight] for l in g.layers], np.ones_like(x_max),
                                          None if g.per_token else float(x_max.max()))
                assert g.error <= unsmoothed * (1 + 1e-6), g.input
    assert errors["searched"] < 0.7 * errors["off"], errors


def test_per_token_layers_become_matmulnbits_with_the_same_weights(level2):
    from llmc.precision.int8 import lower_per_token_for_onnxruntime

    model = copy.deepcopy(level2)
    quantize_int8(model, linear_layers(model), [], "minmax", dynamic=True)
    qdq = copy.deepcopy(model)
    assert lower_per_token_for_onnxruntime(model) == len(linear_layers(level2))
    ops = {n.op_type for n in model.graph.node}
    assert "MatMulNBits" in ops and not ops & {"QuantizeLinear", "DequantizeLinear", "ReduceMax"}
    # Same weights code for code; activations now quantized per block of 32 instead of per row.
    ids = RNG.integers(3, 258, 20)
    exact, lowered, reference = logits(level2, ids), logits(model, ids), logits(qdq, ids)
    scale = np.abs(exact).max()
    assert np.abs(lowered - reference).max() < 0.02 * scale
    assert np.abs(lowered - exact).max() < 0.05 * scale


@pytest.mark.parametrize("outliers", ["static", "int8-weights"])
def test_outlier_layers_in_a_form_without_run_time_scales(level2, outliers):
    """TensorRT's forms of the down projections: static scales like the rest, or float
    activations with the same per-channel int8 weights; no scale is computed at run time."""
    model = copy.deepcopy(level2)
    linears = linear_layers(model)
    windows = [RNG.integers(3, 258, 32) for _ in range(2)]
    groups = quantize_int8(model, linears, windows, "minmax", smoothquant=0.0, outliers=outliers)
    onnx.checker.check_model(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: tensor_array(t) for t in model.graph.initializer}
    assert not any(g.per_token for g in groups)
    for layer in linears:
        x, w = layer.node.input
        assert producer[w].op_type == "DequantizeLinear" and inits[producer[w].input[0]].dtype == np.int8
        down = layer.name.endswith("mlp.down")
        if down and outliers == "int8-weights":  # float activation: fed straight from its producer
            assert x not in producer or producer[x].op_type != "DequantizeLinear"
        else:  # a static pair: the scale is an initializer
            assert producer[x].op_type == "DequantizeLinear" and producer[x].input[1] in inits
    # Weight-only layers compute x @ dequantized W exactly: compare with NumPy on the graph's own values.
    down = next(l for l in linears if l.name.endswith("mlp.down"))
    if outliers == "int8-weights":
        weight_dq = producer[down.node.input[1]]
        codes, scale = inits[weight_dq.input[0]], inits[weight_dq.input[1]]
        model.graph.output.extend([onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                                   for n in (down.node.input[0], down.node.output[0])])
        session = open_session(serialize(model), session_options(float_weight_products=True))
        x, y = session.run([down.node.input[0], down.node.output[0]], prefill_feeds(session, RNG.integers(3, 258, 16)))
        np.testing.assert_allclose(y, x @ (codes.astype(np.float32) * scale), rtol=1e-4, atol=1e-5)
    ids = RNG.integers(3, 258, 20)
    exact, quantized = logits(level2, ids), logits(model, ids)
    assert np.abs(quantized - exact).max() < 0.05 * np.abs(exact).max()


def test_per_token_layers_lower_to_matmulnbits_under_fp16(level2):
    """--fp16 with per-token int8: the activation is computed in fp16 and cast for the quantizer;
    MatMulNBits (fp32 scales) must read the fp32 value, or onnxruntime refuses the graph."""
    from llmc.precision.fp16 import convert_to_fp16
    from llmc.precision.int8 import lower_per_token_for_onnxruntime

    model = copy.deepcopy(level2)
    quantize_int8(model, linear_layers(model), [], "minmax", dynamic=True)
    assert convert_to_fp16(model) > 0
    assert lower_per_token_for_onnxruntime(model) == len(linear_layers(level2))
    ids = RNG.integers(3, 258, 20)
    exact, lowered = logits(level2, ids), logits(model, ids)
    assert np.abs(lowered - exact).max() < 0.05 * np.abs(exact).max()
