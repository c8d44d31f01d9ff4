"""--fp16: an fp16-typed graph with fp32 islands where precision needs them.

Every node computes in fp16 except:
- the islands: normalizations (their mean of squares overflows fp16's range at large
  activations), attention (its softmax; and the paged KV pool stays fp32), residual sums (the
  Adds that feed a normalization: the residual stream accumulates over every layer), and
  whatever the caller adds (mixed precision: op types or nodes mapped to fp32);
- nodes that produce floats from non-floats (Cast, Constant, Range, …) and quantized linears
  (Q/DQ, MatMulNBits), which keep their own types;
- the graph's inputs and outputs keep their types (an output computed in fp16 is cast back),
  so the engine's interface does not change.

Float initializers read only by fp16 nodes are stored in fp16 (half the weight bytes); at each
edge between an fp16 and an fp32 node one Cast is inserted per value and direction.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from llmc.formats.onnx_io import has_external_weights, infer_shapes, make_initializer, tensor_array
from llmc.passes.graph import Graph

ISLANDS = {"RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
           "SkipSimplifiedLayerNormalization", "Attention", "PagedAttention", "GroupQueryAttention", "Softmax"}
_OWN_TYPES = {"Cast", "CastLike", "Constant", "ConstantOfShape", "Range", "Shape", "Size", "RandomNormal",
              "RandomUniform", "EyeLike", "QuantizeLinear", "DequantizeLinear", "MatMulNBits", "DynamicQuantizeLinear"}
_NORMS = {"RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization"}


def residual_adds(model: onnx.ModelProto) -> set[str]:
    """Names (or first outputs) of the Adds whose sum feeds a normalization: the residual stream."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    return {node_key(n) for n in model.graph.node if n.op_type == "Add"
            and any(c.op_type in _NORMS for c in consumers.get(n.output[0], []))}


def convert_to_fp16(model: onnx.ModelProto, keep_fp32_ops: set[str] = frozenset(),
                    keep_fp32_nodes: set[str] = frozenset(), half_islands: set[str] = frozenset()) -> int:
    """Convert in place; returns how many nodes compute in fp16 afterwards.

    Args:
        model: a float32 graph.
        keep_fp32_ops: op types kept in fp32 besides `ISLANDS`.
        keep_fp32_nodes: node names (or first outputs) kept in fp32 besides the residual sums.
        half_islands: op types of `ISLANDS` to compute in fp16 all the same (mixed precision).
    """
    typed = infer_shapes(model)
    elem = {v.name: v.type.tensor_type.elem_type for v in [*typed.graph.input, *typed.graph.value_info,
                                                           *typed.graph.output]}
    initializers = {t.name: t for t in model.graph.initializer}
    external = has_external_weights(model)
    for name, t in initializers.items():
        elem[name] = t.data_type
    dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    fp32 = (ISLANDS - set(half_islands)) | _OWN_TYPES | set(keep_fp32_ops)
    keep = residual_adds(model) | set(keep_fp32_nodes)
    graph_outputs = {o.name for o in model.graph.output}
    half = [n for n in model.graph.node if n.op_type not in fp32 and node_key(n) not in keep
            and not dequantized & set(n.input) and any(elem.get(i) == TensorProto.FLOAT for i in n.input)]
    half_ids = {id(n) for n in half}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    # Initializers read only by fp16 nodes become fp16; the rest stay and get a Cast where needed.
    stored_half = set()
    for name, t in initializers.items():
        if t.data_type == TensorProto.FLOAT and readers.get(name) and all(id(r) in half_ids for r in readers[name]):
            # Saturate: fill values such as float32's lowest (attention masks) become fp16's lowest.
            values = np.clip(tensor_array(t), -65504.0, 65504.0).astype(np.float16)
            t.CopyFrom(make_initializer(values, name, external=external))  # a loaded model's: to external data
            stored_half.add(name)

    casts, renamed = [], {}
    # A graph output computed in fp16 is produced under another name and cast back to its own.
    for n in half:
        for index, out in enumerate(n.output):
            if out in graph_outputs and elem.get(out) == TensorProto.FLOAT:
                n.output[index] = f"{out}.fp16"
                casts.append(helper.make_node("Cast", [f"{out}.fp16"], [out], name=f"{out}/to_fp32",
                                              to=TensorProto.FLOAT))
    produced_half = {o for n in half for o in n.output if elem.get(o) == TensorProto.FLOAT}

    def cast(value: str, to: int) -> str:
        key = (value, to)
        if key not in renamed:
            suffix = "fp16" if to == TensorProto.FLOAT16 else "fp32"
            renamed[key] = f"{value}.{suffix}"
            casts.append(helper.make_node("Cast", [value], [renamed[key]], name=f"{value}/to_{suffix}", to=to))
        return renamed[key]

    for n in model.graph.node:
        for index, value in enumerate(n.input):
            if not value or elem.get(value) != TensorProto.FLOAT or value in stored_half:
                continue
            if id(n) in half_ids and value not in produced_half:
                n.input[index] = cast(value, TensorProto.FLOAT16)
            elif id(n) not in half_ids and value in produced_half:
                n.input[index] = cast(value, TensorProto.FLOAT)
    for stale in list(model.graph.value_info):  # types changed; shapes are re-inferred later
        model.graph.value_info.remove(stale)
    model.graph.node.extend(casts)
    Graph(model)._replace_nodes(list(model.graph.node))  # topological order again
    return len(half)


def node_key(node: onnx.NodeProto) -> str:
    """How mixed precision names a node: its name, or its first output when it has none."""
    return node.name or node.output[0]
