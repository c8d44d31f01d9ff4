"""Weight-only linears for TensorRT: onnxruntime's MatMulNBits → DequantizeLinear → MatMul.

precision/weight_only.py writes ``com.microsoft::MatMulNBits``, which only onnxruntime runs.
TensorRT 11 reads low-bit weights as a signed INT8/INT4 initializer dequantized straight into a
MatMul, quantizes symmetrically (zero points zero, scales strictly positive) and takes only these
forms (compiler/tensorrt_support.py cites the rules, and `--dry-run` checks them):

- INT8 per output channel: a scale per column of W [K, N] (DequantizeLinear axis 1). A
  MatMulNBits layer whose blocks of a column share one scale magnitude and need no offset is
  rewritten exactly; any other is requantized per channel from the weights its codes stand for
  (int8 per channel over blocks: a rounding step of max|W[:, n]| / 127), and `progress` says so.
  The accuracy check that follows in `llmc compile` measures this form.
- INT4 block-wise along K, in blocks of 64 or 128. Blocks of 256 are split exactly; smaller ones
  are merged where neighbouring blocks share their scale and offset, and otherwise refused with
  one line naming `--weights-block-size`: re-rounding 4-bit codes into larger blocks would cost
  accuracy the user did not choose.

A MatMulNBits block holds codes c with a zero point z and a scale s of either sign, each weight
(c - z) · s; it is rewritten exactly as

    W = q · |s| + o        q = c - h,  o = (h - z) · s               when s >= 0
                           q = (h - 1) - c,  o = (h - 1 - z) · s      when s < 0      (h = 2^(bits-1))

so q fits the signed type, and the per-block constant o (zero for symmetric blocks of
non-negative scale) is added as a small second product: the input summed over each block of K,
times o ([K / block, N]). The first product is TensorRT's weight-only GEMM, the second a K/block
sized one.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from llmc.errors import LlmcError
from llmc.formats.onnx_io import has_external_weights, make_initializer, tensor_array
from llmc.passes import contrib_ops
from llmc.precision.int8 import quantize_weight

# DequantizeLinear's block_size attribute and INT4 tensors.
MIN_OPSET = 21
# TensorRT's INT4 block sizes ("The supported block sizes are {64, 128}.": TensorRT's documentation,
# docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/quantized-types-schemes.html;
# compiler/tensorrt_support.py checks them with the other Q/DQ rules).
INT4_BLOCK_SIZES = (64, 128)


def matmulnbits_as_dequantize(model: onnx.ModelProto, progress: Callable[[str], None] = lambda message: None) -> int:
    """Rewrite every MatMulNBits of `model` (in place, shapes inferred); returns how many.

    `progress` is told of each int8 layer requantized per channel."""
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in list(model.graph.value_info) + list(model.graph.input)
             if v.type.tensor_type.HasField("shape")}  # of each input A, for the block sums' reshape
    initializers = {t.name: t for t in model.graph.initializer}
    external = has_external_weights(model)
    nodes, added, done, requantized = [], [], 0, []
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or node.domain != contrib_ops.DOMAIN:
            nodes.append(node)
            continue
        new_nodes, new_weights, exact = _rewrite(node, initializers, ranks, external)
        nodes += new_nodes
        added += new_weights
        done += 1
        if not exact:
            requantized.append(node.name or node.output[0])
    if not done:
        return 0
    if requantized:
        progress(f"TensorRT form: {len(requantized)} int8 weight-only layer(s) requantized per output channel "
                 f"(TensorRT dequantizes INT8 per tensor or per channel, not in blocks): {', '.join(requantized[:3])}"
                 + (" …" if len(requantized) > 3 else ""))
    used = {name for n in nodes for name in n.input}
    kept = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + added)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    opsets = [o for o in model.opset_import if o.domain != contrib_ops.DOMAIN]
    for opset in opsets:
        if opset.domain in ("", "ai.onnx") and opset.version < MIN_OPSET:
            opset.version = MIN_OPSET
    del model.opset_import[:]
    model.opset_import.extend(opsets)
    return done


def signed_blocks(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, |s|, o) of the module docstring from codes [N, blocks, block], scales and zero points
    [N, blocks]; a block of scale 0 gets q = 0 and scale 1 (TensorRT needs positive scales)."""
    half = 2 ** (bits - 1)
    negative = scales < 0
    codes, zeros = codes.astype(np.int32), zeros.astype(np.float32)
    q = np.where(negative[..., None], half - 1 - codes, codes - half)
    offsets = np.where(negative, half - 1 - zeros, half - zeros) * scales
    empty = scales == 0
    q[empty] = 0
    return q.astype(np.int8), np.where(empty, 1.0, np.abs(scales)).astype(scales.dtype), offsets.astype(scales.dtype)


def per_channel(q: np.ndarray, magnitudes: np.ndarray, offsets: np.ndarray, k: int
                ) -> tuple[np.ndarray, np.ndarray, bool]:
    """Signed int8 blocks (`signed_blocks`: q [N, blocks, block], |s| and o [N, blocks]) as int8
    codes [K, N] with one scale per column [N]; whether that is exact (each column's blocks share
    |s| and have no offset), else the weights requantized per column."""
    n = q.shape[0]
    if not np.any(offsets) and np.all(magnitudes == magnitudes[:, :1]):
        return q.reshape(n, -1)[:, :k].T, magnitudes[:, 0].copy(), True
    weights = (q.astype(np.float64) * magnitudes[..., None] + offsets[..., None]).reshape(n, -1)[:, :k]
    _, codes, scales = quantize_weight(weights.T)
    return codes, scales.astype(magnitudes.dtype), False


def legal_blocks(q: np.ndarray, magnitudes: np.ndarray, offsets: np.ndarray, block: int, name: str
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Signed int4 blocks re-blocked exactly at a block size TensorRT takes (`INT4_BLOCK_SIZES`),
    or LlmcError naming the node when that would change the weights."""
    n = q.shape[0]
    if block in INT4_BLOCK_SIZES:
        return q, magnitudes, offsets, block
    largest = max(INT4_BLOCK_SIZES)
    if block > largest and block % largest == 0:  # split: each scale repeated
        factor = block // largest
        return (q.reshape(n, -1, largest), np.repeat(magnitudes, factor, axis=1),
                np.repeat(offsets, factor, axis=1), largest)
    for target in INT4_BLOCK_SIZES:
        if target % block:
            continue
        factor = target // block
        spare = -q.shape[1] % factor  # blocks past K: zero codes, any scale
        grouped = [np.concatenate([a, np.repeat(a[:, -1:], spare, axis=1)], axis=1).reshape(n, -1, factor)
                   for a in (magnitudes, offsets)]
        if all(np.all(a == a[..., :1]) for a in grouped):
            codes = np.concatenate([q, np.zeros((n, spare, block), q.dtype)], axis=1).reshape(n, -1, target)
            return codes, grouped[0][..., 0], grouped[1][..., 0], target
    raise LlmcError(f"node {name}: int4 weights in blocks of {block}; TensorRT dequantizes INT4 in blocks of "
                    f"{' or '.join(map(str, INT4_BLOCK_SIZES))} only: compile with --weights-block-size "
                    f"{'|'.join(map(str, INT4_BLOCK_SIZES))}")


def _rewrite(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto], ranks: dict[str, int],
             external: bool) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], bool]:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits, block = attrs["K"], attrs["N"], attrs.get("bits", 4), attrs["block_size"]
    name = node.name or node.output[0]
    inputs = list(node.input) + [""] * (6 - len(node.input))
    if inputs[4]:
        raise LlmcError(f"node {name}: MatMulNBits with g_idx (act-order) has no TensorRT form")
    missing = [i for i in inputs[1:4] if i and i not in initializers]
    if missing:
        raise LlmcError(f"node {name}: MatMulNBits input {missing[0]} is not a constant")
    blocks = -(-k // block)
    packed = tensor_array(initializers[inputs[1]]).reshape(n, blocks, -1)
    codes = packed if bits == 8 else np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, blocks, block)
    scales = tensor_array(initializers[inputs[2]]).reshape(n, blocks)
    zeros = _zero_points(initializers, inputs[3], n, blocks, bits, name)
    q, magnitudes, offsets = signed_blocks(codes, scales, zeros, bits)
    prefix = f"{name}.dq"
    if bits == 8:
        weights, channel_scales, exact = per_channel(q, magnitudes, offsets, k)
        weight = make_initializer(np.ascontiguousarray(weights), f"{prefix}.q", external=external)
        nodes = [helper.make_node("DequantizeLinear", [f"{prefix}.q", f"{prefix}.scale"], [f"{prefix}.w"],
                                  name=f"{prefix}/DequantizeLinear", axis=1)]
        added = [weight, numpy_helper.from_array(channel_scales, f"{prefix}.scale")]
        return nodes + _products(node, inputs, prefix, []), added, exact
    q, magnitudes, offsets, block = legal_blocks(q, magnitudes, offsets, block, name)
    blocks = q.shape[1]
    weight = make_initializer(_pack(q.reshape(n, blocks * block).T), f"{prefix}.q", external=external)
    weight.data_type, weight.dims[:] = TensorProto.INT4, [blocks * block, n]
    added = [weight, numpy_helper.from_array(np.ascontiguousarray(magnitudes.T), f"{prefix}.scale")]
    nodes = [helper.make_node("DequantizeLinear", [f"{prefix}.q", f"{prefix}.scale"], [f"{prefix}.w"],
                              name=f"{prefix}/DequantizeLinear", axis=0, block_size=block)]
    rank = ranks.get(inputs[0])
    if rank is None and (blocks * block != k or np.any(offsets != 0)):
        raise LlmcError(f"node {name}: the rank of its input {inputs[0]} is unknown (shapes not inferred)")
    if blocks * block != k:  # the last block is partial: zero-pad the input's K to whole blocks (the codes are padded)
        added.append(numpy_helper.from_array(np.array([0] * (2 * rank - 1) + [blocks * block - k], np.int64),
                                             f"{prefix}.pads"))
        nodes.append(helper.make_node("Pad", [inputs[0], f"{prefix}.pads"], [f"{prefix}.a"], name=f"{prefix}/Pad"))
        inputs[0] = f"{prefix}.a"
    terms = []
    if np.any(offsets != 0):
        added += [numpy_helper.from_array(np.array([0] * (rank - 1) + [blocks, block], np.int64), f"{prefix}.blocks"),
                  numpy_helper.from_array(np.array([-1], np.int64), f"{prefix}.last_axis"),
                  numpy_helper.from_array(np.ascontiguousarray(offsets.T), f"{prefix}.offsets")]
        nodes += [helper.make_node("Reshape", [inputs[0], f"{prefix}.blocks"], [f"{prefix}.grouped"], name=f"{prefix}/Reshape"),
                  helper.make_node("ReduceSum", [f"{prefix}.grouped", f"{prefix}.last_axis"], [f"{prefix}.sums"],
                                   name=f"{prefix}/ReduceSum", keepdims=0),
                  helper.make_node("MatMul", [f"{prefix}.sums", f"{prefix}.offsets"], [f"{prefix}.offset"],
                                   name=f"{prefix}/MatMulOffsets")]
        terms.append(f"{prefix}.offset")
    return nodes + _products(node, inputs, prefix, terms), added, True


def _products(node: onnx.NodeProto, inputs: list[str], prefix: str, terms: list[str]) -> list[onnx.NodeProto]:
    """MatMul(A, the dequantized weight) plus `terms` and MatMulNBits' bias, into its output."""
    terms = [f"{prefix}.product"] + terms + ([inputs[5]] if inputs[5] else [])
    if len(terms) == 1:
        terms[0] = node.output[0]
    nodes = [helper.make_node("MatMul", [inputs[0], f"{prefix}.w"], [terms[0]], name=f"{prefix}/MatMul")]
    total = terms[0]
    for i, term in enumerate(terms[1:], 1):
        out = node.output[0] if i == len(terms) - 1 else f"{prefix}.sum{i}"
        nodes.append(helper.make_node("Add", [total, term], [out], name=f"{prefix}/Add{i}"))
        total = out
    return nodes


def _zero_points(initializers, name: str, n: int, blocks: int, bits: int, node: str) -> np.ndarray:
    """[N, blocks] zero points (MatMulNBits' default 2^(bits-1) when the input is absent)."""
    if not name:
        return np.full((n, blocks), 2 ** (bits - 1), np.uint8)
    packed = tensor_array(initializers[name])
    if packed.dtype != np.uint8:
        raise LlmcError(f"node {node}: MatMulNBits zero points of type {packed.dtype} have no TensorRT form")
    if bits == 8:
        return packed.reshape(n, blocks)
    rows = packed.reshape(n, -1)
    return np.stack([rows & 0xF, rows >> 4], axis=-1).reshape(n, -1)[:, :blocks]


def _pack(q: np.ndarray) -> np.ndarray:
    """ONNX's layout of a signed INT4 [K, N] tensor: two per byte, the first in the low nibble."""
    flat = np.ascontiguousarray(q).reshape(-1)
    if flat.size % 2:
        flat = np.append(flat, np.int8(0))
    nibbles = flat.astype(np.uint8) & 0xF
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
