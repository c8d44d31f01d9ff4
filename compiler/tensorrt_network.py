"""The final graph as TensorRT 11's ONNX parser reads it, checked without TensorRT.

`llmc compile --backend tensorrt` runs the same passes, precision and paged lowering as the CPU
path; then, here:

- `map_plugin_nodes` rewrites each ``llmc`` ``PagedAttention`` node the way the parser finds a
  plugin: op type = plugin name (``paged_attention``), a ``plugin_namespace`` attribute (``llmc``)
  and every plugin attribute written (TensorRT plugin attributes take no defaults).
- `optimization_profile` derives the one profile's min/opt/max shapes from the dynamic dimensions
  the paged lowering names (tokens, rows, seqs, seqs_plus_1, max_blocks, blocks) and the build
  options. TensorRT holds input dimensions of one name equal: their ranges must overlap in the
  profile, and their values agree at run time (NVIDIA's sampleNamedDimensions); so `rows`, the
  logits asked for (up to every token of a step), is not `seqs`.
- `check_network` checks every node against `tensorrt_support.PARSER_OPS` (ops and element types
  the parser imports, and the rules of `tensorrt_support.restriction`) or a registered llmc plugin
  (the input types its register function accepts), and every tensor's element type against what
  a strongly typed network can hold. `--dry-run` prints the result and exits 2 naming each node at
  fault; the real build runs the same check first.

Nothing here imports tensorrt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from llmc.compiler.tensorrt_support import (ELEMENT_TYPES, MAX_OPSET, PARSER_OPS, PARSER_SOURCES, QUANTIZED,
                                            plugin_types_problem, reads_quantized, restriction)
from llmc.errors import LlmcError
from llmc.plugins.paged_attention import DOMAIN, OP_TYPE, PLUGIN_ID

PLUGIN_NAMESPACE, PLUGIN_NAME = PLUGIN_ID.split("::")
PLUGIN_VERSION = "1"
# Plugin attributes and their defaults in the op's contract (plugins/paged_attention.py): the
# lowering writes all three, but a graph from elsewhere may leave window and softcap out.
PLUGIN_ATTRIBUTES = {"scale": None, "window": 0, "softcap": 0.0}
# Plugins llmc registers with TensorRT, by the op type the parser sees.
PLUGINS = {PLUGIN_NAME: PLUGIN_ID}
DOMAIN_DEFAULT, CONTRIB = "", "com.microsoft"
RMS_NORM_OPSET = 23  # RMSNormalization's first opset


@dataclass(frozen=True)
class TensorRTOptions:
    """`llmc compile --backend tensorrt`'s own options.

    Args:
        max_num_tokens: packed tokens in one step (prefill chunks and decodes together): the
            profile's largest `tokens`.
        optimization_level: the builder's optimization level, 0-5 (TensorRT's default 3).
        timing_cache: a timing cache file, read if it exists and written back after the build.
        workspace_mb: the builder's workspace limit in MiB; None leaves TensorRT's (the GPU's memory).
        hardware_compatible: build for every Ampere-or-newer GPU (AMPERE_PLUS), not only this one's
            compute capability.
        version_compatible: an engine later TensorRT 11 releases can run (its lean runtime is kept in
            the engine).
        dry_run: check and print what would be built; build nothing.
    """

    max_num_tokens: int = 2048
    optimization_level: int = 3
    timing_cache: str | None = None
    workspace_mb: float | None = None
    hardware_compatible: bool = False
    version_compatible: bool = False
    dry_run: bool = False

    def __post_init__(self):
        if self.max_num_tokens < 1:
            raise LlmcError(f"--max-num-tokens: must be >= 1, got {self.max_num_tokens}")
        if not 0 <= self.optimization_level <= 5:
            raise LlmcError(f"--builder-optimization-level: must be 0-5, got {self.optimization_level}")
        if self.workspace_mb is not None and not self.workspace_mb > 0:
            raise LlmcError(f"--workspace-mb: must be > 0, got {self.workspace_mb}")


def map_plugin_nodes(model: onnx.ModelProto) -> int:
    """Rewrite the graph's ``llmc`` PagedAttention nodes as TensorRT plugin nodes; returns how many."""
    count = 0
    for node in model.graph.node:
        if node.domain != DOMAIN or node.op_type != OP_TYPE:
            continue
        given = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if given.get("scale") is None:
            raise LlmcError(f"node {node.name}: PagedAttention without a scale attribute; TensorRT plugin "
                            f"attributes have no defaults (compile from the source model again)")
        values = {name: given.get(name, default) for name, default in PLUGIN_ATTRIBUTES.items()}
        del node.attribute[:]
        node.attribute.extend([helper.make_attribute("scale", float(values["scale"])),
                               helper.make_attribute("window", int(values["window"])),
                               helper.make_attribute("softcap", float(values["softcap"])),
                               helper.make_attribute("plugin_namespace", PLUGIN_NAMESPACE),
                               helper.make_attribute("plugin_version", PLUGIN_VERSION)])
        node.op_type, node.domain = PLUGIN_NAME, ""
        count += 1
    if count:
        kept = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return count


def standard_norms(model: onnx.ModelProto) -> int:
    """Rewrite onnxruntime's norms as the opset-23 ops TensorRT's parser imports; returns how many.

    SimplifiedLayerNormalization (genai's graphs, default domain) becomes RMSNormalization, the same
    op under its standard name; com.microsoft Skip(Simplified)LayerNormalization becomes the residual
    Add (and its bias Add) feeding RMSNormalization or LayerNormalization, the sum still available
    as the op's fourth output. Their mean and inverse-deviation outputs have no standard form and
    must be unused.
    """
    used = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    nodes, count = [], 0
    for node in model.graph.node:
        kind = (node.domain, node.op_type)
        if kind not in ((DOMAIN_DEFAULT, "SimplifiedLayerNormalization"), (CONTRIB, "SkipSimplifiedLayerNormalization"),
                        (CONTRIB, "SkipLayerNormalization")):
            nodes.append(node)
            continue
        name = node.name or node.output[0]
        statistics = node.output[1:3] if node.op_type.startswith("Skip") else node.output[1:]
        if any(o and o in used for o in statistics):
            raise LlmcError(f"node {name}: {node.op_type}'s statistics outputs are read; TensorRT's norms have none")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        epsilon = float(attrs.get("epsilon", 1e-5))
        if node.op_type == "SimplifiedLayerNormalization":
            nodes.append(helper.make_node("RMSNormalization", list(node.input[:2]), [node.output[0]], name=name,
                                          axis=int(attrs.get("axis", -1)), epsilon=epsilon,
                                          stash_type=int(attrs.get("stash_type", 1))))
        else:
            layer = node.op_type == "SkipLayerNormalization"
            inputs = list(node.input) + [""] * (5 - len(node.input))
            gamma, beta, bias = inputs[2], inputs[3] if layer else "", inputs[4] if layer else inputs[3]
            total = node.output[3] if len(node.output) > 3 and node.output[3] else f"{name}/sum"
            added = f"{name}/input_plus_skip" if bias else total
            nodes.append(helper.make_node("Add", inputs[:2], [added], name=f"{name}/Add"))
            if bias:
                nodes.append(helper.make_node("Add", [added, bias], [total], name=f"{name}/AddBias"))
            norm = ("LayerNormalization", [total, gamma] + ([beta] if beta else [])) if layer else \
                ("RMSNormalization", [total, gamma])
            nodes.append(helper.make_node(norm[0], norm[1], [node.output[0]], name=name, axis=-1, epsilon=epsilon))
        count += 1
    if count:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        for opset in model.opset_import:
            if opset.domain in ("", "ai.onnx") and opset.version < RMS_NORM_OPSET:
                opset.version = RMS_NORM_OPSET
        if not any(n.domain == CONTRIB for n in model.graph.node):
            kept = [o for o in model.opset_import if o.domain != CONTRIB]
            del model.opset_import[:]
            model.opset_import.extend(kept)
    return count


def optimization_profile(model: onnx.ModelProto, *, max_batch: int, max_seq_len: int, block_size: int,
                         num_blocks: int, max_num_tokens: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Each graph input's (min, opt, max) shape for TensorRT's one optimization profile.

    The optimum is the shape the builder tunes for: a decode step of a full batch (one token per
    seat), which is most of a serving engine's steps. Static dimensions are kept; a dynamic one
    the paged lowering does not name is an error naming the input.
    """
    decode = min(max_batch, max_num_tokens)
    table_width = -(-max_seq_len // block_size)
    ranges = {"tokens": (1, decode, max_num_tokens), "rows": (1, decode, max_num_tokens),
              "seqs": (1, max_batch, max_batch),
              "seqs_plus_1": (2, max_batch + 1, max_batch + 1), "max_blocks": (1, table_width, table_width),
              "blocks": (1, num_blocks, num_blocks)}
    profile = {}
    for value in model.graph.input:
        shapes: list[list[int]] = [[], [], []]
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                low = opt = high = dim.dim_value
            elif dim.dim_param in ranges:
                low, opt, high = ranges[dim.dim_param]
            else:
                raise LlmcError(f"input {value.name}: dimension '{dim.dim_param or '?'}' has no range for a "
                                f"TensorRT profile (known: {', '.join(ranges)})")
            for shape, size in zip(shapes, (low, opt, high)):
                shape.append(size)
        profile[value.name] = tuple(tuple(s) for s in shapes)
    return profile


@dataclass
class NetworkCheck:
    """What `check_network` found: the nodes TensorRT would not parse, and a summary to print."""

    nodes: int
    plugins: dict[str, int] = field(default_factory=dict)          # plugin id → nodes
    op_counts: dict[str, int] = field(default_factory=dict)
    unsupported: list[str] = field(default_factory=list)            # one line per node at fault

    @property
    def ok(self) -> bool:
        return not self.unsupported

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "plugins": self.plugins, "ops": self.op_counts,
                "unsupported": self.unsupported, "sources": list(PARSER_SOURCES)}


def check_network(model: onnx.ModelProto) -> NetworkCheck:
    """Check every node and tensor type of a graph `map_plugin_nodes` prepared."""
    types, ranks = _element_types(model)
    constants = {i.name: i for i in model.graph.initializer}
    constants.update({n.output[0]: a.t for n in model.graph.node if n.op_type == "Constant"
                      for a in n.attribute if a.type == onnx.AttributeProto.TENSOR})
    report = NetworkCheck(nodes=len(model.graph.node))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset > MAX_OPSET:
        report.unsupported.append(f"model: opset {opset}; TensorRT 11.4's parser reads opsets up to {MAX_OPSET}")
    for value in list(model.graph.input) + list(model.graph.output):
        element = value.type.tensor_type.elem_type
        if element not in ELEMENT_TYPES:
            report.unsupported.append(f"{'input' if value in model.graph.input else 'output'} {value.name}: "
                                      f"{_type_name(element)} has no TensorRT type")
    for node in model.graph.node:
        report.op_counts[node.op_type] = report.op_counts.get(node.op_type, 0) + 1
        problem = _node_problem(node, types, ranks, constants)
        if problem == "plugin":
            report.plugins[PLUGINS[node.op_type]] = report.plugins.get(PLUGINS[node.op_type], 0) + 1
        elif problem:
            report.unsupported.append(f"node {node.name or '(unnamed)'} ({node.domain + '::' if node.domain else ''}"
                                      f"{node.op_type}): {problem}")
    return report


def _node_problem(node: onnx.NodeProto, types: dict[str, int], ranks: dict[str, int],
                  constants: dict[str, onnx.TensorProto]) -> str | None:
    """Why TensorRT's parser would refuse the node; "plugin" for an llmc plugin node; None if fine."""
    if node.op_type in PLUGINS and not node.domain:
        return plugin_types_problem(node, types) or "plugin"
    if node.domain not in ("", "ai.onnx"):
        # The parser picks importers by op type alone: a contrib op named like a standard one
        # (com.microsoft RotaryEmbedding) would be read with the standard op's inputs.
        return f"domain '{node.domain}' ops are onnxruntime's; TensorRT's parser has no importer for them"
    if node.op_type not in PARSER_OPS:
        return f"TensorRT's ONNX parser has no importer for {node.op_type} and no llmc plugin is registered for it"
    rule = restriction(node, constants, ranks, types)
    if rule:
        return rule
    allowed = PARSER_OPS[node.op_type]
    for name in list(node.input) + list(node.output):
        element = types.get(name)
        if not name or element is None:
            continue
        if element not in allowed:
            return (f"{name} is {_type_name(element)}; TensorRT's {node.op_type} takes "
                    f"{', '.join(_type_name(t) for t in sorted(allowed))}")
        if element in QUANTIZED and name in node.input and not reads_quantized(node, name):
            return f"{name} is {_type_name(element)}, which TensorRT reads only through DequantizeLinear"
    return None


def _element_types(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]]:
    """Element type and rank of every tensor the graph names (inferred values, inputs, outputs,
    weights) that has them; inferred here when the graph carries no types for its values."""
    types = {i.name: i.data_type for i in model.graph.initializer}
    ranks = {i.name: len(i.dims) for i in model.graph.initializer}
    values = list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    named = {v.name for v in values} | set(types)
    if any(name and name not in named for node in model.graph.node for name in node.input):
        values += _inferred_values(model)
    for value in values:
        if value.type.HasField("tensor_type"):
            types[value.name] = value.type.tensor_type.elem_type
            if value.type.tensor_type.HasField("shape"):
                ranks[value.name] = len(value.type.tensor_type.shape.dim)
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.TENSOR:
                    types[node.output[0]] = attribute.t.data_type
    return types, ranks


def _inferred_values(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """onnx's inferred value types of a copy whose plugin nodes are put back as ``llmc``
    PagedAttention nodes (onnx knows their schema; TensorRT's form it does not)."""
    from llmc.plugins.paged_attention_onnx import register

    register()
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        if node.op_type in PLUGINS and not node.domain:
            kept = [a for a in node.attribute if a.name in PLUGIN_ATTRIBUTES]
            del node.attribute[:]
            node.attribute.extend(kept)
            node.op_type, node.domain = OP_TYPE, DOMAIN
    if not any(o.domain == DOMAIN for o in copy.opset_import):
        copy.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return list(onnx.shape_inference.infer_shapes(copy).graph.value_info)


def _type_name(element: int) -> str:
    return TensorProto.DataType.Name(element)
