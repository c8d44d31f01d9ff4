"""Property: every pass keeps random small graphs valid and computing the same outputs.

The graphs mix what the passes look for: constant subtrees (including Shape of static values
feeding Reshape), duplicate constants and duplicate nodes, Identity nodes and dead branches.
Values are kept within ±2 by a Tanh after any op that could grow them, so that reordered or
folded float arithmetic stays far inside the tolerance.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import onnx
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from llmc.compiler.compare import compare_models
from llmc.compiler.pipeline import refresh_shapes
from llmc.passes.eliminate_common_subexpressions import EliminateCommonSubexpressions
from llmc.passes.eliminate_dead_code import EliminateDeadCode
from llmc.passes.fold_constants import FoldConstants
from llmc.passes.registry import PASSES

# The registry, plus the clean-up passes until they are registered; deduplicated by name.
ALL_PASSES = list({cls.name: cls for cls in [FoldConstants, EliminateCommonSubexpressions,
                                             EliminateDeadCode, *PASSES.values()]}.values())

TOLERANCE = 1e-5
_BOUND = 2.0
_UNARY = {"Relu": None, "Neg": None, "Abs": None, "Identity": None,
          "Sigmoid": 1.0, "Tanh": 1.0, "Sin": 1.0, "Cos": 1.0}  # op → bound of its output
_BINARY = ["Add", "Sub", "Mul", "Max", "Min"]
_DIMS = st.integers(2, 4)


class _Builder:
    """Grows a graph; `values` holds (name, shape, bound) of float tensors ops may read."""

    def __init__(self, draw):
        self.draw = draw
        self.rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        self.inputs: list[onnx.ValueInfoProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.constants: list[np.ndarray] = []
        self.values: list[tuple[str, tuple[int, ...], float]] = []
        self.produced: list[str] = []
        self.count = 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def pick(self, candidates=None):
        candidates = self.values if candidates is None else candidates
        return candidates[self.draw(st.integers(0, len(candidates) - 1))]

    def emit(self, op: str, inputs: list[str], shape: tuple[int, ...], bound: float, **attrs) -> str:
        output = self.fresh(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [output], **attrs))
        if bound > _BOUND:
            return self.emit("Tanh", [output], shape, 1.0)
        self.values.append((output, shape, bound))
        self.produced.append(output)
        return output

    def constant(self, shape: tuple[int, ...], dtype=np.float32, value=None) -> str:
        """An initializer or Constant node; sometimes a copy of an earlier constant."""
        same = [c for c in self.constants if c.shape == shape and c.dtype == dtype]
        if value is None and same and self.draw(st.booleans()):
            value = self.pick(same)
        if value is None:
            value = self.rng.uniform(-1, 1, shape).astype(dtype)
        value = np.asarray(value, dtype)
        self.constants.append(value)
        name = self.fresh("c")
        if self.draw(st.booleans()):
            self.initializers.append(numpy_helper.from_array(value, name))
        else:
            self.nodes.append(helper.make_node("Constant", [], [name],
                                               value=numpy_helper.from_array(value)))
        return name

    def operand(self, shape: tuple[int, ...]) -> tuple[str, float]:
        """A value of `shape` (or broadcastable to it): existing, or a new constant."""
        same = [v for v in self.values if v[1] == shape]
        if same and self.draw(st.booleans()):
            name, _, bound = self.pick(same)
            return name, bound
        broadcast = self.draw(st.sampled_from([shape, shape[-1:], ()]))
        return self.constant(broadcast), 1.0

    # --- ops -------------------------------------------------------------------------------

    def unary(self):
        name, shape, bound = self.pick()
        op = self.draw(st.sampled_from(sorted(_UNARY)))
        self.emit(op, [name], shape, _UNARY[op] or bound)

    def binary(self):
        name, shape, bound = self.pick()
        other, other_bound = self.operand(shape)
        op = self.draw(st.sampled_from(_BINARY))
        grown = {"Add": bound + other_bound, "Sub": bound + other_bound,
                 "Mul": bound * other_bound}.get(op, max(bound, other_bound))
        inputs = [name, other] if self.draw(st.booleans()) else [other, name]
        self.emit(op, inputs, shape, grown)

    def matmul(self):
        matrices = [v for v in self.values if len(v[1]) == 2]
        if not matrices:
            return self.unary()
        name, (m, k), bound = self.pick(matrices)
        right = [v for v in self.values if len(v[1]) == 2 and v[1][0] == k]
        if right and self.draw(st.booleans()):
            other, (_, n), other_bound = self.pick(right)
        else:
            n = self.draw(_DIMS)
            other, other_bound = self.constant((k, n)), 1.0
        self.emit("MatMul", [name, other], (m, n), k * bound * other_bound)

    def reshape(self):
        name, shape, bound = self.pick()
        size = math.prod(shape)
        same_size = [v for v in self.values if math.prod(v[1]) == size and v[1] != shape]
        if same_size and self.draw(st.booleans()):
            # Shape arithmetic: static here, so constant folding can compute it.
            source, target, _ = self.pick(same_size)
            target_name = self.fresh("shape")
            self.nodes.append(helper.make_node("Shape", [source], [target_name]))
        else:
            target = tuple(self.draw(st.permutations(shape)))
            if self.draw(st.booleans()):
                target = (size,)
            spelled = list(target)
            if self.draw(st.booleans()):
                spelled[self.draw(st.integers(0, len(spelled) - 1))] = -1
            if self.draw(st.booleans()):
                target_name = self.constant((len(spelled),), np.int64, spelled)
            else:  # the shape of a constant: a constant subtree
                target_name = self.fresh("shape")
                self.nodes.append(helper.make_node("Shape", [self.constant(target)], [target_name]))
        self.emit("Reshape", [name, target_name], target, bound)

    def transpose(self):
        name, shape, bound = self.pick([v for v in self.values if len(v[1]) > 1] or self.values)
        perm = self.draw(st.permutations(range(len(shape))))
        self.emit("Transpose", [name], tuple(shape[p] for p in perm), bound, perm=list(perm))

    def concat(self):
        name, shape, bound = self.pick()
        axis = self.draw(st.integers(0, len(shape) - 1))
        fits = [v for v in self.values
                if len(v[1]) == len(shape) and all(a == b for i, (a, b) in enumerate(zip(v[1], shape))
                                                   if i != axis)]
        if self.draw(st.booleans()):
            other, other_shape, other_bound = self.pick(fits)
        else:
            other_shape = shape[:axis] + (self.draw(_DIMS),) + shape[axis + 1:]
            other, other_bound = self.constant(other_shape), 1.0
        joined = shape[:axis] + (shape[axis] + other_shape[axis],) + shape[axis + 1:]
        self.emit("Concat", [name, other], joined, max(bound, other_bound), axis=axis)

    def duplicate(self):
        """Repeat an earlier node on the same inputs: a common subexpression."""
        candidates = [n for n in self.nodes if n.op_type != "Constant" and n.output[0] in
                      {v[0] for v in self.values}]
        if not candidates:
            return self.binary()
        node = self.pick(candidates)
        _, shape, bound = next(v for v in self.values if v[0] == node.output[0])
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self.emit(node.op_type, list(node.input), shape, bound, **attrs)

    def constant_subtree(self):
        """An op over constants only: folds away."""
        shape = tuple(self.draw(st.lists(_DIMS, min_size=1, max_size=3)))
        self.values.append((self.constant(shape), shape, 1.0))
        self.binary() if self.draw(st.booleans()) else self.unary()

    def model(self, outputs: list[str]) -> onnx.ModelProto:
        shapes = {v[0]: v[1] for v in self.values}
        graph = helper.make_graph(
            self.nodes, "random", self.inputs,
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, shapes[n]) for n in outputs],
            initializer=self.initializers)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@st.composite
def graphs(draw) -> onnx.ModelProto:
    builder = _Builder(draw)
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(_DIMS, min_size=1, max_size=3)))
        builder.inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, shape))
        builder.values.append((f"x{i}", shape, 5.0))  # standard normal feeds
    ops = [builder.unary, builder.binary, builder.matmul, builder.reshape, builder.transpose,
           builder.concat, builder.duplicate, builder.constant_subtree]
    for _ in range(draw(st.integers(1, 12))):
        draw(st.sampled_from(ops))()
    # The last value and a few others are outputs; whatever else nobody reads is a dead branch.
    others = draw(st.lists(st.sampled_from(builder.produced), max_size=2, unique=True))
    outputs = list(dict.fromkeys([builder.produced[-1], *others]))
    return builder.model(outputs)


def _assert_valid(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)


def _assert_same(reference: onnx.ModelProto, candidate: onnx.ModelProto, what: str) -> None:
    _assert_valid(candidate)
    assert [o.name for o in candidate.graph.output] == [o.name for o in reference.graph.output], what
    comparison = compare_models(reference, candidate)
    assert comparison.max_abs <= TOLERANCE, (what, comparison)


@settings(max_examples=40, deadline=None)
@given(graphs())
def test_passes_preserve_validity_and_outputs(model):
    _assert_valid(model)
    refresh_shapes(model)
    for cls in ALL_PASSES:
        result = cls().run(copy.deepcopy(model))
        _assert_same(model, result.model, cls.name)
    chained = copy.deepcopy(model)
    for cls in ALL_PASSES:
        chained = cls().run(chained).model
        refresh_shapes(chained)
    _assert_same(model, chained, "all passes in turn")
