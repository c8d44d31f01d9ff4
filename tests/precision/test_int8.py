"""Static int8: calibrator thresholds by hand, Q/DQ placement, SmoothQuant keeping the float
function, and the trained model's perplexity within the benchmark's bound."""

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from llmc.compiler.onnx_io import serialize
from llmc.compiler.pipeline import optimize
from llmc.errors import LlmcError
from llmc.precision.calibration import BINS, TensorStats, check_calibrator, entropy_bins, observe, prefill_feeds, threshold
from llmc.precision.int8 import quantize_int8, smooth
from llmc.precision.linears import linear_layers

RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def level2(tiny_llama_onnx):
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    return model


def _logits(model, ids):
    session = ort.InferenceSession(serialize(model)["model.onnx"], providers=["CPUExecutionProvider"])
    return session.run(["logits"], prefill_feeds(session, ids))[0][0]


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
    thresholds = quantize_int8(model, linears, windows, "minmax")
    onnx.checker.check_model(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for layer in linears:
        x, w = layer.node.input
        dq_w, dq_x = producer[w], producer[x]
        # Weights: int8, per output channel (axis 1), symmetric.
        assert dq_w.op_type == "DequantizeLinear" and inits[dq_w.input[0]].dtype == np.int8
        assert next(a.i for a in dq_w.attribute if a.name == "axis") == 1
        assert inits[dq_w.input[1]].shape == (inits[dq_w.input[0]].shape[1],)
        assert not inits[dq_w.input[2]].any()
        # Activations: Q then DQ of the float input, per tensor, scale = threshold / 127, zero point 0.
        q = producer[dq_x.input[0]]
        assert (dq_x.op_type, q.op_type) == ("DequantizeLinear", "QuantizeLinear")
        assert inits[q.input[1]].shape == () and inits[q.input[2]] == 0
        assert inits[q.input[1]] == pytest.approx(thresholds[q.input[0]] / 127)
    assert len(thresholds) == len({l.node.input[0] for l in linears})  # one pair per activation


def test_smoothquant_keeps_the_float_function(level2):
    model = copy.deepcopy(level2)
    linears = linear_layers(model)
    names = sorted({l.node.input[0] for l in linears})
    stats = observe(model, [RNG.integers(3, 258, 32)], names, histograms=False)
    # Make one channel an outlier so the smoothing scales are far from 1.
    for s in stats.values():
        s.channel_absmax = s.channel_absmax.copy()
        s.channel_absmax[3] *= 50
    assert smooth(model, linears, stats, 0.5) == 2 * 4 + 1  # both norms of the 4 layers, and the final one
    ids = RNG.integers(3, 258, 20)
    np.testing.assert_allclose(_logits(model, ids), _logits(level2, ids), atol=2e-4, rtol=1e-4)
