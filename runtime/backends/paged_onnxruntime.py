"""One step of a paged engine on the CPU: packed tokens in, last-token logits out, new K/V into
the pool.

onnxruntime cannot run the engine's ``llmc::PagedAttention`` nodes, so the graph is cut at them
into segments, each an onnxruntime session; the runtime runs segment, attention (plugins/
paged_attention_cpu.py, reading the pool in place), segment, … and carries the values that cross
a cut. A value is placed in the first segment all its inputs are available to, so every layer's
projections, norms and MLP run in onnxruntime and only attention runs outside it. The step's new
keys and values are stored at the slots the sequences own afterwards — one vectorized scatter per
layer per step, never a copy of the pool.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from llmc.compiler.decoder_interface import Geometry
from llmc.compiler.engine_file import EngineFile
from llmc.compiler.onnx_io import FileRange, infer_shapes, serialize
from llmc.errors import LlmcError
from llmc.passes.graph import attr
from llmc.plugins.paged_attention import DOMAIN, OP_TYPE, PagedBatch
from llmc.plugins.paged_attention_cpu import POOL_TYPES, CpuPagedAttention, session_options, store
from llmc.plugins.paged_attention_onnx import register
from llmc.runtime.backends.onnxruntime import open_session


@dataclass(frozen=True)
class Segment:
    """The graph between two attentions, and the attention that follows it (None for the last)."""

    model: onnx.ModelProto | None  # None when no node falls between two attentions
    inputs: list[str]
    outputs: list[str]
    attention: onnx.NodeProto | None
    scale: float | None = None  # the attention's
    window: int = 0  # the attention's sliding window (0: full attention)
    softcap: float = 0.0  # the attention's score soft-capping (0: none)


def split_at_paged_attention(model: onnx.ModelProto) -> list[Segment]:
    """Cut a paged graph into segments around its PagedAttention nodes (see the module docstring).

    Raises LlmcError when the graph has none, or two that do not depend on each other (they
    would fall in one segment and need the same cut).
    """
    register()
    graph = infer_shapes(model).graph
    types = {v.name: v.type for v in [*graph.input, *graph.value_info, *graph.output]}
    weights = {t.name: t for t in graph.initializer}
    stage = dict.fromkeys([*weights, *(i.name for i in graph.input)], 0)
    attentions: dict[int, onnx.NodeProto] = {}
    members: dict[int, list[onnx.NodeProto]] = {}
    for node in graph.node:  # topologically sorted, as onnx requires
        at = max((stage[name] for name in node.input if name), default=0)
        if node.op_type == OP_TYPE and node.domain == DOMAIN:
            if at in attentions:
                raise LlmcError(f"paged engine: attention nodes '{attentions[at].name}' and '{node.name}' "
                                "do not depend on each other; the CPU backend cannot cut between them")
            attentions[at] = node
            stage.update(dict.fromkeys(node.output, at + 1))
        else:
            members.setdefault(at, []).append(node)
            stage.update(dict.fromkeys(node.output, at))
    if not attentions:
        raise LlmcError("paged engine: no PagedAttention node; it was built by an older llmc — recompile it")
    _move_constants_to_their_readers(graph, members)

    count = len(attentions) + 1
    # What segment k's nodes read, and what the attention after segment k reads.
    consumed = [{n for node in members.get(k, []) for n in node.input if n} for k in range(count)]
    attended = [set(attentions[k].input) if k in attentions else set() for k in range(count)]
    graph_outputs = {o.name for o in graph.output}
    segments = []
    for k in range(count):
        nodes = members.get(k, [])
        produced = {n for node in nodes for n in node.output}
        later = set().union(*consumed[k + 1:], *attended[k:]) | graph_outputs
        inputs = sorted(n for n in set().union(*(node.input for node in nodes)) - produced - {""}
                        if n not in weights)
        outputs = sorted(produced & later)
        sub = None
        if nodes:
            missing = [n for n in inputs + outputs if n not in types]
            if missing:
                raise LlmcError(f"paged engine: no type known for '{missing[0]}', which crosses a cut")
            used = {n for node in nodes for n in node.input}
            sub = helper.make_model(
                helper.make_graph(nodes, f"segment{k}", [helper.make_value_info(n, types[n]) for n in inputs],
                                  [helper.make_value_info(n, types[n]) for n in outputs],
                                  [weights[n] for n in sorted(used & set(weights))]),
                opset_imports=[o for o in model.opset_import if o.domain != DOMAIN], ir_version=model.ir_version)
        attention = attentions.get(k)
        # Engines built before sliding windows and soft-capping have neither attribute: 0, none.
        window, softcap = (attr(attention, "window", 0), attr(attention, "softcap", 0.0)) if attention else (0, 0.0)
        segments.append(Segment(sub, inputs, outputs, attention, attention and attr(attention, "scale"),
                                window, softcap))
    return segments


def _move_constants_to_their_readers(graph: onnx.GraphProto, members: dict[int, list[onnx.NodeProto]]) -> None:
    """A node computed from initializers alone (a weight's DequantizeLinear, a Constant) belongs
    with its first reader: left in the first segment, its result would cross every cut each step
    (the int8 engine dequantized all its weights every step that way, 14× slower)."""
    weights = {t.name for t in graph.initializer}
    constant: set[str] = set()
    for node in graph.node:
        if all(not i or i in weights or i in constant for i in node.input):
            constant.update(node.output)
    stage_of = {id(n): k for k, nodes in members.items() for n in nodes}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    for node in reversed(graph.node):
        if id(node) not in stage_of or not set(node.output) <= constant:
            continue
        targets = [stage_of.get(id(r)) for o in node.output for r in readers.get(o, [])]
        if not targets or any(t is None for t in targets):
            continue  # read by an attention (or an output): stays where it is
        target = min(targets)
        if target != stage_of[id(node)]:
            members[stage_of[id(node)]].remove(node)
            members.setdefault(target, []).append(node)
            stage_of[id(node)] = target
    order = {id(n): i for i, n in enumerate(graph.node)}
    for k in members:  # keep each segment's nodes in graph order
        members[k].sort(key=lambda n: order[id(n)])


class PagedDecoder:
    """The segments' sessions, the attention kernel and the pools they read.

    Args:
        model: the engine's graph (the output of the lower-paged-attention pass).
        geometry: the model's geometry.
        block_size: tokens per block (the value the graph was lowered with).
        num_blocks: blocks in the pool, shared by all sequences.
        max_seq_len: longest sequence the engine was sized for; default the model's positions.
        threads: CPU threads; None uses every core.
        kv_dtype: the pool's element type ("float32" or "float16").
        weights: where the data `model`'s external tensors reference as "model.onnx.data" is
            (a large engine's data section, read by onnxruntime from disk); None when inline.
    """

    def __init__(self, model: onnx.ModelProto, geometry: Geometry, block_size: int, num_blocks: int,
                 max_seq_len: int | None = None, threads: int | None = None, kv_dtype: str = "float32",
                 weights: FileRange | None = None):
        self.geometry, self.block_size = geometry, block_size
        self.max_seq_len = max_seq_len or geometry.max_positions
        options = session_options(threads)
        self._unpacked = tempfile.TemporaryDirectory(prefix="llmc-engine-")
        self.segments = split_at_paged_attention(model)
        self.windows = tuple(seg.window for seg in self.segments if seg.attention is not None)
        self._sessions = [seg.model and open_session(
            serialize(seg.model) if weights is None else {"model.onnx": seg.model.SerializeToString(),
                                                          "model.onnx.data": weights},
            self._unpacked.name, options) for seg in self.segments]
        self.attention = CpuPagedAttention(geometry.num_heads, geometry.num_kv_heads, geometry.head_dim,
                                           block_size, threads, kv_dtype)
        shape = (num_blocks, geometry.num_kv_heads, block_size, geometry.head_dim)
        # Filled, not just allocated: np.zeros maps pages lazily, and the kernel zeroing them on
        # first write cost up to 70 ms in the step that first used fresh blocks.
        self.pools = {f"{part}_cache.{i}": np.full(shape, 0, kv_dtype)
                      for i in range(geometry.num_layers) for part in ("key", "value")}

    @classmethod
    def from_engine(cls, engine: EngineFile, threads: int | None = None) -> "PagedDecoder":
        """The decoder of a paged engine file, with the pool its manifest sized."""
        manifest, paged = engine.manifest, engine.manifest["paged"]
        # Past 2 GB the graph references its weights in the engine's data section, unread.
        model = onnx.load_from_string(bytes(engine.sections["model.onnx"]))
        weights = FileRange(engine.path, engine.offsets["model.onnx.data"]) if "model.onnx.data" in engine.sections else None
        # Engines written before kv_dtype had float32 pools.
        return cls(model, Geometry(**manifest["geometry"]), paged["block_size"], paged["num_blocks"],
                   paged["max_seq_len"], threads, paged.get("kv_dtype", "float32"), weights)

    def step(self, tokens: np.ndarray, positions: np.ndarray, batch: PagedBatch,
             rows: np.ndarray | None = None) -> np.ndarray:
        """Run one packed step; stores its keys and values; returns the logits of the packed
        `rows` (default: each sequence's last token)."""
        layout = self.attention.layout(batch, self.windows)
        rows = batch.query_start_loc[1:] - 1 if rows is None else rows
        values = {"input_ids": tokens[None], "position_ids": positions[None],
                  "logits_rows": np.asarray(rows, np.int64), **self.pools}
        stores = []
        for segment, session in zip(self.segments, self._sessions):
            if session is not None:
                outputs = session.run(segment.outputs, {name: values[name] for name in segment.inputs})
                values.update(zip(segment.outputs, outputs))
            node = segment.attention
            if node is not None:
                query, key, value, key_cache, value_cache = (values[name] for name in node.input[:5])
                # In the pool's type before attention reads them: a step sees its own keys and
                # values as every later step will, so outputs do not depend on how prompts are chunked.
                key, value = (np.ascontiguousarray(a, key_cache.dtype) for a in (key, value))
                attended = self.attention(query, key, value, key_cache, value_cache, layout, segment.scale,
                                          segment.window, segment.softcap)
                values[node.output[0]] = attended.astype(query.dtype, copy=False)  # the kernel computes in fp32
                stores += [(key_cache, key), (value_cache, value)]
        blocks, offsets = self._slots(batch)
        for pool, new in stores:
            bits = POOL_TYPES[pool.dtype]  # Numba has no float16: it stores the bits
            store(pool.view(bits), new.view(bits), blocks, offsets)
        return values["logits"][0]

    def warm_up(self, tokens: int, seqs: int) -> None:
        """Run one throw-away step of `tokens` tokens (one prompt, the rest decodes of `seqs`
        sequences), so the first real steps don't pay for onnxruntime's first allocations and
        kernel choices (measured: 95 ms instead of 25 on the serving benchmark's first mixed step).
        It writes only into pool blocks no request owns yet; nothing reads them before a
        request's own keys and values overwrite them."""
        blocks = len(next(iter(self.pools.values())))
        decodes = max(0, min(seqs - 1, tokens - 1, blocks - 1))
        prompt = max(1, min(tokens - decodes, (blocks - decodes) * self.block_size))
        width = -(-prompt // self.block_size)
        tables = np.zeros((decodes + 1, width), np.int64)
        tables[0] = np.arange(width)
        tables[1:, 0] = width + np.arange(decodes)
        starts = np.concatenate([[0], prompt + np.arange(decodes + 1)])
        batch = PagedBatch(tables, np.array([0] + [1] * decodes), starts)
        positions = np.concatenate([np.arange(prompt), np.ones(decodes, np.int64)])
        self.step(np.zeros(prompt + decodes, np.int64), positions, batch)

    def _slots(self, batch: PagedBatch) -> tuple[np.ndarray, np.ndarray]:
        """Pool block and offset of every packed token's slot (past length + its index)."""
        starts = np.asarray(batch.query_start_loc, np.int64)
        sequence = np.repeat(np.arange(batch.num_seqs), np.diff(starts))  # of each packed token
        slots = np.asarray(batch.context_lens, np.int64)[sequence] + np.arange(starts[-1]) - starts[sequence]
        blocks = np.asarray(batch.block_tables, np.int64)[sequence, slots // self.block_size]
        return blocks, slots % self.block_size
