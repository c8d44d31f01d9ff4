"""Cutting a paged engine's graph into segments at compile time, so that serving needs no compiler.

onnxruntime cannot run the engine's ``llmc::PagedAttention`` nodes, so the graph is cut at them
into segments, each an onnxruntime session at run time; the runtime runs segment, attention,
segment, … and carries the values that cross a cut. A value is placed in the first segment all
its inputs are available to, so every layer's projections, norms and MLP run in onnxruntime and
only attention runs outside it. The engine stores each segment's graph as a section and what the
runtime needs to join them (names crossing the cuts, each attention's inputs and attributes) in
the manifest (formats/manifest.py).
"""

from __future__ import annotations

from dataclasses import asdict, replace

import numpy as np
import onnx
from onnx import helper

from llmc.errors import LlmcError
from llmc.formats.manifest import AttentionCall, Geometry, Segment
from llmc.formats.onnx_io import infer_value_info
from llmc.passes.graph import attr
from llmc.plugins.paged_attention import DOMAIN, OP_TYPE
from llmc.plugins.paged_attention_onnx import register, standalone_model


def segment_sections(model: onnx.ModelProto) -> tuple[list[dict], dict[str, bytes]]:
    """The manifest's segment entries and "segment.K.onnx" sections of a paged graph whose
    weights are references (`onnx_io.engine_weights`), each segment referencing those it reads."""
    entries, sections = [], {}
    for k, (graph, segment) in enumerate(split_at_paged_attention(model)):
        if graph is not None:
            sections[f"segment.{k}.onnx"] = graph.SerializeToString()
        entries.append(asdict(replace(segment, section=graph and f"segment.{k}.onnx")))
    return entries, sections


def dense_attention_sections(entries: list[dict], geometry: Geometry, block_size: int,
                             kv_dtype: str) -> dict[str, bytes]:
    """The dense form's model for each distinct (scale, softcap) of the segments' attentions, as
    "dense_attention.K.onnx" sections, each attention's entry naming its own ("dense"): stored so
    that serving builds its session without importing onnx (0.7 s of start-up)."""
    sections: dict[str, bytes] = {}
    names: dict[tuple[float, float], str] = {}
    for entry in entries:
        call = entry["attention"]
        if call is None:
            continue
        key = (call["scale"], call["softcap"])
        if key not in names:
            names[key] = f"dense_attention.{len(names)}.onnx"
            sections[names[key]] = standalone_model(
                num_heads=geometry.num_heads, num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
                block_size=block_size, scale=call["scale"], softcap=call["softcap"],
                cache_dtype=helper.np_dtype_to_tensor_dtype(np.dtype(kv_dtype))).SerializeToString()
        call["dense"] = names[key]
    return sections


def split_at_paged_attention(model: onnx.ModelProto) -> list[tuple[onnx.ModelProto | None, Segment]]:
    """Cut a paged graph into segments around its PagedAttention nodes (see the module docstring):
    each segment's graph (None when no node falls between two attentions) and its description.

    Raises LlmcError when the graph has none, or two that do not depend on each other (they
    would fall in one segment and need the same cut).
    """
    register()
    graph = model.graph
    types = {v.name: v.type for v in [*graph.input, *infer_value_info(model), *graph.output]}
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
        raise LlmcError("paged engine: the graph has no PagedAttention node to cut at")
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
        node = attentions.get(k)
        attention = node and AttentionCall(tuple(node.input), node.output[0], attr(node, "scale"),
                                           attr(node, "window", 0), attr(node, "softcap", 0.0),
                                           dense=None)  # named by `dense_attention_sections`
        segments.append((sub, Segment(None, tuple(inputs), tuple(outputs), attention)))
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
