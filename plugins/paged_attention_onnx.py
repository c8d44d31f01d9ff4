"""The CPU implementation of ``llmc::paged_attention``: a lowering to standard ONNX ops.

onnxruntime has no CPU kernel for paged attention, and a Python custom op copies every output
through Python lists (DESIGN.md), so the op is lowered to ops onnxruntime runs natively::

    pad      q, k, v rows of the packed batch → [seqs, heads, max_new, head_dim]   (Gather)
    past     Gather(pool, block_tables) → [seqs, kv_heads, max_blocks·block, head_dim]
    attend   Attention-23(q, Concat(past, k), Concat(past, v), mask)           (GQA native)
    unpad    → [tokens, heads, head_dim]                                            (Gather)

The index tensors and the mask depend only on the batch layout, not on the layer, so the runtime
computes them once per step (`plan_step`) and every layer's lowering reads them. The pool is read
in place through the Gather (never copied whole); each sequence's used blocks are copied once per
layer, which is the lowering's cost against a kernel that reads blocks in place — measured in
bench/paged_attention_bench.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from llmc.plugins.paged_attention import PagedBatch

# Runtime-computed inputs shared by every layer's lowering.
PLAN_INPUTS = ("paged_gather_rows", "paged_block_ids", "paged_mask", "paged_scatter_rows")


@dataclass(frozen=True)
class StepPlan:
    """Index tensors and mask for one step's batch layout (see the module docstring)."""

    gather_rows: np.ndarray   # int64 [seqs, max_new]: packed row of each (sequence, new token)
    block_ids: np.ndarray     # int64 [seqs, max_blocks]: pool blocks holding each past
    mask: np.ndarray          # float [seqs, 1, max_new, max_blocks·block + max_new], 0 or lowest
    scatter_rows: np.ndarray  # int64 [tokens]: padded row of each packed token

    def feeds(self) -> dict[str, np.ndarray]:
        return dict(zip(PLAN_INPUTS, (self.gather_rows, self.block_ids, self.mask, self.scatter_rows)))


def plan_step(batch: PagedBatch, block_size: int, dtype=np.float32) -> StepPlan:
    """Derive the lowering's index tensors from the op's metadata inputs.

    Args:
        batch: block tables, past lengths and packed offsets of the step.
        block_size: tokens per pool block.
        dtype: the attention dtype (the mask's fill is its lowest finite value, so a padded row
            softmaxes to something finite instead of NaN).
    """
    starts = batch.query_start_loc.astype(np.int64)
    new_lens = np.diff(starts)
    seqs, max_new = len(new_lens), max(int(new_lens.max(initial=0)), 1)
    max_blocks = max(int((-(-batch.context_lens // block_size)).max(initial=0)), 1)
    offsets = np.arange(max_new)
    valid = offsets[None, :] < new_lens[:, None]
    gather_rows = np.where(valid, starts[:-1, None] + offsets[None, :], 0)
    block_ids = np.zeros((seqs, max_blocks), np.int64)
    for s in range(seqs):
        used = -(-int(batch.context_lens[s]) // block_size)
        block_ids[s, :used] = batch.block_tables[s, :used]
    past_slots = np.arange(max_blocks * block_size)
    past_visible = past_slots[None, None, :] < batch.context_lens[:, None, None]
    new_visible = offsets[None, None, :] <= offsets[None, :, None]
    visible = np.concatenate([np.broadcast_to(past_visible, (seqs, max_new, past_slots.size)),
                              np.broadcast_to(new_visible, (seqs, max_new, max_new))], axis=-1)
    mask = np.where(visible, 0, np.finfo(dtype).min).astype(dtype)[:, None]
    scatter_rows = (np.arange(seqs)[:, None] * max_new + offsets[None, :])[valid]
    return StepPlan(gather_rows, block_ids, mask, scatter_rows.astype(np.int64))


def lowering_nodes(prefix: str, query: str, key: str, value: str, key_cache: str, value_cache: str,
                   output: str, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   scale: float | None = None) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes computing one PagedAttention from its data inputs and the `PLAN_INPUTS`.

    Args:
        prefix: makes this layer's intermediate names unique.
        query, key, value, key_cache, value_cache, output: value names in the graph.
        num_heads, num_kv_heads, head_dim, block_size: the op's geometry.
        scale: attention scale; default 1/sqrt(head_dim).
    """
    rows, blocks, mask, scatter = PLAN_INPUTS
    n = lambda name: f"{prefix}/{name}"  # noqa: E731 — a local naming helper
    past_shape = helper.make_tensor(n("past_shape"), TensorProto.INT64, [4], [0, num_kv_heads, -1, head_dim])
    flat_shape = helper.make_tensor(n("flat_shape"), TensorProto.INT64, [3], [-1, num_heads, head_dim])
    nodes = []
    for name, source in (("q", query), ("k", key), ("v", value)):
        nodes += [helper.make_node("Gather", [source, rows], [n(f"{name}_padded")]),
                  helper.make_node("Transpose", [n(f"{name}_padded")], [n(f"{name}_heads")], perm=[0, 2, 1, 3])]
    for name, cache in (("k", key_cache), ("v", value_cache)):
        nodes += [
            helper.make_node("Gather", [cache, blocks], [n(f"{name}_blocks")]),  # [S, B, KV, blk, D]
            helper.make_node("Transpose", [n(f"{name}_blocks")], [n(f"{name}_past5")], perm=[0, 2, 1, 3, 4]),
            helper.make_node("Reshape", [n(f"{name}_past5"), n("past_shape")], [n(f"{name}_past")]),
            helper.make_node("Concat", [n(f"{name}_past"), n(f"{name}_heads")], [n(f"{name}_all")], axis=2),
        ]
    nodes += [
        helper.make_node("Attention", [n("q_heads"), n("k_all"), n("v_all"), mask], [n("attended")],
                         scale=float(head_dim ** -0.5 if scale is None else scale)),
        helper.make_node("Transpose", [n("attended")], [n("attended_rows")], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", [n("attended_rows"), n("flat_shape")], [n("attended_flat")]),
        helper.make_node("Gather", [n("attended_flat"), scatter], [output]),
    ]
    return nodes, [past_shape, flat_shape]


def standalone_model(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """One PagedAttention as a whole ONNX model (tests and benchmarks)."""
    nodes, constants = lowering_nodes("paged", "query", "key", "value", "key_cache", "value_cache",
                                      "output", num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_dim=head_dim, block_size=block_size)
    tensor = lambda name, shape, kind=dtype: helper.make_tensor_value_info(name, kind, shape)  # noqa: E731
    inputs = [tensor("query", ["tokens", num_heads, head_dim]),
              tensor("key", ["tokens", num_kv_heads, head_dim]),
              tensor("value", ["tokens", num_kv_heads, head_dim]),
              tensor("key_cache", ["blocks", num_kv_heads, block_size, head_dim]),
              tensor("value_cache", ["blocks", num_kv_heads, block_size, head_dim]),
              tensor(PLAN_INPUTS[0], ["seqs", "max_new"], TensorProto.INT64),
              tensor(PLAN_INPUTS[1], ["seqs", "max_blocks"], TensorProto.INT64),
              tensor(PLAN_INPUTS[2], ["seqs", 1, "max_new", "keys"]),
              tensor(PLAN_INPUTS[3], ["tokens"], TensorProto.INT64)]
    graph = helper.make_graph(nodes, "paged_attention", inputs,
                              [tensor("output", ["tokens", num_heads, head_dim])], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)
