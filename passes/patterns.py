"""Matching helpers shared by the fusion passes: operand lookup, constant checks, product trees,
the `x / sqrt(v)` family of spellings, reduction axes, and norm parameters.

Every matcher returns None for "no match"; none of them edits the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from llmc.passes.graph import DEFAULT_DOMAINS, Graph


# --- operands --------------------------------------------------------------------------------

def is_default(node: onnx.NodeProto | None, *op_types: str) -> bool:
    """True if `node` is a default-domain node of one of `op_types`."""
    return node is not None and node.domain in DEFAULT_DOMAINS and node.op_type in op_types


def consumer(graph: Graph, name: str, *op_types: str) -> onnx.NodeProto | None:
    """The only reader of `name` if it is a default-domain `op_types` node (and not a graph output)."""
    node = graph.only_consumer(name)
    return node if is_default(node, *op_types) else None


def other_input(node: onnx.NodeProto, name: str) -> str | None:
    """The operand of binary `node` that is not `name` (`name` itself for `f(name, name)`)."""
    a, b = node.input[0], node.input[1]
    if a == name:
        return b
    return a if b == name else None


def constant_operand(graph: Graph, node: onnx.NodeProto) -> tuple[str, np.ndarray] | None:
    """For a commutative binary `node` with exactly one constant operand: (the other, the value)."""
    values = [graph.constant(name) for name in node.input[:2]]
    if len(node.input) != 2 or (values[0] is None) == (values[1] is None):
        return None
    return (node.input[1], values[0]) if values[0] is not None else (node.input[0], values[1])


def scalar_operand(graph: Graph, node: onnx.NodeProto) -> tuple[str, float] | None:
    """Like `constant_operand`, for a scalar constant (shape [] or [1], so it cannot raise a rank)."""
    found = constant_operand(graph, node)
    if found is None or not _is_scalar(found[1]):
        return None
    return found[0], float(found[1].reshape(()))


def _is_scalar(value: np.ndarray) -> bool:
    return value.size == 1 and value.ndim <= 1


def close(value: float | None, target: float, rel: float = 1e-4) -> bool:
    """True if `value` equals `target` to a relative tolerance (exported constants are fp32)."""
    return value is not None and abs(value - target) <= rel * abs(target)


def exponent_of(graph: Graph, name: str, base: str) -> tuple[float, onnx.NodeProto | None] | None:
    """(n, node) if `name` is `base` itself (1, None) or `Pow(base, n)` with constant n."""
    if name == base:
        return 1.0, None
    node = graph.producer_of(name, "Pow")
    if node is None or node.input[0] != base:
        return None
    n = graph.scalar(node.input[1])
    return None if n is None else (n, node)


def square_of(graph: Graph, name: str) -> tuple[str, onnx.NodeProto] | None:
    """(x, node) if `name` is `Pow(x, 2)` or `Mul(x, x)`."""
    node = graph.producer_of(name, "Pow", "Mul")
    if node is None:
        return None
    if node.op_type == "Mul":
        return (node.input[0], node) if node.input[0] == node.input[1] else None
    return (node.input[0], node) if graph.scalar(node.input[1]) == 2.0 else None


# --- products --------------------------------------------------------------------------------

@dataclass
class Product:
    """`name` read as constant · v₀ · v₁ · …, through Mul nodes and Div-by-constant nodes."""

    constant: float = 1.0
    variables: list[str] = field(default_factory=list)
    nodes: list[onnx.NodeProto] = field(default_factory=list)


def product(graph: Graph, name: str) -> Product:
    """Flatten the tree of Mul / Div-by-scalar nodes computing `name`.

    The tree descends only into nodes whose output is read once (by the tree), so every node in
    `nodes` is private to the product; scalar constants multiply into `constant`, anything else
    (including non-scalar constants) is a variable.
    """
    result = Product()
    _collect(graph, name, result, root=True)
    return result


def _collect(graph: Graph, name: str, result: Product, root: bool) -> None:
    value = graph.constant(name)
    if value is not None and _is_scalar(value):
        result.constant *= float(value.reshape(()))
        return
    node = graph.producer_of(name, "Mul", "Div")
    private = root or graph.only_consumer(name) is not None
    if node is None or not private:
        result.variables.append(name)
        return
    if node.op_type == "Div":
        divisor = graph.scalar(node.input[1])
        if divisor is None or divisor == 0.0:
            result.variables.append(name)
            return
        result.nodes.append(node)
        result.constant /= divisor
        _collect(graph, node.input[0], result, root=False)
        return
    result.nodes.append(node)
    for operand in node.input:
        _collect(graph, operand, result, root=False)


# --- x / sqrt(v) -------------------------------------------------------------------------------

def divided_by_sqrt(graph: Graph, numerator: str, radicand: str) -> tuple[list[onnx.NodeProto], str] | None:
    """Match `numerator / sqrt(radicand)` downstream of `radicand`; returns (nodes, result name).

    Spellings: Div(n, Sqrt(v)); Mul(n, Reciprocal(Sqrt(v))); Mul(n, Div(1, Sqrt(v)));
    Mul(n, Pow(v, -0.5)); multiplications in either operand order.
    """
    step = graph.only_consumer(radicand)
    if is_default(step, "Pow") and step.input[0] == radicand and graph.scalar(step.input[1]) == -0.5:
        nodes, inverse = [step], step.output[0]
    elif is_default(step, "Sqrt"):
        root = step.output[0]
        after = graph.only_consumer(root)
        if is_default(after, "Div") and list(after.input) == [numerator, root]:
            return [step, after], after.output[0]
        if is_default(after, "Reciprocal") or (is_default(after, "Div") and after.input[1] == root
                                                and graph.scalar(after.input[0]) == 1.0):
            nodes, inverse = [step, after], after.output[0]
        else:
            return None
    else:
        return None
    scale = consumer(graph, inverse, "Mul")
    if scale is None or other_input(scale, inverse) != numerator:
        return None
    return nodes + [scale], scale.output[0]


# --- reductions ------------------------------------------------------------------------------

def reduce_axes(graph: Graph, node: onnx.NodeProto) -> list[int] | None:
    """Axes of a Reduce* node from its attribute (old opsets) or input; [] means all axes.

    None if the axes input is not constant.
    """
    for attr in node.attribute:
        if attr.name == "axes":
            return list(attr.ints)
    if len(node.input) > 1 and node.input[1]:
        value = graph.constant(node.input[1])
        return None if value is None else [int(a) for a in value.reshape(-1)]
    return []


def keeps_dims(node: onnx.NodeProto) -> bool:
    return all(attr.i != 0 for attr in node.attribute if attr.name == "keepdims")


def trailing_axis(axes: list[int], rank: int | None) -> int | None:
    """The (negative) first axis if `axes` are exactly the last len(axes) dims, else None."""
    if not axes:
        return None
    if any(a >= 0 for a in axes):
        if rank is None:
            return None
        axes = [a - rank if a >= 0 else a for a in axes]
    k = len(axes)
    return -k if sorted(axes) == list(range(-k, 0)) else None


# --- normalization parameters ----------------------------------------------------------------

def normalized_dims(graph: Graph, name: str, axis: int) -> list[int] | None:
    """The fixed sizes of the dims a norm over `axis`.. normalizes, if all are known."""
    shape = graph.shape(name)
    if shape is None or len(shape) < -axis:
        return None
    dims = shape[axis:]
    return dims if all(isinstance(d, int) and d > 0 for d in dims) else None


def norm_parameter(value: np.ndarray, axis: int, dims: list[int] | None,
                   rank: int | None) -> np.ndarray | None:
    """`value`, an elementwise Mul/Add operand after a norm, as that norm's scale or bias.

    None when it does not fit: it varies along a dim outside the normalized ones, would raise
    the output's rank, or its broadcast cannot be checked because the dims are unknown.
    """
    k = -axis
    if value.ndim > (rank if rank is not None else k):
        return None
    lead = value.ndim - k
    if lead > 0:
        if any(d != 1 for d in value.shape[:lead]):
            return None
        value = value.reshape(value.shape[lead:])
    if dims is None:
        return value if value.ndim == k and all(d != 1 for d in value.shape) else None
    try:
        return np.ascontiguousarray(np.broadcast_to(value, dims))
    except ValueError:
        return None
