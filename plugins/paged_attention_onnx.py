"""``llmc::paged_attention`` in ONNX: the node the paged lowering writes, and a dense form.

The node: ``PagedAttention`` in domain ``llmc`` with the op's inputs in the contract's order
(plugins/paged_attention.py); `register()` gives onnx its schema so the checker and shape
inference accept graphs holding it.

The dense form: the op written with standard ops, every sequence of a step packed into one
ragged attention:

    past     Gather(pool, the used blocks of all sequences, concatenated)
             → [1, kv_heads, those blocks · block_size, head_dim]
    attend   Attention-23(q [1, heads, tokens, D], Concat(past, k), Concat(past, v), mask)
    mask     token t of sequence s sees s's cached slots and s's new tokens up to itself

The block list and the mask depend only on the batch layout (`plan_step`). It copies the blocks
it reads and scores every token against every packed key, so it pays off only where its
matrix products do: the CPU kernel (plugins/paged_attention_cpu.py) sends it the sequences with
many new tokens (prefill chunks) and keeps decode tokens for itself.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from onnx import defs
from onnx.defs import OpSchema

from llmc.plugins.paged_attention import DOMAIN, OP_TYPE, PLAN_INPUTS

# The step's layout, shared by every layer's node (graph inputs of a paged engine).
METADATA_INPUTS = [helper.make_tensor_value_info("block_tables", TensorProto.INT64, ["seqs", "max_blocks"]),
                   helper.make_tensor_value_info("context_lens", TensorProto.INT64, ["seqs"]),
                   helper.make_tensor_value_info("query_start_loc", TensorProto.INT64, ["seqs_plus_1"])]


def paged_attention_node(query: str, key: str, value: str, key_cache: str, value_cache: str, output: str,
                         *, name: str, scale: float, window: int = 0, softcap: float = 0.0) -> onnx.NodeProto:
    """One ``llmc::PagedAttention`` reading the step's layout from `METADATA_INPUTS`.

    Scale, window (0: full attention) and softcap (0: none) are always written: TensorRT plugin
    attributes have no defaults.
    """
    register()
    layout = [i.name for i in METADATA_INPUTS]
    return helper.make_node(OP_TYPE, [query, key, value, key_cache, value_cache, *layout], [output],
                            name=name, domain=DOMAIN, scale=float(scale), window=int(window),
                            softcap=float(softcap))


def register() -> None:
    """Give onnx the node's schema (once per process): output typed and shaped like the query."""
    try:
        defs.get_schema(OP_TYPE, 1, DOMAIN)
        return
    except defs.SchemaError:
        pass
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    schema = OpSchema(
        OP_TYPE, DOMAIN, 1, "Attention of packed new tokens over a paged KV pool (plugins/paged_attention.py).",
        inputs=[OpSchema.FormalParameter(n, "T") for n in ("query", "key", "value")]
        + [OpSchema.FormalParameter(n, "C") for n in ("key_cache", "value_cache")]  # the pool's own type
        + [OpSchema.FormalParameter(i.name, "I") for i in METADATA_INPUTS],
        outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", floats, ""), ("C", floats, ""), ("I", ["tensor(int32)", "tensor(int64)"], "")],
        # window and softcap are optional: engines built before them have neither (0: none).
        attributes=[OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "", required=True),
                    OpSchema.Attribute("window", OpSchema.AttrType.INT, "", required=False),
                    OpSchema.Attribute("softcap", OpSchema.AttrType.FLOAT, "", required=False)])
    schema.set_type_and_shape_inference_function(_like_query)
    defs.register_schema(schema)


def _like_query(ctx) -> None:
    out = onnx.TypeProto()
    out.CopyFrom(ctx.get_input_type(0))
    ctx.set_output_type(0, out)


def plan_inputs(dtype: int = TensorProto.FLOAT) -> list[onnx.ValueInfoProto]:
    """Graph inputs for `PLAN_INPUTS`."""
    return [helper.make_tensor_value_info(PLAN_INPUTS[0], TensorProto.INT64, ["used_blocks"]),
            helper.make_tensor_value_info(PLAN_INPUTS[1], dtype, [1, 1, "tokens", "keys"])]


def lowering_nodes(prefix: str, query: str, key: str, value: str, key_cache: str, value_cache: str,
                   output: str, *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   scale: float | None = None, widen_cache_to: int | None = None, softcap: float = 0.0
                   ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes computing one PagedAttention ([tokens, heads, head_dim] in and out).

    Args:
        prefix: makes this layer's intermediate names unique.
        query, key, value, key_cache, value_cache, output: value names in the graph.
        num_heads, num_kv_heads, head_dim, block_size: the op's geometry.
        scale: attention scale; default 1/sqrt(head_dim).
        widen_cache_to: the query's element type, when the pool's is another (a float16 pool):
            gathered blocks are cast to it.
        softcap: Attention-23's softcap (0: none); onnxruntime applies it before the mask, as the
            op's contract does.
    """
    blocks, mask = PLAN_INPUTS
    n = lambda name: f"{prefix}/{name}"  # noqa: E731 — a local naming helper
    past_shape = helper.make_tensor(n("past_shape"), TensorProto.INT64, [4], [1, num_kv_heads, -1, head_dim])
    batch_axis = helper.make_tensor(n("batch_axis"), TensorProto.INT64, [1], [0])
    nodes = []
    for name, source in (("q", query), ("k", key), ("v", value)):
        nodes += [helper.make_node("Transpose", [source], [n(f"{name}_heads")], perm=[1, 0, 2]),
                  helper.make_node("Unsqueeze", [n(f"{name}_heads"), n("batch_axis")], [n(f"{name}_4d")])]
    for name, cache in (("k", key_cache), ("v", value_cache)):
        gathered = n(f"{name}_blocks")  # [used, KV, blk, D]
        nodes.append(helper.make_node("Gather", [cache, blocks], [gathered]))
        if widen_cache_to is not None:
            nodes.append(helper.make_node("Cast", [gathered], [n(f"{name}_blocks_wide")], to=widen_cache_to))
            gathered = n(f"{name}_blocks_wide")
        nodes += [
            helper.make_node("Transpose", [gathered], [n(f"{name}_by_head")], perm=[1, 0, 2, 3]),
            helper.make_node("Reshape", [n(f"{name}_by_head"), n("past_shape")], [n(f"{name}_past")]),
            helper.make_node("Concat", [n(f"{name}_past"), n(f"{name}_4d")], [n(f"{name}_all")], axis=2),
        ]
    nodes += [
        helper.make_node("Attention", [n("q_4d"), n("k_all"), n("v_all"), mask], [n("attended")],
                         scale=float(head_dim ** -0.5 if scale is None else scale),
                         **({"softcap": float(softcap)} if softcap else {})),
        helper.make_node("Squeeze", [n("attended"), n("batch_axis")], [n("attended_heads")]),
        helper.make_node("Transpose", [n("attended_heads")], [output], perm=[1, 0, 2]),
    ]
    return nodes, [past_shape, batch_axis]


def standalone_model(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     scale: float | None = None, dtype: int = TensorProto.FLOAT,
                     cache_dtype: int | None = None, softcap: float = 0.0) -> onnx.ModelProto:
    """The dense form of one PagedAttention as a whole ONNX model (inputs: the op's tensors and
    `PLAN_INPUTS`; the pool in `cache_dtype`, default `dtype`)."""
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    nodes, constants = lowering_nodes("paged", "query", "key", "value", "key_cache", "value_cache",
                                      "output", num_heads=num_heads, num_kv_heads=num_kv_heads,
                                      head_dim=head_dim, block_size=block_size, scale=scale,
                                      widen_cache_to=None if cache_dtype == dtype else dtype, softcap=softcap)
    tensor = lambda name, shape, type_=dtype: helper.make_tensor_value_info(name, type_, shape)  # noqa: E731
    inputs = [tensor("query", ["tokens", num_heads, head_dim]),
              tensor("key", ["tokens", num_kv_heads, head_dim]),
              tensor("value", ["tokens", num_kv_heads, head_dim]),
              tensor("key_cache", ["blocks", num_kv_heads, block_size, head_dim], cache_dtype),
              tensor("value_cache", ["blocks", num_kv_heads, block_size, head_dim], cache_dtype),
              *plan_inputs(dtype)]
    graph = helper.make_graph(nodes, "paged_attention", inputs,
                              [tensor("output", ["tokens", num_heads, head_dim])], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)
