"""A mutable, indexed view of an ONNX graph for passes: producers, consumers, constants, edits.

Passes look nodes up through this view and describe changes as `Rewrite`s; `apply` commits a
batch of rewrites at once, drops what became dead and re-sorts the graph topologically.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx

from llmc.formats.onnx_io import has_external_weights, make_initializer, tensor_array

# Ops whose outputs differ from run to run: never folded or merged. Dropout is random when its
# training_mode input is set.
NONDETERMINISTIC_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                                  "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"})


# The ONNX default domain is spelled either way in the wild.
DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass
class Rewrite:
    """One match: nodes to remove, nodes to insert in their place, new initializers.

    The outputs of removed nodes that the new nodes do not produce again are intermediates:
    the rewrite is refused if anything outside the match still reads them.
    """

    remove: list[onnx.NodeProto]
    add: list[onnx.NodeProto]
    initializers: list[onnx.TensorProto] = field(default_factory=list)


class Graph:
    """Indexes over `model.graph`; rebuilt by `reindex()` after structural changes."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
        self._names = itertools.count()
        self.external = has_external_weights(model)  # new big tensors then go to external data (onnx_io)
        self.reindex()

    def reindex(self) -> None:
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.graph.node:
            for name in node.output:
                if name:
                    self.producer[name] = node
            for name in node.input:
                if name:
                    self.consumers[name].append(node)
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.outputs = {o.name for o in self.graph.output}
        self.inputs = {i.name for i in self.graph.input}
        self.node_names = {n.name for n in self.graph.node}
        self._value_infos: dict[str, list[onnx.ValueInfoProto]] | None = None

    # --- lookups ---------------------------------------------------------------------------

    def constant(self, name: str) -> np.ndarray | None:
        """The value of `name` if it is an initializer or a Constant node's output."""
        if name in self.initializers:
            return tensor_array(self.initializers[name])  # memory-mapped past 2 GB
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
            attr = node.attribute[0]
            if attr.name == "value":
                return tensor_array(attr.t)
            if attr.name in ("value_float", "value_int"):
                return np.array(onnx.helper.get_attribute_value(attr))
            if attr.name in ("value_floats", "value_ints"):
                return np.array(onnx.helper.get_attribute_value(attr))
        return None

    def scalar(self, name: str) -> float | None:
        """A constant holding a single value, as a Python float; None otherwise."""
        value = self.constant(name)
        if value is None or value.size != 1:
            return None
        return float(value.reshape(()))

    def producer_of(self, name: str, *op_types: str) -> onnx.NodeProto | None:
        """The node producing `name` if its op type is one of `op_types` (default domain)."""
        node = self.producer.get(name)
        if node is None or node.op_type not in op_types or node.domain not in DEFAULT_DOMAINS:
            return None
        return node

    def only_consumer(self, name: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None

    def subgraph_reads(self) -> set[str]:
        """Names of this graph's values that subgraphs (If/Loop/Scan bodies) read."""
        return {name for node in self.graph.node for name in _subgraph_inputs(node)}

    def rank(self, name: str) -> int | None:
        shape = self.shape(name)
        return None if shape is None else len(shape)

    def shape(self, name: str) -> list[int | str] | None:
        """Known shape of a value (ints for fixed dims, names or '?' otherwise), if recorded."""
        if name in self.initializers:
            return list(self.initializers[name].dims)
        for info in self._value_infos_of(name):
            if info.type.tensor_type.HasField("shape"):
                return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                        for d in info.type.tensor_type.shape.dim]
        return None

    def elem_type(self, name: str) -> int | None:
        if name in self.initializers:
            return self.initializers[name].data_type
        infos = self._value_infos_of(name)
        return infos[0].type.tensor_type.elem_type if infos else None

    def _value_infos_of(self, name: str) -> list[onnx.ValueInfoProto]:
        """The value_info, input and output entries named `name`, in that order. Indexed once per
        reindex (a scan per lookup made shape queries ~1 ms each at SmolLM2's 6,900 values), and
        again when entries were added since."""
        listed = (self.graph.value_info, self.graph.input, self.graph.output)
        count = sum(len(entries) for entries in listed)
        if self._value_infos is None or self._value_info_count != count:
            self._value_infos = defaultdict(list)
            for info in itertools.chain(*listed):
                self._value_infos[info.name].append(info)
            self._value_info_count = count
        return self._value_infos.get(name, [])

    # --- building --------------------------------------------------------------------------

    def fresh(self, prefix: str) -> str:
        """A value or node name not used in the graph (nor handed out before)."""
        while True:
            name = f"{prefix}_{next(self._names)}"
            if not (name in self.producer or name in self.initializers or name in self.inputs
                    or name in self.node_names):
                return name

    def initializer(self, prefix: str, value: np.ndarray) -> onnx.TensorProto:
        """A new initializer proto holding `value` (add it through a Rewrite)."""
        return make_initializer(value, self.fresh(prefix), external=self.external)

    def node(self, op_type: str, inputs: list[str], outputs: list[str] | int = 1, *,
             domain: str = "", **attrs) -> onnx.NodeProto:
        """A new node; `outputs` may be a count, for fresh output names."""
        if isinstance(outputs, int):
            outputs = [self.fresh(op_type.lower()) for _ in range(outputs)]
        return onnx.helper.make_node(op_type, inputs, outputs, name=self.fresh(op_type),
                                     domain=domain, **attrs)

    # --- committing ------------------------------------------------------------------------

    def conflicts(self, rewrite: Rewrite, claimed: set[int]) -> bool:
        """True if `rewrite` overlaps an accepted one or would orphan a value read elsewhere."""
        return self.conflict(rewrite, claimed) is not None

    def conflict(self, rewrite: Rewrite, claimed: set[int]) -> str | None:
        """Why `rewrite` cannot join the accepted ones (whose removed nodes are `claimed`), or None:
        it overlaps one of them, or a value it removes is read outside the match."""
        removed = {id(n) for n in rewrite.remove}
        if removed & claimed:
            return "overlaps another match"
        kept = {name for node in rewrite.add for name in node.output}
        kept |= {tensor.name for tensor in rewrite.initializers}  # a value replaced by a constant
        for node in rewrite.remove:
            for name in node.output:
                if not name or name in kept:
                    continue
                if name in self.outputs:
                    return f"'{name}' inside the match is a graph output"
                if any(id(user) not in removed and not self._feeds_only(user, removed)
                       for user in self.consumers.get(name, [])):
                    return f"'{name}' inside the match is read elsewhere"
        return None

    def _feeds_only(self, node: onnx.NodeProto, removed: set[int], depth: int = 6) -> bool:
        """Whether everything `node` computes is read only by `removed` nodes (directly or
        through a short chain), so it dies with them — e.g. a Shape feeding a removed Reshape."""
        if depth == 0:
            return False
        for name in node.output:
            if name in self.outputs:
                return False
            for user in self.consumers.get(name, []):
                if id(user) not in removed and not self._feeds_only(user, removed, depth - 1):
                    return False
        return True

    def apply(self, rewrites: list[Rewrite]) -> list[tuple[Rewrite, str]]:
        """Commit rewrites, then remove dead nodes and initializers and re-sort.

        A rewrite whose result would read a value nothing computes any more (say, a new node
        reading a mask sliced by the shape of a removed tensor) or would close a cycle is not
        committed: the graph is never left broken. Returns those skipped, each with why.
        """
        original = list(self.graph.node)
        available = self.inputs | set(self.initializers)
        nodes, problem = self._try(original, rewrites, available)
        skipped: list[tuple[Rewrite, str]] = []
        if problem is not None:
            # Some match breaks the graph: commit them one at a time, keeping the sound ones.
            nodes, kept = original, []
            for rewrite in rewrites:
                trial, problem = self._try(nodes, [rewrite], available)
                if problem is None:
                    nodes = trial
                    kept.append(rewrite)
                    available |= {t.name for t in rewrite.initializers}
                else:
                    skipped.append((rewrite, problem))
            rewrites = kept
        self.graph.initializer.extend(t for r in rewrites for t in r.initializers)
        self._replace_nodes(nodes)
        self.remove_dead()
        return skipped

    def _try(self, nodes: list[onnx.NodeProto], rewrites: list[Rewrite],
             available: set[str]) -> tuple[list[onnx.NodeProto], str | None]:
        """(live nodes in topological order, None) after `rewrites`, or (_, what would break)."""
        removed = {id(n) for r in rewrites for n in r.remove}
        candidate = [n for n in nodes if id(n) not in removed] + [n for r in rewrites for n in r.add]
        available = available | {t.name for r in rewrites for t in r.initializers}
        producer: dict[str, onnx.NodeProto] = {}
        for node in candidate:
            for name in filter(None, node.output):
                if name in producer or name in available:
                    return [], f"'{name}' would be computed twice"
                producer[name] = node
        live: set[int] = set()
        stack, seen = list(self.outputs), set()
        while stack:
            name = stack.pop()
            if not name or name in seen or name in available:
                continue
            seen.add(name)
            node = producer.get(name)
            if node is None:
                return [], f"'{name}' would be read but no longer computed"
            if id(node) not in live:
                live.add(id(node))
                stack.extend(list(node.input) + _subgraph_inputs(node))
        ordered_live = [n for n in candidate if id(n) in live]
        try:
            return toposort(ordered_live, available), None
        except ValueError:
            return [], "the rewritten graph would have a cycle"

    def remove_dead(self) -> int:
        """Drop nodes whose outputs nobody reads and initializers nobody uses; returns nodes dropped."""
        live = set(self.outputs)
        kept = []
        for node in reversed(self.graph.node):
            if any(name in live for name in node.output):
                kept.append(node)
                live.update(n for n in node.input if n)
                live.update(_subgraph_inputs(node))
        dropped = len(self.graph.node) - len(kept)
        if dropped:
            self._replace_nodes(list(reversed(kept)))
        unused = [t for t in self.graph.initializer if t.name not in live]
        for tensor in unused:
            self.graph.initializer.remove(tensor)
        if unused:
            self.reindex()
        return dropped

    def _replace_nodes(self, nodes: list[onnx.NodeProto]) -> None:
        ordered = toposort(nodes, self.inputs | set(self.initializers) |
                           {t.name for t in self.graph.initializer})
        del self.graph.node[:]
        self.graph.node.extend(ordered)
        self.reindex()


def attr(node: onnx.NodeProto, name: str, default=None):
    """The value of a node attribute, or `default` when absent."""
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def toposort(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """Order nodes so each comes after its producers, keeping the given order where free."""
    producer_index = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    waiting_on = []
    dependents: dict[int, list[int]] = defaultdict(list)
    for i, node in enumerate(nodes):
        needs = {producer_index[name] for name in list(node.input) + _subgraph_inputs(node)
                 if name and name not in available and name in producer_index}
        needs.discard(i)
        waiting_on.append(len(needs))
        for j in needs:
            dependents[j].append(i)
    ready = [i for i, count in enumerate(waiting_on) if count == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        i = heapq.heappop(ready)
        ordered.append(nodes[i])
        for j in dependents[i]:
            waiting_on[j] -= 1
            if waiting_on[j] == 0:
                heapq.heappush(ready, j)
    if len(ordered) != len(nodes):
        raise ValueError("graph has a cycle after rewriting")
    return ordered


def _subgraph_inputs(node: onnx.NodeProto) -> list[str]:
    """Names that subgraphs (If/Loop/Scan bodies) read from the enclosing scope."""
    names = []
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            defined = {i.name for i in sub.input} | {t.name for t in sub.initializer}
            for inner in sub.node:
                names += [n for n in inner.input if n and n not in defined]
                defined.update(inner.output)
                names += _subgraph_inputs(inner)
    return names
