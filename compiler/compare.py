"""Numerical comparison of two graphs on the same seeded inputs (tests, `--verify`, `llmc check`).

Inputs are generated from the graph's declared inputs: the decoder interface gets valid token
ids, a full attention mask, positions after the past and random past K/V; any other input gets
seeded random values with dynamic dims set to small sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import os

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from llmc.formats.onnx_io import serialize
from llmc.formats.sessions import open_session, session_options

_BATCH, _SEQ, _PAST = 2, 5, 3


@dataclass(frozen=True)
class Comparison:
    """Worst-case differences over all outputs; top-1 agreement on `logits` when present."""

    max_abs: float
    max_rel: float
    cosine: float
    top1_agreement: float | None
    worst_output: str

    def to_dict(self) -> dict:
        return {"max_abs": self.max_abs, "max_rel": self.max_rel, "cosine": self.cosine,
                "top1_agreement": self.top1_agreement, "worst_output": self.worst_output}


def seeded_feeds(model: onnx.ModelProto, seed: int = 0, *, batch: int = _BATCH, seq: int = _SEQ,
                 past: int = _PAST) -> dict[str, np.ndarray]:
    """Inputs for every graph input, reproducible from `seed`.

    Any decoder graph gets consistent inputs: with or without past K/V (without, the mask spans
    the new tokens only), with or without position ids, and the lengths that onnxruntime's
    contrib attention reads (``seqlens_k``, ``total_sequence_length``, ``cache_position``).
    """
    rng = np.random.default_rng(seed)
    vocab = _logits_vocab(model)
    head_size = _gqa_head_size(model)
    if head_size is not None:
        batch = 1  # onnxruntime's GroupQueryAttention takes a prompt over a past for one sequence only
    if not any(_is_past(value) for value in model.graph.input):
        past = 0
    total = past + seq
    derived = {
        "attention_mask": lambda: np.ones((batch, total)),
        "position_ids": lambda: np.tile(np.arange(past, total), (batch, 1)),
        "cache_position": lambda: np.arange(past, total),
        # GroupQueryAttention's: each sequence's total length minus one, and the longest total.
        "seqlens_k": lambda: np.full((batch,), total - 1),
        "total_sequence_length": lambda: np.array(total),
    }
    feeds = {}
    for value in model.graph.input:
        name = value.name
        tensor = value.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        if name == "input_ids":
            feeds[name] = rng.integers(0, vocab, (batch, seq)).astype(dtype)
        elif name in derived:
            feeds[name] = derived[name]().astype(dtype).reshape(_declared_rank_shape(tensor, derived[name]()))
        else:
            dims = [d.dim_value if d.HasField("dim_value") else 2 for d in tensor.shape.dim]
            if _is_past(value):
                dims[0], dims[2] = batch, past
                if head_size and not tensor.shape.dim[3].HasField("dim_value"):
                    dims[3] = head_size  # genai's builder leaves it symbolic
            feeds[name] = _random(rng, dims, dtype)
    return feeds


def _gqa_head_size(model: onnx.ModelProto) -> int | None:
    """The head size of the graph's first GroupQueryAttention, from its K (or packed QKV) width
    when inferred, else 0; None when the graph has no GroupQueryAttention."""
    node = next((n for n in model.graph.node if n.op_type == "GroupQueryAttention"), None)
    if node is None:
        return None
    attrs = {a.name: a.i for a in node.attribute}
    packed = len(node.input) < 2 or not node.input[1]
    values = {v.name: v for v in (*model.graph.value_info, *model.graph.input)}
    projection = values.get(node.input[0] if packed else node.input[1])
    dims = projection.type.tensor_type.shape.dim if projection is not None else []
    if not dims or not dims[-1].HasField("dim_value"):
        return 0
    return dims[-1].dim_value // (attrs["num_heads"] + 2 * attrs["kv_num_heads"] if packed else attrs["kv_num_heads"])


def _is_past(value: onnx.ValueInfoProto) -> bool:
    """A past key/value input [batch, kv_heads, past, head_dim] (Optimum, genai and llmc names)."""
    return (value.name.startswith(("past_key_values.", "past_key.", "past_value.", "past."))
            and len(value.type.tensor_type.shape.dim) == 4)


def _declared_rank_shape(tensor: onnx.TypeProto.Tensor, array: np.ndarray) -> tuple[int, ...]:
    """The array's shape, padded with leading 1s or squeezed to the rank the graph declares
    (e.g. a [1] total_sequence_length instead of a scalar)."""
    if not tensor.HasField("shape"):
        return array.shape
    rank = len(tensor.shape.dim)
    if rank == array.ndim:
        return array.shape
    if rank > array.ndim:
        return (1,) * (rank - array.ndim) + array.shape
    return array.shape[array.ndim - rank:]  # only leading 1s are dropped (a scalar's [1])


def run_onnx(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run `model` with onnxruntime on CPU, with its own graph optimizations off."""
    return _run(open_session(serialize(model), _unoptimized()), feeds)


def run_onnx_file(path: str | os.PathLike, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`run_onnx` on a file (its external data read by onnxruntime, not loaded here first)."""
    return _run(ort.InferenceSession(str(path), _unoptimized(), providers=["CPUExecutionProvider"]), feeds)


def _unoptimized() -> ort.SessionOptions:
    return session_options(optimize=False, alone=True, once=True)


def _run(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def compare_outputs(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> Comparison:
    """Compare outputs by name; a missing output or a shape change counts as infinite error."""
    worst = ("", 0.0, 0.0, 1.0)
    top1 = None
    for name, want in reference.items():
        got = candidate.get(name)
        if got is None or got.shape != want.shape:
            return Comparison(float("inf"), float("inf"), 0.0, None, name)
        want64, got64 = want.astype(np.float64), got.astype(np.float64)
        diff = np.abs(got64 - want64)
        max_abs = float(diff.max(initial=0.0))
        max_rel = float((diff / np.maximum(np.abs(want64), 1e-6)).max(initial=0.0))
        cosine = _cosine(want64.ravel(), got64.ravel())
        if not np.isfinite(got64).all() and np.isfinite(want64).all():
            max_abs = max_rel = float("inf")
        if max_abs > worst[1] or (max_abs == worst[1] and not worst[0]):
            worst = (name, max_abs, max_rel, cosine)
        if name == "logits":
            top1 = float(np.mean(want.argmax(-1) == got.argmax(-1)))
    return Comparison(worst[1], worst[2], worst[3], top1, worst[0])


def compare_models(reference: onnx.ModelProto, candidate: onnx.ModelProto, seed: int = 0) -> Comparison:
    """Run both graphs on the same seeded inputs and compare every output."""
    feeds = seeded_feeds(reference, seed)
    return compare_outputs(run_onnx(reference, feeds), run_onnx(candidate, feeds))


def _random(rng: np.random.Generator, dims: list[int], dtype) -> np.ndarray:
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(dims).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, dims).astype(bool)
    return rng.integers(0, 2, dims).astype(dtype)


def _logits_vocab(model: onnx.ModelProto) -> int:
    for value in model.graph.output:
        dims = value.type.tensor_type.shape.dim
        if value.name == "logits" and len(dims) == 3 and dims[2].HasField("dim_value"):
            return dims[2].dim_value
    return 2


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norm = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / norm) if norm else 1.0
