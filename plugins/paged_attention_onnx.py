"""The CPU implementation of ``llmc::paged_attention``: a lowering to standard ONNX ops.

onnxruntime has no CPU kernel for paged attention, and a Python custom op copies every output
through Python lists (DESIGN.md), so the op is lowered to ops onnxruntime runs natively, with
every sequence of the step packed into one ragged attention:

    past     Gather(pool, the used blocks of all sequences, concatenated)
             → [1, kv_heads, those blocks · block_size, head_dim]
    attend   Attention-23(q [1, heads, tokens, D], Concat(past, k), Concat(past, v), mask)
    mask     token t of sequence s sees s's cached slots and s's new tokens up to itself

Nothing is padded to the longest sequence: a step gathers exactly the blocks its sequences use,
and a long context in the batch costs only its own reads (padding every sequence to the longest
context made mixed-length steps several times slower). The block list and the mask depend only
on the batch layout, so the runtime computes them once per step (`plan_step`) and every layer's
lowering reads them. The pool is read in place through the Gather, never copied whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from llmc.plugins.paged_attention import PagedBatch

# Runtime-computed inputs shared by every layer's lowering.
PLAN_INPUTS = ("paged_block_ids", "paged_mask")


@dataclass(frozen=True)
class StepPlan:
    """The step's block list and mask (see the module docstring)."""

    block_ids: np.ndarray  # int64 [used blocks]: every sequence's blocks, sequence after sequence
    mask: np.ndarray       # float [1, 1, tokens, used blocks · block + tokens]: 0 or lowest

    def feeds(self) -> dict[str, np.ndarray]:
        return dict(zip(PLAN_INPUTS, (self.block_ids, self.mask)))


def plan_step(batch: PagedBatch, block_size: int, dtype=np.float32) -> StepPlan:
    """Derive the lowering's block list and mask from the op's metadata inputs.

    Args:
        batch: block tables, past lengths and packed offsets of the step.
        block_size: tokens per pool block.
        dtype: the attention dtype (the mask's fill is its lowest finite value).
    """
    starts = batch.query_start_loc.astype(np.int64)
    tokens = int(starts[-1])
    used = -(-batch.context_lens.astype(np.int64) // block_size)
    block_ids = np.concatenate([batch.block_tables[s, :used[s]] for s in range(batch.num_seqs)]
                               + [np.zeros(0, np.int64)]).astype(np.int64)
    past_width = len(block_ids) * block_size
    visible = np.zeros((tokens, past_width + tokens), bool)
    past_offset = 0
    for s in range(batch.num_seqs):
        rows = slice(starts[s], starts[s + 1])
        visible[rows, past_offset:past_offset + int(batch.context_lens[s])] = True
        new = int(starts[s + 1] - starts[s])
        visible[rows, past_width + starts[s]:past_width + starts[s + 1]] = np.tri(new, dtype=bool)
        past_offset += int(used[s]) * block_size
    mask = np.where(visible, 0, np.finfo(dtype).min).astype(dtype)[None, None]
    return StepPlan(block_ids, mask)


def plan_inputs(dtype: int = TensorProto.FLOAT) -> list[onnx.ValueInfoProto]:
    """Graph inputs for `PLAN_INPUTS`."""
    return [helper.make_tensor_value_info(PLAN_INPUTS[0], TensorProto.INT64, ["used_blocks"]),
            helper.make_tensor_value_info(PLAN_INPUTS[1], dtype, [1, 1, "tokens", "keys"])]


def lowering_nodes(prefix: str, query: str, key: str, value: str, key_cache: str, value_cache: str,
                   output: str, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   scale: float | None = None) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes computing one PagedAttention ([tokens, heads, head_dim] in and out).

    Args:
        prefix: makes this layer's intermediate names unique.
        query, key, value, key_cache, value_cache, output: value names in the graph.
        num_heads, num_kv_heads, head_dim, block_size: the op's geometry.
        scale: attention scale; default 1/sqrt(head_dim).
    """
    blocks, mask = PLAN_INPUTS
    n = lambda name: f"{prefix}/{name}"  # noqa: E731 — a local naming helper
    past_shape = helper.make_tensor(n("past_shape"), TensorProto.INT64, [4], [1, num_kv_heads, -1, head_dim])
    batch_axis = helper.make_tensor(n("batch_axis"), TensorProto.INT64, [1], [0])
    nodes = []
    for name, source in (("q", query), ("k", key), ("v", value)):
        nodes += [helper.make_node("Transpose", [source], [n(f"{name}_heads")], perm=[1, 0, 2]),
                  helper.make_node("Unsqueeze", [n(f"{name}_heads"), n("batch_axis")], [n(f"{name}_4d")])]
    for name, cache in (("k", key_cache), ("v", value_cache)):
        nodes += [
            helper.make_node("Gather", [cache, blocks], [n(f"{name}_blocks")]),  # [used, KV, blk, D]
            helper.make_node("Transpose", [n(f"{name}_blocks")], [n(f"{name}_by_head")], perm=[1, 0, 2, 3]),
            helper.make_node("Reshape", [n(f"{name}_by_head"), n("past_shape")], [n(f"{name}_past")]),
            helper.make_node("Concat", [n(f"{name}_past"), n(f"{name}_4d")], [n(f"{name}_all")], axis=2),
        ]
    nodes += [
        helper.make_node("Attention", [n("q_4d"), n("k_all"), n("v_all"), mask], [n("attended")],
                         scale=float(head_dim ** -0.5 if scale is None else scale)),
        helper.make_node("Squeeze", [n("attended"), n("batch_axis")], [n("attended_heads")]),
        helper.make_node("Transpose", [n("attended_heads")], [output], perm=[1, 0, 2]),
    ]
    return nodes, [past_shape, batch_axis]


def standalone_model(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """One PagedAttention as a whole ONNX model (tests and benchmarks)."""
    nodes, constants = lowering_nodes("paged", "query", "key", "value", "key_cache", "value_cache",
                                      "output", num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_dim=head_dim, block_size=block_size)
    tensor = lambda name, shape: helper.make_tensor_value_info(name, dtype, shape)  # noqa: E731
    inputs = [tensor("query", ["tokens", num_heads, head_dim]),
              tensor("key", ["tokens", num_kv_heads, head_dim]),
              tensor("value", ["tokens", num_kv_heads, head_dim]),
              tensor("key_cache", ["blocks", num_kv_heads, block_size, head_dim]),
              tensor("value_cache", ["blocks", num_kv_heads, block_size, head_dim]),
              *plan_inputs(dtype)]
    graph = helper.make_graph(nodes, "paged_attention", inputs,
                              [tensor("output", ["tokens", num_heads, head_dim])], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)
