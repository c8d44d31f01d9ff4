"""Weight-only quantization: MatMul by a constant weight → onnxruntime's MatMulNBits.

Decode on a CPU streams every weight once per step, so a step costs what the weights weigh.
Storing them in 8 or 4 bits (block-wise along K, one fp32 scale per block of `block_size`)
cuts that traffic 4× or 8×; activations stay fp32. onnxruntime's CPU kernel for
``com.microsoft::MatMulNBits`` dequantizes on the fly.

Symmetric per block: code = round(w / scale) + 2^(bits-1), scale = max|w| / (2^(bits-1) - 1),
so dequantized w = (code - 2^(bits-1)) · scale — the op's default zero point, which is why no
zero_points input is written. 4-bit codes are packed two per byte, the lower K index in the low
nibble. The product itself runs in int8 (`ACCURACY_LEVEL`), as onnxruntime's fast CPU kernels do.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from llmc.compiler.onnx_io import is_large, make_initializer, tensor_array
from llmc.errors import LlmcError
from llmc.passes import contrib_ops
from llmc.passes.graph import DEFAULT_DOMAINS

BITS = (4, 8)
BLOCK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_BLOCK_SIZE = 32
# onnxruntime computes the product in int8 (activations quantized per block on the fly) at level 4:
# measured on 8 pairs of 512×1408 layers, one token, 2 threads: fp32 1.33 ms; int4 0.44 ms at
# level 0 and 0.16 ms at level 4; int8 5.7 ms at level 0 (no fast kernel) and 0.21 ms at level 4.
ACCURACY_LEVEL = 4


def quantize_blocks(weight: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes [N, blocks, block_size] (uint8, unpacked) and scales [N, blocks] of a [K, N] weight."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), np.float32)
    padded[:k] = weight
    grouped = padded.T.reshape(n, blocks, block_size)
    top = 2 ** (bits - 1) - 1
    scales = np.abs(grouped).max(axis=2) / top
    safe = np.where(scales == 0, 1.0, scales)
    codes = np.clip(np.rint(grouped / safe[..., None]), -top, top) + 2 ** (bits - 1)
    return codes.astype(np.uint8), scales.astype(np.float32)


def dequantize_blocks(codes: np.ndarray, scales: np.ndarray, bits: int, k: int) -> np.ndarray:
    """The [K, N] weight the codes stand for (the inverse of `quantize_blocks`, up to rounding)."""
    n = codes.shape[0]
    values = (codes.astype(np.float32) - 2 ** (bits - 1)) * scales[..., None]
    return values.reshape(n, -1)[:, :k].T


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' B: [N, blocks, block_size · bits / 8] bytes."""
    if bits == 8:
        return codes
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def quantize_weights(model: onnx.ModelProto, bits: int, block_size: int = DEFAULT_BLOCK_SIZE,
                     select: Callable[[onnx.NodeProto], bool] = lambda node: True,
                     accuracy_level: int = ACCURACY_LEVEL) -> list[str]:
    """Rewrite every selected MatMul by a 2-D float32 initializer; returns the rewritten nodes' names.

    Args:
        model: modified in place.
        bits: 4 or 8.
        block_size: weights per scale along K.
        select: which MatMuls to quantize (mixed precision leaves the others alone).
        accuracy_level: MatMulNBits' compute type: 0 float (exact dequantized product), 4 int8.
    """
    if bits not in BITS:
        raise LlmcError(f"--weights: int{bits} is not supported (int4, int8)")
    if block_size not in BLOCK_SIZES:
        raise LlmcError(f"--weights-block-size: {block_size} is not supported ({', '.join(map(str, BLOCK_SIZES))})")
    contrib_ops.register()
    initializers = {t.name: t for t in model.graph.initializer}
    large = is_large(model)
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    done, drop, added = [], set(), []
    for node in model.graph.node:
        weight = initializers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if (node.domain not in DEFAULT_DOMAINS or weight is None or len(weight.dims) != 2
                or weight.data_type != onnx.TensorProto.FLOAT or not select(node)):
            continue
        array = tensor_array(weight)
        k, n = array.shape
        codes, scales = quantize_blocks(array, bits, block_size)
        prefix = f"{node.name or node.output[0]}.int{bits}"
        added += [make_initializer(pack(codes, bits), f"{prefix}.B", external=large),  # past 2 GB: external
                  numpy_helper.from_array(scales.reshape(-1), f"{prefix}.scales")]
        if readers[weight.name] == 1:
            drop.add(weight.name)
        readers[weight.name] -= 1
        node.op_type, node.domain = "MatMulNBits", contrib_ops.DOMAIN
        node.input[:] = [node.input[0], f"{prefix}.B", f"{prefix}.scales"]
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
