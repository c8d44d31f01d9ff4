"""Lower a decoder with past/present tensors to the single-sequence interface: one whole-graph
onnxruntime session for steps that hold one sequence, or one new token for each of several
(runtime/backends/whole_graph.py).

A paged engine's step runs a session per segment and the attention kernel between them; for a
step of one sequence that is most of the step (25M Llama, batch-1 decode: 7 segment runs, 6
kernel calls and their Python 1.3 ms of a 5.9 ms step). This graph runs the same step in one
call: every layer's attention becomes onnxruntime's ``com.microsoft::GroupQueryAttention`` over a
key/value buffer that the runtime binds as both past and present, so the op appends the step's
keys and values in place (its shared-buffer mode) and reads nothing but the sequence's own.

Input: the graph the paged lowering takes (level 2, 3-D Attention nodes reading
``past_key_values.{i}.*`` and writing ``present.{i}.*``). Output interface:

    inputs   input_ids, position_ids [1, tokens]     the step's new tokens, sequence after
                                                     sequence, as many for each
             past_key_values.{i}.key|value           [sequences, kv_heads, capacity, head_dim],
                                                     the buffer, a row per sequence
             seqlens_k [sequences] int32             positions each holds after the step, minus one
             total_sequence_length [] int32          the most positions one holds after the step
             logits_rows [rows]                      which of the step's tokens get logits
    outputs  logits [1, rows, vocab]
             present.{i}.key|value                   the same buffer (bound to the same memory)

Where a layer's query, key and value are one Split of one projection and rotary embedding
(RotaryEmbedding-23, rotate-half, full width) turns its query and key, the op takes the packed
projection and applies rotary itself (do_rotary) from cos/sin tables of every position up to
`positions`, evaluated here from the graph's own table subgraph: the Split, the two
RotaryEmbedding nodes and the per-step table computation leave the step (measured on the 25M
Llama, int4: 66 small ops a step → 28). Elsewhere rotary stays where the passes put it and the op
gets query, key and value apart. The op reads the step's tokens as [sequences, tokens each,
width]: where every other node of the step gives the same values in that layout (elementwise
ops, products by a weight, norms over the last axis; `_layout_free`), the token inputs are
reshaped to it once and the whole step runs in it, else each op's inputs are reshaped to it and
its output back (no copy either way). A layer's window becomes local_window_size (the keys a query
sees, its own included, as the paged op counts them) and the Attention's softcap carries over.

With `pad_lone_token` (the graph's metadata then says `PADDING_ROW`), the runtime may give a
step of a single token a padding row: the same token again, one position on, its keys and values
landing one past the sequence's, where the next step writes, and its logits not asked for.
onnxruntime computes a lone query row with another attention kernel than two or more, whose
rounding differs (2.7e-7 in the attention output), while rows of two or more come out bit for bit
the same however many there are, and the linear layers compute each row alone. So a padded
sequence's logits do not depend on how many tokens its steps held, which keeps speculative
decoding (runtime/prompt_lookup.py) exact on engines whose linear layers quantize their input
(MatMulNBits' int8 compute turns such rounding into different codes, then different tokens); a
request that does not guess runs unpadded, with nothing of the padding in its graph. The buffer
and the rotary tables then hold one position more than `positions`. Where linear layers are fp32
MatMuls, which round a lone row differently too, it is left out.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from llmc.errors import LlmcError
from llmc.formats.manifest import PADDING_ROW
from llmc.formats.onnx_io import tensor_array
from llmc.passes import contrib_ops
from llmc.passes.base import Pass, PassResult
from llmc.passes.graph import Graph, attr
from llmc.passes.logit_rows import PACKING, hoist_logit_rows
from llmc.passes.lower_paged_attention import attentions_by_layer, drop_stale_inputs, select_logit_rows, stale_inputs

STAGE = "single-sequence lowering"
# The step's tokens sequence by sequence: [sequences, -1] for the token inputs where the whole step
# runs so, else [sequences, -1, 0] for each attention op's inputs.
SEQUENCES_SHAPE = "single.sequences_shape"
PACKED_SHAPE = "single.packed_shape"  # PACKING: back to the step's tokens packed


class LowerSingleSequence(Pass):
    name = "lower-single-sequence"

    def __init__(self, windows: Sequence[int] | None = None, positions: int | None = None,
                 pad_lone_token: bool = False):
        """Args:
            windows: each layer's attention window, 0 for full attention; None: all full.
            positions: the most positions a sequence reaches (the rotary tables' length); None
                leaves rotary embedding out of the attention op.
            pad_lone_token: room for a lone token's padding row (module docstring). A padded step
                of one token costs more (SmolLM2-135M int4: 12%, two rows through every layer),
                and is of no use where the linear layers round a lone row differently anyway
                (fp32 MatMul).
        """
        self.windows = None if windows is None else tuple(windows)
        self.positions = positions
        self.pad_lone_token = pad_lone_token

    def run(self, model: onnx.ModelProto) -> PassResult:
        contrib_ops.register()
        graph = Graph(model)
        inputs = {i.name: i for i in model.graph.input}
        layers = sum(1 for name in inputs if name.startswith("past_key_values.") and name.endswith(".key"))
        if "position_ids" not in inputs and "position_ids" not in graph.producer:
            raise LlmcError(f"{STAGE}: the graph has no position_ids input")
        windows = self.windows or (0,) * layers
        if len(windows) != layers:
            raise LlmcError(f"{STAGE}: {len(windows)} layer windows for a graph of {layers} layers")
        attentions = attentions_by_layer(model, graph, layers, STAGE)
        past = inputs["past_key_values.0.key"].type.tensor_type.shape.dim
        kv_heads, head_dim = past[1].dim_value, past[3].dim_value
        dtype = inputs["past_key_values.0.key"].type.tensor_type.elem_type
        lowered = {id(a) for a in attentions.values()}
        nodes = [n for n in model.graph.node if id(n) not in lowered and "position_ids" not in n.output]
        tables: dict[tuple[str, str], tuple[str, str]] = {}  # rotary tables by the cos/sin they replace
        calls = []  # each layer's (attention node, query/key/value inputs, rotary tables)
        for layer in range(layers):
            attention = attentions[layer]
            packed = self._packed_rotary(graph, attention, head_dim) if self.positions else None
            if packed is None:
                calls.append((attention, list(attention.input[:3]), []))
                continue
            projection, cos, sin = packed
            if (cos, sin) not in tables:
                tables[cos, sin] = self._tables(model, graph, cos, sin, len(tables))
            calls.append((attention, [projection, "", ""], list(tables[cos, sin])))
        # The op reads the step's tokens as [sequences, tokens each, width]: the whole step runs in
        # that layout where every other node gives the same values in it (`_layout_free`), else
        # each op reshapes its inputs to it and its output back (two nodes a layer: 3-4% of
        # SmolLM2-135M int4's decode step).
        whole_step = _layout_free(graph, _live(nodes, ["logits", *(n for call in calls for n in call[1] if n)]),
                                  {"input_ids", "position_ids", *(call[0].output[0] for call in calls)})
        for layer, (attention, qkv, caches) in enumerate(calls):
            scale, window = attr(attention, "scale"), windows[layer]
            batched = [f"single.{layer}.{part}" if name and not whole_step else name for part, name in zip("qkv", qkv)]
            if not whole_step:
                nodes.extend(helper.make_node("Reshape", [name, SEQUENCES_SHAPE], [out], name=f"{out}/Reshape")
                             for name, out in zip(qkv, batched) if name)
            attended = attention.output[0] if whole_step else f"single.{layer}.attended"
            nodes.append(helper.make_node(
                "GroupQueryAttention",
                [*batched, f"past_key_values.{layer}.key", f"past_key_values.{layer}.value",
                 "seqlens_k", "total_sequence_length", *caches],
                [attended, f"present.{layer}.key", f"present.{layer}.value"],
                name=f"single.{layer}/GroupQueryAttention", domain=contrib_ops.DOMAIN,
                num_heads=attr(attention, "q_num_heads"), kv_num_heads=kv_heads,
                scale=float(head_dim ** -0.5 if scale is None else scale),
                softcap=float(attr(attention, "softcap", 0.0)),
                local_window_size=window if window else -1, do_rotary=int(bool(caches))))
            if not whole_step:
                nodes.append(helper.make_node("Reshape", [attended, PACKED_SHAPE], [attention.output[0]],
                                              name=f"{attended}/Reshape"))
        shapes = [helper.make_node("Shape", ["seqlens_k"], ["single.sequences"], name="single.sequences/Shape"),
                  helper.make_node("Concat", ["single.sequences", "single.tokens_width"], [SEQUENCES_SHAPE],
                                   name=f"{SEQUENCES_SHAPE}/Concat", axis=0)]
        if whole_step:  # the step's token inputs to [sequences, tokens each]
            read = {name for node in nodes for name in node.input}
            for name in ("input_ids", "position_ids"):
                if name not in read:
                    continue
                for node in nodes:
                    node.input[:] = [f"{name}/sequences" if i == name else i for i in node.input]
                shapes.append(helper.make_node("Reshape", [name, SEQUENCES_SHAPE], [f"{name}/sequences"],
                                               name=f"{name}/sequences/Reshape"))
        nodes[:0] = shapes
        model.graph.initializer.extend(numpy_helper.from_array(np.array(value, np.int64), name) for name, value in
                                       (("single.tokens_width", [-1] if whole_step else [-1, 0]),
                                        (PACKED_SHAPE, PACKING)))
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        rows = select_logit_rows(Graph(model))
        if whole_step:  # the logits rows count the step's tokens packed
            packed_rows = f"{rows.input[0]}/packed"
            model.graph.node.append(helper.make_node("Reshape", [rows.input[0], PACKED_SHAPE], [packed_rows],
                                                     name=f"{packed_rows}/Reshape"))
            rows.input[0] = packed_rows
        model.graph.node.append(rows)
        vocab = next(o for o in model.graph.output if o.name == "logits").type.tensor_type.shape.dim[2].dim_value

        value = helper.make_tensor_value_info
        buffer = ["sequences", kv_heads, "capacity", head_dim]
        new_inputs = [value("input_ids", TensorProto.INT64, [1, "tokens"]),
                      value("position_ids", TensorProto.INT64, [1, "tokens"])]
        new_inputs += [value(f"past_key_values.{layer}.{part}", dtype, buffer)
                       for layer in range(layers) for part in ("key", "value")]
        new_inputs += [value("seqlens_k", TensorProto.INT32, ["sequences"]), value("total_sequence_length", TensorProto.INT32, []),
                       value("logits_rows", TensorProto.INT64, ["rows"])]
        outputs = [value("logits", dtype, [1, "rows", vocab])]
        outputs += [value(f"present.{layer}.{part}", dtype, buffer) for layer in range(layers) for part in ("key", "value")]
        del model.graph.input[:]
        model.graph.input.extend(new_inputs)
        del model.graph.output[:]
        model.graph.output.extend(outputs)
        hoist_logit_rows(model)  # by the optimized graph's shapes, before they go
        del model.graph.value_info[:]  # the interface's shapes changed; the check infers them again
        if not any(o.domain == contrib_ops.DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(contrib_ops.DOMAIN, 1))
        if self.pad_lone_token:
            model.metadata_props.add(key=PADDING_ROW, value="1")
        # Only the attention op may read a past input: its length here is the buffer's, not the past's.
        drop_stale_inputs(model, stale_inputs(inputs), STAGE, "the single-sequence interface",
                          allowed=("GroupQueryAttention",))
        rotary = sum(bool(caches) for _, _, caches in calls)
        layout = "the whole step" if whole_step else "each attention op"
        return PassResult(model, layers, [f"{layers} layers, {rotary} with rotary inside attention, "
                                          f"[sequences, tokens each] through {layout}"])

    @staticmethod
    def _packed_rotary(graph: Graph, attention: onnx.NodeProto, head_dim: int) -> tuple[str, str, str] | None:
        """(packed projection, cos, sin) when the attention's query, key and value are the three
        outputs of one last-axis Split and query and key go through RotaryEmbedding nodes that
        share full-width, rotate-half cos/sin tables; else None."""
        query, key = (graph.producer_of(name, "RotaryEmbedding") for name in attention.input[:2])
        if query is None or key is None or list(query.input[1:]) != list(key.input[1:]) or len(query.input) != 3:
            return None
        if any(attr(node, "interleaved", 0) or attr(node, "rotary_embedding_dim", 0) for node in (query, key)):
            return None
        split = graph.producer_of(query.input[0], "Split")
        if split is None or list(split.output) != [query.input[0], key.input[0], attention.input[2]]:
            return None
        if attr(split, "axis", 0) not in (-1, 2) or graph.rank(split.input[0]) != 3:
            return None
        if (graph.shape(query.input[1]) or [None])[-1] != head_dim // 2:
            return None
        return split.input[0], query.input[1], query.input[2]

    def _tables(self, model: onnx.ModelProto, graph: Graph, cos: str, sin: str, index: int) -> tuple[str, str]:
        """Initializers [positions, head_dim / 2] holding `cos` and `sin` at every position: the
        subgraph that computes them from position_ids, evaluated once here."""
        needed, stack = set(), [cos, sin]
        while stack:
            name = stack.pop()
            node = graph.producer.get(name)
            if node is None or id(node) in needed:
                continue
            needed.add(id(node))
            stack.extend(i for i in node.input if i)
        order = [n for n in model.graph.node if id(n) in needed]
        reads = {i for n in order for i in n.input if i} - {o for n in order for o in n.output}
        weights = {name: tensor_array(graph.initializers[name]) for name in reads if name in graph.initializers}
        if reads - set(weights) != {"position_ids"}:
            raise LlmcError(f"{STAGE}: the rotary tables '{cos}', '{sin}' read more than position_ids")
        sub = helper.make_model(
            helper.make_graph(order, "rotary_tables",
                              [helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, None])],
                              [helper.make_tensor_value_info(name, TensorProto.UNDEFINED, None) for name in (cos, sin)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in weights.items()]),
            opset_imports=model.opset_import)
        positions = np.arange(self.positions, dtype=np.int64)[None]
        values = ReferenceEvaluator(sub).run(None, {"position_ids": positions})
        names = (f"single.rotary.{index}.cos", f"single.rotary.{index}.sin")
        for name, value in zip(names, values):
            # One row more: a lone token's padding row may sit one past the last position (its
            # output is dropped, so any angle will do).
            table = np.concatenate([value[0], value[0][-1:]]) if self.pad_lone_token else value[0]
            model.graph.initializer.append(numpy_helper.from_array(table, name))
        return names


# Ops whose values come out the same whether the step's tokens are [1, tokens, ...] or
# [sequences, tokens each, ...] (`_layout_free`): elementwise, products by a weight, and, over
# the last axis, norms, softmax, splits and concatenations.
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Exp", "Tanh", "Erf",
                         "Sigmoid", "Relu", "Gelu", "FastGelu", "QuickGelu", "Softplus", "Cast", "Identity", "Clip",
                         "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
LAST_AXIS = frozenset({"RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization",
                       "SkipSimplifiedLayerNormalization", "SkipLayerNormalization", "Softmax", "Split", "Concat"})
WEIGHT_PRODUCTS = frozenset({"MatMul", "MatMulNBits", "MatMulInteger"})


def _live(nodes: list[onnx.NodeProto], roots: list[str]) -> list[onnx.NodeProto]:
    """The nodes of `nodes` that the values `roots` are computed from."""
    producer = {name: node for node in nodes for name in node.output if name}
    live, stack = {}, list(roots)
    while stack:
        node = producer.get(stack.pop())
        if node is not None and id(node) not in live:
            live[id(node)] = node
            stack.extend(name for name in node.input if name)
    return list(live.values())


def _layout_free(graph: Graph, nodes: list[onnx.NodeProto], tokens: set[str]) -> bool:
    """Whether every node of `nodes` that reads a value of the step's tokens (`tokens`, and what
    is computed from them) gives the same values with the tokens laid out [sequences, tokens
    each] as [1, tokens]: an op of the sets above, whose other inputs are weights that broadcast
    over the tokens (at most one dimension of more than one element, the last), on the last axis."""
    tokens, reading = set(tokens), {}
    while True:  # the nodes are not in order yet: until no node adds a value computed from the tokens
        new = [node for node in nodes if id(node) not in reading and any(name in tokens for name in node.input)]
        if not new:
            break
        for node in new:
            reading[id(node)] = node
            tokens.update(name for name in node.output if name)
    return all(_keeps_layout(graph, node, tokens) for node in reading.values())


def _keeps_layout(graph: Graph, node: onnx.NodeProto, tokens: set[str]) -> bool:
    op, others = node.op_type, [name for name in node.input if name and name not in tokens]
    if node.domain not in ("", "ai.onnx", contrib_ops.DOMAIN):
        return False
    if op == "Gather":  # an embedding: a table looked up by the tokens
        return attr(node, "axis", 0) == 0 and node.input[0] in graph.initializers and node.input[1] in tokens
    if op in WEIGHT_PRODUCTS:  # the tokens times a matrix (MatMulNBits: its packed blocks, scales, zero points)
        return (node.input[0] in tokens and not any(name in tokens for name in node.input[1:])
                and (op != "MatMul" or graph.rank(node.input[1]) == 2))
    if op in LAST_AXIS or (op in ("QuantizeLinear", "DequantizeLinear") and any(graph.rank(n) for n in others)):
        rank = graph.rank(next(name for name in node.input if name in tokens))
        axis = attr(node, "axis", 0 if op == "Split" else -1 if op in LAST_AXIS else 1)
        if not (axis == -1 or (rank is not None and axis == rank - 1)) or (op == "Concat" and others):
            return False
    elif op not in ELEMENTWISE:
        return False
    # The other inputs broadcast over the tokens: weights of the last axis, scalars, split sizes.
    return all((shape := graph.shape(name)) is not None and all(d == 1 for d in shape[:-1]) for name in others)
