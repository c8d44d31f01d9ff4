"""The graph a TensorRT build would receive, run on the CPU, for accuracy checks without TensorRT.

`capture_tensorrt_graph` records the final graph `compile_model` hands to TensorRT's network check
(compiler/build.py: plugin nodes mapped for the parser, norms in their standard form): the graph a
`--backend tensorrt` build parses, and the one `--dry-run` checks.

`TensorRTForm` runs that graph with every node but the plugin nodes in onnxruntime, unchanged: the
graph is cut at its ``paged_attention`` plugin nodes (as compiler/segments.py cuts a CPU engine),
and each plugin node is computed by the op's NumPy reference (plugins/paged_attention.py). A window
runs as the serving runtime runs it: in steps of at most `step_tokens` tokens, each step's new keys
and values stored into the pool afterwards in the pool's own type, so later steps read the past
through the block table. It has what precision/check.py `check` reads of an engine (the manifest's
geometry, tokenizer, max_seq_len, logits), so `llmc check`'s own metrics measure it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
from onnx import helper

from llmc.compiler import targets
from llmc.compiler.segments import split_at_paged_attention
from llmc.compiler.tensorrt_network import PLUGIN_NAME, PLUGIN_NAMESPACE
from llmc.formats.onnx_io import serialize
from llmc.formats.sessions import open_session, session_options
from llmc.plugins.paged_attention import DOMAIN, OP_TYPE, paged_attention_reference


def capture_tensorrt_graph(monkeypatch) -> list[onnx.ModelProto]:
    """Record each graph `compile_model` checks for TensorRT from now on (the list fills as it runs)."""
    graphs: list[onnx.ModelProto] = []
    check = targets.check_network

    def recording(model):
        graphs.append(model)
        return check(model)

    monkeypatch.setattr(targets, "check_network", recording)
    return graphs


def as_cpu_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose plugin nodes are the ``llmc`` PagedAttention nodes they were mapped from (same
    inputs, output and attributes), the form compiler/segments.py cuts at; every other node as is."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    plugins = 0
    for node in copy.graph.node:
        given = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != PLUGIN_NAME or given.get("plugin_namespace") != PLUGIN_NAMESPACE.encode():
            continue
        kept = [a for a in node.attribute if a.name not in ("plugin_namespace", "plugin_version")]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.op_type, node.domain = OP_TYPE, DOMAIN
        plugins += 1
    assert plugins, "the graph has no llmc plugin node"
    copy.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return copy


class TensorRTForm:
    """A TensorRT graph of `compile_model`, run one sequence at a time from an empty pool of
    `max_seq_len` tokens."""

    def __init__(self, model: onnx.ModelProto, tokenizer, max_seq_len: int, step_tokens: int = 96):
        inputs = {v.name: v for v in model.graph.input}
        logits = next(o for o in model.graph.output if o.name == "logits")
        vocab_size = logits.type.tensor_type.shape.dim[-1].dim_value
        self.manifest = SimpleNamespace(geometry=SimpleNamespace(vocab_size=vocab_size))
        self.tokenizer, self.max_seq_len, self.step_tokens = tokenizer, max_seq_len, step_tokens
        self.types = {name: helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type) for name, v in inputs.items()}
        self.pools = [name for name in inputs if name.startswith(("key_cache.", "value_cache."))]
        kv_heads, self.block_size, head_dim = (d.dim_value for d in
                                               inputs["key_cache.0"].type.tensor_type.shape.dim[1:])
        self.pool_shape = (-(-max_seq_len // self.block_size), kv_heads, self.block_size, head_dim)
        options = session_options(alone=True, optimize=False)
        self.segments = [(graph and open_session(serialize(graph), options), segment)
                         for graph, segment in split_at_paged_attention(as_cpu_nodes(model))]
        # Each layer's new keys and values (graph outputs) and the pools they are stored into.
        self.stores = [(f"new_{part}.{layer}", f"{part}_cache.{layer}")
                       for layer in range(len(self.pools) // 2) for part in ("key", "value")]

    def logits(self, token_ids) -> np.ndarray:
        """[tokens, vocab] logits at every position, the sequence run in steps through the pool."""
        ids = np.asarray(token_ids, np.int64)
        pools = {name: np.zeros(self.pool_shape, self.types[name]) for name in self.pools}
        rows = []
        for start in range(0, len(ids), self.step_tokens):
            step = ids[start:start + self.step_tokens]
            layout = {"input_ids": step[None], "position_ids": np.arange(start, start + len(step))[None],
                      "block_tables": np.arange(self.pool_shape[0])[None], "context_lens": np.array([start]),
                      "query_start_loc": np.array([0, len(step)]), "logits_rows": np.arange(len(step))}
            values = self._run({**pools, **{name: v.astype(self.types[name]) for name, v in layout.items()}})
            rows.append(values["logits"][0].astype(np.float32))
            slots = np.arange(start, start + len(step))
            for new, pool in self.stores:
                pools[pool][slots // self.block_size, :, slots % self.block_size] = values[new].astype(pools[pool].dtype)
        return np.concatenate(rows)

    def _run(self, values: dict) -> dict:
        for session, segment in self.segments:
            if session is not None:
                values.update(zip(segment.outputs, session.run(list(segment.outputs),
                                                               {n: values[n] for n in segment.inputs})))
            call = segment.attention
            if call is not None:
                values[call.output] = paged_attention_reference(*(values[n] for n in call.inputs), scale=call.scale,
                                                                window=call.window, softcap=call.softcap)
        return values
