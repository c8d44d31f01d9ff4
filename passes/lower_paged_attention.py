"""Lower a decoder with past/present tensors to the paged interface (``llmc::paged_attention``).

Input: a graph optimized to level 2 — every layer's attention is one 3-D ``Attention`` node that
reads ``past_key_values.{i}.key|value`` and writes ``present.{i}.key|value``. Output: the packed,
paged interface the serving runtime drives:

    inputs   input_ids, position_ids [1, tokens]     new tokens of all sequences, packed
             key_cache.{i}, value_cache.{i}          [blocks, kv_heads, block_size, head_dim], in
                                                     the model's dtype or the one asked for
             block_tables, context_lens,             the step's layout, as the op defines them
             query_start_loc                         (plugins/paged_attention.py)
             logits_rows [rows]                      the packed rows whose logits the step needs
                                                     (each sequence's last token, or any tokens:
                                                     its own dimension, since TensorRT holds
                                                     equally named input dimensions equal)
    outputs  logits [1, rows, vocab]                 only the rows asked for
             new_key.{i}, new_value.{i}              [tokens, kv_heads, head_dim], for the runtime
                                                     to store in the pool (the graph never writes it)

Packed tokens run as one sequence of batch 1 through every per-token op (embeddings, norms,
projections, rotary with explicit positions); only attention needs to know where sequences
start, and the paged op knows. Each Attention becomes one ``PagedAttention`` node (domain
``llmc``), which each backend implements: the CPU backend runs it between graph segments
(runtime/backends/cpu.py), TensorRT as a plugin. The attention mask and its
subgraph die with the old interface.

Sliding windows: the fused Attention's mask is dropped with the old interface, so a layer's window
(Mistral, Gemma-2/3's local layers) comes from the model's metadata (`DecoderInterface.windows`)
and becomes its PagedAttention's ``window`` attribute. The Attention's ``softcap`` (Gemma-2) is
carried over as it is. Layer i's Attention is the one that reads
``past_key_values.{i}.key``.

Preconditions: run last, after fuse-attention. A 4-D Attention (one attention-3d-layout did not
convert, or a pipeline without it) is given the 3-D form here (`to_3d_attention`). A layer whose
attention was not canonicalized, or whose 4-D Attention cannot be made 3-D, is an error naming it:
silently leaving a dense attention behind would attend across sequences.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from llmc.errors import LlmcError
from llmc.formats.onnx_io import infer_value_info
from llmc.passes.attention_3d_layout import Attention3dLayout
from llmc.passes.base import Pass, PassResult
from llmc.passes.contrib_ops import DOMAIN as CONTRIB_DOMAIN
from llmc.passes.graph import DEFAULT_DOMAINS, Graph, attr
from llmc.passes.logit_rows import hoist_logit_rows
from llmc.plugins.paged_attention import BLOCK_SIZES, DEFAULT_BLOCK_SIZE, DOMAIN
from llmc.plugins.paged_attention_onnx import METADATA_INPUTS, paged_attention_node


class LowerPagedAttention(Pass):
    name = "lower-paged-attention"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str | None = None,
                 windows: Sequence[int] | None = None, num_heads: int | None = None):
        """Args:
            block_size: tokens per pool block.
            kv_dtype: the pool inputs' element type ("float16", "float32"); None: the model's.
            windows: each layer's attention window, 0 for full attention; None: all full.
            num_heads: the model's query heads, for a 4-D Attention whose query shape does not
                give them (None: the ``llmc.num_heads`` metadata).
        """
        if block_size not in BLOCK_SIZES:
            raise LlmcError(f"--block-size: {block_size} is not supported (powers of two from 1 to 256)")
        self.block_size, self.kv_dtype, self.num_heads = block_size, kv_dtype, num_heads
        self.windows = None if windows is None else tuple(windows)

    def run(self, model: onnx.ModelProto) -> PassResult:
        to_3d_attention(model, self.num_heads)
        graph = Graph(model)
        inputs = {i.name: i for i in model.graph.input}
        layers = sum(1 for name in inputs if name.startswith("past_key_values.") and name.endswith(".key"))
        if "position_ids" not in inputs and "position_ids" not in graph.producer:  # canonicalize-gqa computes it
            raise LlmcError("paged lowering: the graph has no position_ids input")
        windows = self.windows or (0,) * layers
        if len(windows) != layers:
            raise LlmcError(f"paged lowering: {len(windows)} layer windows for a graph of {layers} layers")
        attentions = attentions_by_layer(model, graph, layers, "paged lowering")

        past = inputs["past_key_values.0.key"].type.tensor_type.shape.dim
        kv_heads, head_dim = past[1].dim_value, past[3].dim_value
        dtype = inputs["past_key_values.0.key"].type.tensor_type.elem_type
        pool_dtype = dtype if self.kv_dtype is None else helper.np_dtype_to_tensor_dtype(np.dtype(self.kv_dtype))
        nodes, constants, new_outputs, attended = [], [], [], []
        for layer in range(layers):
            attention = attentions[layer]
            heads = attr(attention, "q_num_heads")
            nodes_, constants_, attended_ = self._lower(attention, layer, heads, kv_heads, head_dim, dtype,
                                                        windows[layer])
            nodes += nodes_
            constants += constants_
            attended.append(attended_)
            new_outputs += [(f"new_key.{layer}", kv_heads), (f"new_value.{layer}", kv_heads)]

        kept = [n for n in model.graph.node if (n.op_type != "Attention" or id(n) not in
                {id(a) for a in attentions.values()}) and "position_ids" not in n.output]  # now fed
        nodes.append(select_logit_rows(graph))
        vocab = next(o for o in model.graph.output if o.name == "logits").type.tensor_type.shape.dim[2].dim_value

        value = helper.make_tensor_value_info
        new_inputs = [value("input_ids", TensorProto.INT64, [1, "tokens"]),
                      value("position_ids", TensorProto.INT64, [1, "tokens"])]
        for layer in range(layers):
            for part in ("key", "value"):
                new_inputs.append(value(f"{part}_cache.{layer}", pool_dtype,
                                        ["blocks", kv_heads, self.block_size, head_dim]))
        new_inputs += METADATA_INPUTS + [value("logits_rows", TensorProto.INT64, ["rows"])]
        outputs = [value("logits", dtype, [1, "rows", vocab])]
        outputs += [value(name, dtype, ["tokens", heads_, head_dim]) for name, heads_ in new_outputs]

        del model.graph.input[:]
        model.graph.input.extend(new_inputs)
        del model.graph.output[:]
        model.graph.output.extend(outputs)
        del model.graph.node[:]
        model.graph.node.extend(kept + nodes)
        model.graph.initializer.extend(constants)
        model.graph.value_info.extend(attended)
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
        drop_stale_inputs(model, stale_inputs(inputs), "paged lowering", "the paged interface")
        hoist_logit_rows(model)
        windowed = sum(1 for w in windows if w)
        report = f"block size {self.block_size}, {layers} layers" + (
            f", {windowed} with a sliding window ({', '.join(str(w) for w in sorted(set(windows) - {0}))})"
            if windowed else "")
        return PassResult(model, layers, [report])

    def _lower(self, attention: onnx.NodeProto, layer: int, heads: int, kv_heads: int, head_dim: int,
               dtype: int, window: int):
        prefix = f"paged.{layer}"
        rows = lambda name, count: helper.make_tensor(name, TensorProto.INT64, [3], [-1, count, head_dim])  # noqa: E731
        flat = helper.make_tensor(f"{prefix}/flat", TensorProto.INT64, [3], [1, -1, heads * head_dim])
        constants = [rows(f"{prefix}/q_rows", heads), rows(f"{prefix}/kv_rows", kv_heads), flat]
        query, key, value = attention.input[:3]
        scale = attr(attention, "scale")
        # Attention-23's softcap caps scores before the mask, as the paged op's does.
        softcap = attr(attention, "softcap", 0.0)
        nodes = [helper.make_node("Reshape", [query, f"{prefix}/q_rows"], [f"{prefix}/q"]),
                 helper.make_node("Reshape", [key, f"{prefix}/kv_rows"], [f"new_key.{layer}"]),
                 helper.make_node("Reshape", [value, f"{prefix}/kv_rows"], [f"new_value.{layer}"]),
                 paged_attention_node(f"{prefix}/q", f"new_key.{layer}", f"new_value.{layer}",
                                      f"key_cache.{layer}", f"value_cache.{layer}", f"{prefix}/out",
                                      name=f"{prefix}/PagedAttention",
                                      scale=head_dim ** -0.5 if scale is None else scale, window=window,
                                      softcap=softcap),
                 helper.make_node("Reshape", [f"{prefix}/out", f"{prefix}/flat"], [attention.output[0]])]
        attended = helper.make_tensor_value_info(f"{prefix}/out", dtype, ["tokens", heads, head_dim])
        return nodes, constants, attended


def select_logit_rows(graph: Graph) -> onnx.NodeProto:
    """Keep only the `logits_rows` tokens: before the vocabulary projection when it projects by
    a constant weight (a MatMul, by an initializer or its DequantizeLinear; a MatMulNBits),
    possibly followed by a Cast, so that a prefill step projects one row per sequence, not every
    token (the projection is ~15% of the serving model's prefill in fp32; measured on
    SmolLM2-135M with --weights int4, its int8 projection of 49,152 words took 50-65 ms of a
    262 ms first token after a 128-token prompt); else after it. Rows are projected
    independently either way: the logits are the same."""
    head = graph.producer["logits"]
    projection = head
    if head.op_type == "Cast" and head.domain in DEFAULT_DOMAINS and len(graph.consumers.get(head.input[0], [])) == 1:
        projection = graph.producer.get(head.input[0])
    if projection is not None and _projects_by_constant(graph, projection):
        rows = helper.make_node("Gather", [projection.input[0], "logits_rows"], ["logits_hidden"], axis=1)
        projection.input[0] = "logits_hidden"
        return rows
    head.output[list(head.output).index("logits")] = "logits_all"
    return helper.make_node("Gather", ["logits_all", "logits_rows"], ["logits"], axis=1)


def _projects_by_constant(graph: Graph, node: onnx.NodeProto) -> bool:
    """Whether `node` multiplies its first input, row by row, by a weight known at compile time."""
    if node.op_type == "MatMulNBits" and node.domain == CONTRIB_DOMAIN:
        return True
    if node.op_type != "MatMul" or node.domain not in DEFAULT_DOMAINS:
        return False
    weight = graph.producer.get(node.input[1])
    if weight is not None and weight.op_type == "DequantizeLinear" and weight.domain in DEFAULT_DOMAINS:
        return all(name in graph.initializers for name in weight.input if name)
    return node.input[1] in graph.initializers


def to_3d_attention(model: onnx.ModelProto, num_heads: int | None = None) -> None:
    """Give every 4-D Attention the 3-D layout the paged forms read (attention-3d-layout, whose
    conversions cover any 4-D Attention whose head counts and head size are known), shapes
    refreshed after; a graph without one is left as it is.

    Args:
        model: the optimized graph, changed in place.
        num_heads: the model's query heads (None: the ``llmc.num_heads`` metadata).
    """
    graph = Graph(model)
    if all(graph.rank(n.input[0]) != 4 for n in model.graph.node
           if n.op_type == "Attention" and n.domain in DEFAULT_DOMAINS):
        return
    if Attention3dLayout(num_heads).run(model).matches:
        del model.graph.value_info[:]
        model.graph.value_info.extend(infer_value_info(model, data_prop=True))


def attentions_by_layer(model: onnx.ModelProto, graph: Graph, layers: int, stage: str) -> dict[int, onnx.NodeProto]:
    """Each layer's 3-D Attention node (layer i's reads ``past_key_values.{i}.key``); raises
    LlmcError naming the first layer that has none, or a 4-D one."""
    attentions = {}
    for node in model.graph.node:
        if node.op_type == "Attention" and node.domain in DEFAULT_DOMAINS and len(node.input) >= 6:
            layer = _layer_of(node.input[4])
            if layer is not None:
                attentions[layer] = node
    for layer in range(layers):
        node = attentions.get(layer)
        if node is None:
            raise LlmcError(f"{stage}: layer {layer}'s attention could not be canonicalized "
                            "to one Attention node (see the fuse-attention report)")
        if graph.rank(node.input[0]) != 3:
            raise LlmcError(f"{stage}: layer {layer}'s Attention ({node.name}) is 4-D and has no 3-D form: "
                            "its head counts or head size are not known from the graph, or K and V differ in heads")
    return attentions


def drop_stale_inputs(model: onnx.ModelProto, stale: set[str], stage: str, interface: str,
                      allowed: tuple[str, ...] = ()) -> None:
    """After the interface changed: the nodes nothing reads any more go, and a node still reading
    one of the `stale` values (the attention mask, the past inputs), other than the `allowed` op
    types, is an error naming it."""
    graph = Graph(model)
    graph._replace_nodes(list(model.graph.node))  # toposort: new nodes were appended
    graph.remove_dead()
    for node in model.graph.node:
        if node.op_type in allowed:
            continue
        # torch.export may read the batch size off any input with that dim, a past one
        # included (GPT-2); the new interface's batch is input_ids' too.
        if (node.op_type == "Shape" and node.input[0] in stale and node.input[0] != "attention_mask"
                and attr(node, "start", 0) == 0 and attr(node, "end", None) == 1):
            node.input[0] = "input_ids"
        if stale & set(node.input):
            raise LlmcError(f"{stage}: node '{node.name}' ({node.op_type}) still reads "
                            f"{sorted(stale & set(node.input))[0]}, which {interface} drops")


def stale_inputs(old_inputs) -> set[str]:
    """The decoder inputs a lowered interface no longer offers as they were: the attention mask
    and the past keys and values."""
    return {"attention_mask"} | {i for i in old_inputs if i.startswith("past_key_values.")}


def _layer_of(past_name: str) -> int | None:
    parts = past_name.split(".")
    if len(parts) == 3 and parts[0] == "past_key_values" and parts[2] == "key" and parts[1].isdigit():
        return int(parts[1])
    return None
