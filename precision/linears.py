"""The linear layers of an optimized decoder graph, with names a person can write in a config.

Exported graphs name their weights after the exporter's temporaries (`val_298`,
`merged_weight_5`), so precision settings and sensitivity reports use structural names instead:
``layers.{i}.qkv`` (or ``.q``/``.k``/``.v`` when not merged), ``layers.{i}.o``,
``layers.{i}.mlp.up`` (gate/up, merged or not), ``layers.{i}.mlp.down`` and ``lm_head``. A
linear layer is a MatMul whose second input is a 2-D float initializer.

Roles come from where the MatMul sits relative to attention (``Attention`` or llmc's
``PagedAttention``): its output reaches attention without another MatMul → q/k/v; its input
comes from attention → o; it produces the logits → lm_head; of the rest, the one fed by a
product (gate · up) is down, the others up. The layer index counts the attentions above it.
A graph without fused attention (optimization level below 2) has no such structure; its
linear layers are ``linear.{j}`` in graph order.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from llmc.passes.graph import DEFAULT_DOMAINS

_ATTENTION = ("Attention", "PagedAttention", "GroupQueryAttention", "MultiHeadAttention")
_HOPS = 8  # how far a role search walks through reshapes, rotary, splits and the like


@dataclass(frozen=True)
class Linear:
    name: str               # structural name, e.g. "layers.3.mlp.down"
    node: onnx.NodeProto
    weight: str             # the initializer's name


def linear_layers(model: onnx.ModelProto) -> list[Linear]:
    """Every linear layer in graph order, with its structural name (unique)."""
    graph = model.graph
    weights = {t.name for t in graph.initializer if len(t.dims) == 2
               and t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}
    depth: dict[str, int] = {}  # attentions on the way to each value
    for n in graph.node:
        d = max((depth.get(i, 0) for i in n.input if i), default=0)
        for o in n.output:
            depth[o] = d + (1 if n.op_type in _ATTENTION else 0)

    def is_linear(n: onnx.NodeProto) -> bool:
        return n.op_type == "MatMul" and n.domain in DEFAULT_DOMAINS and len(n.input) == 2 and n.input[1] in weights

    def forward_reaches(n: onnx.NodeProto, stop) -> onnx.NodeProto | str | None:
        frontier, seen = list(n.output), set()
        for _ in range(_HOPS):
            nxt = []
            for value in frontier:
                if value in outputs and stop == "output":
                    return value
                for c in consumers.get(value, []):
                    if id(c) in seen or c.op_type == "MatMul":
                        continue
                    seen.add(id(c))
                    if stop == "attention" and c.op_type in _ATTENTION:
                        return c
                    nxt += list(c.output)
            frontier = nxt
        return None

    def backward_finds(n: onnx.NodeProto, op_types: tuple[str, ...]) -> bool:
        frontier = [n.input[0]]
        for _ in range(_HOPS):
            nodes = [producer[v] for v in frontier if v in producer]
            if any(p.op_type in op_types for p in nodes):
                return True
            frontier = [i for p in nodes if p.op_type != "MatMul" for i in p.input if i]
        return False

    if not any(n.op_type in _ATTENTION for n in graph.node):  # attention not fused: no structure to name by
        return [Linear(f"linear.{i}", n, n.input[1]) for i, n in enumerate(filter(is_linear, graph.node))]
    found, counts = [], {}
    for n in graph.node:
        if not is_linear(n):
            continue
        layer = depth.get(n.input[0], 0)
        if forward_reaches(n, "attention") is not None:
            role = f"layers.{layer}.qkv"
        elif forward_reaches(n, "output") == "logits":
            role = "lm_head"
        elif backward_finds(n, _ATTENTION):
            role = f"layers.{layer - 1}.o"
        elif backward_finds(n, ("Sigmoid", "QuickGelu", "Gelu", "Silu", "Swish", "FastGelu", "Tanh")):
            role = f"layers.{layer - 1}.mlp.down"
        else:
            role = f"layers.{layer - 1}.mlp.up"
        counts[role] = counts.get(role, 0) + 1
        found.append((role, n))
    # Unmerged siblings share a role: q/k/v and gate/up get their order as a suffix.
    suffixes = {"qkv": ("q", "k", "v"), "up": ("gate", "up")}
    seen_roles: dict[str, int] = {}
    layers = []
    for role, n in found:
        name = role
        if counts[role] > 1:
            index = seen_roles.get(role, 0)
            seen_roles[role] = index + 1
            last = role.rsplit(".", 1)
            options = suffixes.get(last[1], ())
            name = f"{last[0]}.{options[index]}" if index < len(options) and counts[role] == len(options) \
                else f"{role}{index}"
        layers.append(Linear(name, n, n.input[1]))
    return layers

