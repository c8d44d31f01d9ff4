"""Activation-aware weight scaling (AWQ, Lin et al. 2023) before weight-only quantization.

A few input channels of a linear layer carry much larger activations than the rest, and the
rounding error of their weights is multiplied by those activations. Scaling those rows of W up by
s (and the input down by s) gives them a finer share of their block's levels, while the float
product x · W stays the same. The 1/s has to go somewhere upstream, so a layer is scaled only where
that costs nothing at run time (precision/folding.py), and only when every reader of its input is
being quantized. Scaling whole weight columns (the fold for down and o) commutes with block-wise
rounding along K, so the upstream layer's own quantization is unchanged. Anything else is left
unscaled.

Per group of layers sharing an input x, s = mean|x|^a per channel, with the exponent a chosen from
`EXPONENTS` (0 included: no scaling) by the output error on calibration rows,
``‖X · W − (X / s) · Q(s · W)‖²``, so the choice is never worse than plain rounding on those rows.
Run on the float graph, before quantization; the statistics come from that same graph.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx

from llmc.precision.calibration import TensorStats
from llmc.precision.folding import Graph

EXPONENTS = tuple(i / 10 for i in range(10))  # AWQ searches [0, 1); 1 over-scales


def scale_inputs(model: onnx.ModelProto, nodes: list[onnx.NodeProto], activations: dict[str, TensorStats],
                 fake_quantize: Callable[[np.ndarray], np.ndarray]) -> dict[str, tuple[float, np.ndarray]]:
    """Scale the weights of `nodes` (MatMuls by [K, N] float initializers) and fold 1/s upstream.

    Args:
        model: modified in place (initializers only; no node is added).
        nodes: the MatMuls about to be quantized.
        activations: statistics of their inputs (keyed by ``node.input[0]``) with `channel_absmean`
            and a `sample` of rows; an input without them is left unscaled.
        fake_quantize: a [K, N] weight as the quantizer will round it (quantized, then dequantized).

    Returns:
        for each input that could be scaled, the exponent chosen (0.0: scaling did not help) and
        the divisor s now applied to it.
    """
    graph = Graph(model)
    chosen_ids = {id(n) for n in nodes}
    inputs = list(dict.fromkeys(n.input[0] for n in nodes))
    chosen = {}
    # Last layer first: down folds into the gate/up weight and o into q/k/v's, which must be
    # final before their own groups measure their error.
    for x in reversed(inputs):
        stats = activations.get(x)
        readers = graph.consumers.get(x, [])
        if stats is None or stats.sample is None or any(id(r) not in chosen_ids for r in readers):
            continue
        target = graph.fold_target(x)
        if target is None:
            continue
        fold, tie = target
        weights = [graph.array(r.input[1]) for r in readers]
        absmean = stats.channel_absmean if tie is None else tie(stats.channel_absmean)
        exponent, s = best_scale(stats.sample, absmean, np.concatenate(weights, axis=1), fake_quantize)
        chosen[x] = (exponent, s)
        if exponent == 0.0:
            continue
        for reader, weight in zip(readers, weights):
            graph.set_array(reader, 1, weight * s[:, None])
        fold(1.0 / s)
    return chosen


def best_scale(sample: np.ndarray, absmean: np.ndarray, weight: np.ndarray,
               fake_quantize: Callable[[np.ndarray], np.ndarray]) -> tuple[float, np.ndarray]:
    """The exponent a (and s = absmean^a) whose scaled rounding changes sample · weight the least."""
    reference = sample @ weight
    best = (np.inf, 0.0, np.ones(len(absmean), np.float32))
    for a in EXPONENTS:
        s = np.power(np.maximum(absmean, 1e-6), a)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)  # centred on 1 (block rounding ignores a common factor)
        error = float(np.square(reference - (sample / s) @ fake_quantize(weight * s[:, None])).sum())
        if error < best[0]:
            best = (error, a, s)
    return best[1], best[2]
