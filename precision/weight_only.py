"""Weight-only quantization: MatMul by a constant weight → onnxruntime's MatMulNBits.

Decode on a CPU streams every weight once per step, so a step costs what the weights weigh.
Storing them in 8 or 4 bits (block-wise along K, one fp32 scale per block of `block_size`)
cuts that traffic 4× or 8×; activations stay fp32. onnxruntime's CPU kernel for
``com.microsoft::MatMulNBits`` dequantizes on the fly.

Each weight is stored as a code c in 0..2^bits-1 and stands for (c - zero point) · scale:

    asymmetric (the default)  per block a scale and a zero point spanning [min(w, 0), max(w, 0)]
                              (written as the op's zero_points input, 4-bit ones packed in pairs);
    symmetric                 zero point 2^(bits-1), no zero_points input; the extra negative
                              level goes to whichever side of the block is larger (a negative
                              scale flips the sides).

4-bit codes are packed two per byte, the lower K index in the low nibble. The product itself
runs in int8 (`ACCURACY_LEVEL`), as onnxruntime's fast CPU kernels do.

With calibration statistics (`quantize_weights(activations=)`), 4-bit weights are first scaled
by how large their input channels run (AWQ, precision/awq.py). Measured on SmolLM2-135M-Instruct,
real held-out text, every linear layer int4 but lm_head (int8), perplexity against fp32:
+25.4% symmetric and +24.8% asymmetric with plain rounding, +20.4% and +9.9% with scaling;
onnxruntime's own quantizer gives +23.7% to +26.0% there (lm_head fp32). Asymmetric blocks of 32
are the default by those numbers, with a caveat: that checkpoint was dequantized from GGUF Q4_1
(asymmetric blocks of 32 along K), so its weights sit on an asymmetric 4-bit grid; on the
fp16-trained pystdlib-llama int4 costs under 0.3% either way. Blocks of 128 cost +25.5% even
with scaling. There is no calibrated per-block clip search (narrower ranges where that lowers the
output error on the sampled rows): it measured no better in perplexity with 512 rows, and +21%
with 256, where it fits the few rows it sees.

The logits projection is kept at 8 bits when int4 is asked (`LM_HEAD_UNDER_INT4`): int4 there
cost SmolLM2 another +9 points of perplexity (+34% against +25%), int8 +0.5; with scaling on
data/pystdlib-text's calibration text (lm_head scaled too), +20.8% against +10.3%. It costs decode
speed: in SmolLM2's int4 step (one token, 2 threads, no AMX) the 8-bit lm_head took 1.45 ms against
1.07 ms at 4 bits under the profiler, and whole steps 0-18% longer, run to run (how much of the
weights the machine's shared cache holds). Ranking the words at 4 bits and recomputing the 64
best in fp32 from the tied embedding gives +12.3% (+11.7% with 256, +10.7% with 1,024) and adds
0.2-0.35 ms of TopK, gathers and scatter a step, most of what it saves.

An 8-bit lm_head takes blocks of at least 64 (`LM_HEAD_MIN_BLOCK_SIZE`): onnxruntime's 8-bit
kernel runs faster on longer blocks, and 8 bits leave little to gain from short ones. Measured on
SmolLM2-135M-Instruct (lm_head alone at 8 bits, the rest fp32, 8,160 held-out tokens, against
fp32): blocks of 32 +0.17% perplexity (mean KL 0.0014), 64 +0.16% (0.0027), 128 +0.42% (0.0045);
in the int4 engine +26.34% against +26.40% with lm_head at 64. The lm_head's own time under the
profiler, one token, 2 threads of an AMD EPYC: 1.17-1.26 ms at 32, 1.00 ms at 64, 1.08 ms at 128
(0.94-0.99 ms in symmetric int4). At 64 a step of several tokens still rounds each row as a step
of one does (`steps_round_alike`), which at 128 it no longer does.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from llmc.formats.onnx_io import has_external_weights, make_initializer, tensor_array
from llmc.errors import LlmcError
from llmc.passes import contrib_ops
from llmc.passes.graph import DEFAULT_DOMAINS
from llmc.precision.awq import scale_inputs
from llmc.precision.calibration import TensorStats

BITS = (4, 8)
BLOCK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_BLOCK_SIZE = 32
# onnxruntime computes the product in int8 (activations quantized per block on the fly) at level 4:
# measured on 8 pairs of 512×1408 layers, one token, 2 threads: fp32 1.33 ms; int4 0.44 ms at
# level 0 and 0.16 ms at level 4; int8 5.7 ms at level 0 (no fast kernel) and 0.21 ms at level 4.
ACCURACY_LEVEL = 4
SYMMETRIC = False  # asymmetric: the measured better one (module docstring)
# What plan.py gives lm_head when --weights int4 is asked and no mixed-precision rule names it.
LM_HEAD_UNDER_INT4 = "int8-weights"
LM_HEAD_MIN_BLOCK_SIZE = 64  # an 8-bit lm_head's shortest blocks (module docstring)
# Calibration rows per layer input that the scale search measures on (SmolLM2: +9.9% perplexity
# with 512, +10.4% with 256).
SAMPLE_ROWS = 512


def quantize_blocks(weight: np.ndarray, bits: int, block_size: int,
                    symmetric: bool = SYMMETRIC) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes [N, blocks, block_size] (uint8, unpacked), scales and zero points [N, blocks] of a
    [K, N] weight; each weight stands for (code - zero point) · scale."""
    grouped = _blocks(weight, block_size)  # [N, blocks, block_size]
    low, high = 0, 2 ** bits - 1
    if symmetric:
        # Codes 0..2^bits-1 around the zero point 2^(bits-1): one more level on one side than the
        # other. The side with the larger magnitude gets it (a negative scale flips the sides), and
        # the step is the smallest that holds the whole block (onnxruntime's quantizer instead
        # lets the smaller side clip).
        half = 2 ** (bits - 1)
        positive, negative = np.maximum(grouped.max(axis=2), 0), np.maximum(-grouped.min(axis=2), 0)
        below, above = np.maximum(negative / half, positive / (half - 1)), np.maximum(positive / half, negative / (half - 1))
        scales = np.where(below <= above, below, -above)
        zeros = np.full(scales.shape, half, np.float32)
    else:
        # The range always holds 0 so that the zero point is a code; the padding's zeros cost nothing.
        smallest, largest = np.minimum(grouped.min(axis=2), 0), np.maximum(grouped.max(axis=2), 0)
        scales = (largest - smallest) / high
        zeros = np.clip(np.rint(-smallest / np.where(scales == 0, 1.0, scales)), low, high)
    safe = np.where(scales == 0, 1.0, scales)
    codes = np.clip(np.rint(grouped / safe[..., None]) + zeros[..., None], low, high)
    return codes.astype(np.uint8), scales.astype(np.float32), zeros.astype(np.uint8)


def _blocks(weight: np.ndarray, block_size: int) -> np.ndarray:
    """[K, N] → [N, blocks, block_size], K zero-padded to whole blocks."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), np.float32)
    padded[:k] = weight
    return padded.T.reshape(n, blocks, block_size)


def dequantize_blocks(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, k: int) -> np.ndarray:
    """The [K, N] weight the codes stand for (the inverse of `quantize_blocks`, up to rounding)."""
    n = codes.shape[0]
    values = (codes.astype(np.float32) - zeros[..., None]) * scales[..., None]
    return values.reshape(n, -1)[:, :k].T


def fake_quantize(weight: np.ndarray, bits: int, block_size: int, symmetric: bool = SYMMETRIC) -> np.ndarray:
    """The weight as MatMulNBits will see it: quantized, then dequantized."""
    return dequantize_blocks(*quantize_blocks(weight, bits, block_size, symmetric), weight.shape[0])


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' B: [N, blocks, block_size · bits / 8] bytes."""
    if bits == 8:
        return codes
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def pack_zero_points(zeros: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' zero_points: per row of N, the blocks' zero points, 4-bit ones two per byte
    (lower block in the low nibble, an odd count padded), flattened."""
    if bits == 8:
        return zeros.reshape(-1)
    if zeros.shape[1] % 2:
        zeros = np.pad(zeros, ((0, 0), (0, 1)))
    return (zeros[:, 0::2] | (zeros[:, 1::2] << 4)).astype(np.uint8).reshape(-1)


def _targets(model: onnx.ModelProto, select: Callable[[onnx.NodeProto], bool]) -> list[tuple[onnx.NodeProto, onnx.TensorProto]]:
    """The selected MatMuls by a 2-D float32 initializer, with that initializer."""
    initializers = {t.name: t for t in model.graph.initializer}
    found = []
    for node in model.graph.node:
        weight = initializers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if (node.domain in DEFAULT_DOMAINS and weight is not None and len(weight.dims) == 2
                and weight.data_type == onnx.TensorProto.FLOAT and select(node)):
            found.append((node, weight))
    return found


def quantize_weights(model: onnx.ModelProto, bits: int, block_size: int = DEFAULT_BLOCK_SIZE,
                     select: Callable[[onnx.NodeProto], bool] = lambda node: True,
                     accuracy_level: int = ACCURACY_LEVEL, symmetric: bool = SYMMETRIC,
                     activations: dict[str, TensorStats] | None = None) -> list[str]:
    """Rewrite every selected MatMul by a 2-D float32 initializer; returns the rewritten nodes' names.

    Args:
        model: modified in place.
        bits: 4 or 8.
        block_size: weights per scale along K.
        select: which MatMuls to quantize (mixed precision leaves the others alone).
        accuracy_level: MatMulNBits' compute type: 0 float (exact dequantized product), 4 int8.
        symmetric: False writes a zero point per block (MatMulNBits' zero_points input).
        activations: calibration statistics of the layers' inputs, keyed by ``node.input[0]``
            (`observe` with ``sample_rows=SAMPLE_ROWS``): for 4 bits, weights are first scaled by
            how large their input channels run (precision/awq.py). None: plain min-max rounding.
    """
    if bits not in BITS:
        raise LlmcError(f"--weights: int{bits} is not supported (int4, int8)")
    if block_size not in BLOCK_SIZES:
        raise LlmcError(f"--weights-block-size: {block_size} is not supported ({', '.join(map(str, BLOCK_SIZES))})")
    contrib_ops.register()
    # 4 bits only: 8-bit rounding is fine without (int8 lm_head: +0.5 points on SmolLM2), and the
    # search over a vocabulary-sized lm_head alone took 50 s.
    if activations and bits == 4:
        scale_inputs(model, [node for node, _ in _targets(model, select)], activations,
                     lambda w: fake_quantize(w, bits, block_size, symmetric))
    external = has_external_weights(model)
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    done, drop, added = [], set(), []
    for node, weight in _targets(model, select):
        array = tensor_array(weight)
        k, n = array.shape
        codes, scales, zeros = quantize_blocks(array, bits, block_size, symmetric)
        prefix = f"{node.name or node.output[0]}.int{bits}"
        added += [make_initializer(pack(codes, bits), f"{prefix}.B", external=external),  # a loaded model's: external
                  numpy_helper.from_array(scales.reshape(-1), f"{prefix}.scales")]
        inputs = [node.input[0], f"{prefix}.B", f"{prefix}.scales"]
        if not symmetric:
            added.append(numpy_helper.from_array(pack_zero_points(zeros, bits), f"{prefix}.zero_points"))
            inputs.append(f"{prefix}.zero_points")
        if readers[weight.name] == 1:
            drop.add(weight.name)
        readers[weight.name] -= 1
        node.op_type, node.domain = "MatMulNBits", contrib_ops.DOMAIN
        node.input[:] = inputs
        node.attribute.extend([helper.make_attribute("K", k), helper.make_attribute("N", n),
                               helper.make_attribute("bits", bits), helper.make_attribute("block_size", block_size),
                               helper.make_attribute("accuracy_level", accuracy_level)])
        done.append(node.name or node.output[0])
    kept = [t for t in model.graph.initializer if t.name not in drop]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + added)
    if done and not any(o.domain == contrib_ops.DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(contrib_ops.DOMAIN, 1))
    return done
