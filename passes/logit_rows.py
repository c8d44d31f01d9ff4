"""Move the gather of the logits rows up the graph, to where the last layer's attention ends.

A step needs logits for a few of its tokens (`logits_rows`: each sequence's last one, in a
prompt), and everything after the last attention computes each token's row from that row alone:
the output projection, the residual adds, the norms, the MLP. So those rows can be picked before
that work rather than after it: a prompt's last layer then runs its attention output, MLP and
norms on one row per sequence, not on every token. The last layer's keys and values (which the
cache keeps) and its attention come before the gather and are untouched; the logits are the
same, row for row.

What a 2,048-token prompt gains is that layer's share of the products past attention: about 4% of
a 22-layer Llama's linear work, 3% of a 30-layer one's. A decode step asks for every row, and
only pays a gather per value at the border (a copy of a few rows).

The gather moves through a node only where the node is known to compute each row from the same
row of its inputs (`ROW_WISE`, with the axis conditions `_row_wise` checks), and only once every
output of that node is read by row gathers alone; a value read elsewhere too (the residual
stream, which the last attention also reads) is gathered where it is read, and stays whole for
the rest. Inputs without the token axis (weights, a [1, 1, n] broadcast) are left as they are;
an input whose shape the graph does not record stops the move there.
"""

from __future__ import annotations

import onnx

from llmc.passes.contrib_ops import DOMAIN as CONTRIB_DOMAIN
from llmc.passes.graph import DEFAULT_DOMAINS, Graph, attr, toposort

ROWS = "logits_rows"
TOKEN_AXIS = 1  # of [1, tokens, ...] values: the packed step's tokens
PACKING = [1, -1, 0]  # the Reshape shape from [sequences, tokens each, n] to the packed [1, tokens, n]
# Ops that compute each row from the same rows of their inputs, by domain: elementwise ones
# (broadcasting), products by a weight, normalizations and splits over the last axis.
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Sigmoid", "Tanh", "Relu", "Erf", "Cast", "Neg",
                         "Sqrt", "Reciprocal", "Exp", "Softplus", "Gelu", "Identity"})
LAST_AXIS = frozenset({"RMSNormalization", "LayerNormalization", "Split"})
ROW_WISE = {
    **{op: "" for op in ELEMENTWISE | LAST_AXIS | {"MatMul", "QuantizeLinear", "DequantizeLinear"}},
    **{op: CONTRIB_DOMAIN for op in ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization", "FastGelu",
                                     "QuickGelu", "MatMulNBits")},
}


def hoist_logit_rows(model: onnx.ModelProto) -> int:
    """Move the model's `logits_rows` gathers (Gather on axis 1, maybe of a value reshaped to
    [1, tokens, n] first: the single-sequence graph's packing) up through the row-wise nodes that
    feed them, in place; returns how many nodes now compute only the gathered rows."""
    graph = Graph(model)
    gathered, packing = {}, None  # value -> its gathered rows' name; the packing Reshape's shape
    for node in list(model.graph.node):
        chain = _is_row_gather(node) and _gather_chain(graph, node.input[0], node)
        if chain:
            gathered[chain[0].input[0]] = node.output[0]
            packing = chain[0].input[1] if len(chain) == 2 else packing
    moved, progress = 0, True
    while progress:
        progress = False
        for source in list(gathered):
            producer = graph.producer.get(source)
            chains = None if producer is None or not _row_wise(graph, producer) else _output_chains(graph, producer)
            inputs = chains and _token_inputs(graph, producer)
            if not inputs:
                continue
            added = []
            for index, name in inputs.items():
                if name not in gathered:
                    gathered[name] = graph.fresh(f"{name}/rows")
                    added += _new_gather(graph, name, gathered[name], packing)
                producer.input[index] = gathered[name]
            for position, output in enumerate(producer.output):
                if output:  # one nothing reads gets a name of its own
                    producer.output[position] = gathered.pop(output, None) or graph.fresh(f"{output}/rows")
            dropped = {id(node) for chain in chains for node in chain}
            nodes = [node for node in model.graph.node if id(node) not in dropped] + added
            del model.graph.node[:]
            model.graph.node.extend(toposort(nodes, graph.inputs | set(graph.initializers)))
            graph.reindex()
            moved += 1
            progress = True
    return moved


def _is_row_gather(node: onnx.NodeProto) -> bool:
    return (node.op_type == "Gather" and node.domain in DEFAULT_DOMAINS and list(node.input[1:]) == [ROWS]
            and attr(node, "axis", 0) == TOKEN_AXIS)


def _gather_chain(graph: Graph, name: str, gather: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The nodes by which `gather` takes the rows of a value: [the packing Reshape, gather] where
    `name` is that Reshape's sole output to [1, -1, 0] read by `gather` alone, else [gather]."""
    reshape = graph.producer.get(name)
    if (reshape is not None and reshape.op_type == "Reshape" and reshape.domain in DEFAULT_DOMAINS
            and graph.consumers[name] == [gather] and name not in graph.outputs):
        shape = graph.constant(reshape.input[1])
        if shape is not None and shape.tolist() == PACKING:
            return [reshape, gather]
    return [gather]


def _output_chains(graph: Graph, node: onnx.NodeProto) -> list[list[onnx.NodeProto]] | None:
    """The gather chain of each of `node`'s outputs that something reads, or None unless each is
    read by one such chain alone (none being a graph output)."""
    chains = []
    for name in node.output:
        if name in graph.outputs:
            return None
        readers = graph.consumers.get(name, []) if name else []
        if not readers:
            continue
        if len(readers) != 1:
            return None
        first = readers[0]
        if _is_row_gather(first):
            chains.append([first])
        elif first.op_type == "Reshape" and len(graph.consumers.get(first.output[0], [])) == 1 \
                and _is_row_gather(gather := graph.consumers[first.output[0]][0]) \
                and len(chain := _gather_chain(graph, first.output[0], gather)) == 2:
            chains.append(chain)
        else:
            return None
    return chains or None


def _new_gather(graph: Graph, name: str, rows: str, packing: str | None) -> list[onnx.NodeProto]:
    """The nodes that gather `name`'s rows into `rows`, packing it first where the graph does."""
    source = name
    nodes = []
    if packing is not None:
        source = graph.fresh(f"{name}/packed")
        nodes.append(onnx.helper.make_node("Reshape", [name, packing], [source], name=graph.fresh(f"{source}/Reshape")))
    nodes.append(onnx.helper.make_node("Gather", [source, ROWS], [rows], name=graph.fresh(f"{rows}/Gather"),
                                       axis=TOKEN_AXIS))
    return nodes


def _row_wise(graph: Graph, node: onnx.NodeProto) -> bool:
    """Whether `node` computes each row from the same rows of its inputs: one of the `ROW_WISE`
    types, normalized or split over the last axis, quantized per tensor or per column, a product
    by a 2-D weight."""
    domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
    if ROW_WISE.get(node.op_type) != domain:
        return False
    rank = graph.rank(node.output[0])
    if node.op_type in LAST_AXIS:
        default = 0 if node.op_type == "Split" else -1
        return rank is not None and attr(node, "axis", default) in (-1, rank - 1)
    if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
        scale = graph.shape(node.input[1])
        return scale is not None and (len(scale) == 0 or attr(node, "axis", 1) in (-1, (rank or 0) - 1)) \
            and attr(node, "block_size", 0) == 0
    if node.op_type == "MatMul":
        return graph.rank(node.input[1]) == 2
    return True


def _token_inputs(graph: Graph, node: onnx.NodeProto) -> dict[int, str] | None:
    """The inputs of `node` that carry the token axis, by position (the rest broadcast over it,
    or are weights), or None where one's shape is not known well enough to tell."""
    token_inputs = {}
    for index, name in enumerate(node.input):
        if not name:
            continue
        if node.op_type in ("MatMul", "MatMulNBits") and index > 0:
            continue  # the weight (MatMul's checked 2-D): no token axis
        if node.op_type not in ELEMENTWISE and index > (1 if node.op_type.startswith("Skip") else 0):
            continue  # scales, biases, zero points, split sizes: per column
        if name in graph.initializers or graph.constant(name) is not None:
            continue
        shape = graph.shape(name)
        if shape is None:
            return None
        if len(shape) <= 1 or all(dim == 1 for dim in shape[:-1]):
            continue  # broadcast over the tokens (and the sequences)
        if len(shape) != 3 or not isinstance(shape[TOKEN_AXIS], str):
            return None
        token_inputs[index] = name
    return token_inputs or None
