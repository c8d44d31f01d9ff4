"""The paged graph (level 2 + lower-paged-attention): a packed step's logits equal the original
graph's, and lowering refuses what it cannot express."""

import numpy as np
import onnx
import pytest

from llmc.compiler.compare import run_onnx
from llmc.compiler.pipeline import optimize
from llmc.errors import LlmcError
from llmc.passes.lower_paged_attention import LowerPagedAttention
from llmc.plugins.paged_attention import PagedBatch
from llmc.compiler.build import compile_model
from llmc.compiler.paged_engine import PagedOptions
from llmc.compiler.segments import split_at_paged_attention
from llmc.formats.engine_file import read_engine
from paged_cases import Stepper


def paged_decoder(onnx_path, block_size, folder):
    compile_model(onnx_path, folder / "engine.plan", paged=PagedOptions(block_size=block_size))
    return Stepper.open(read_engine(folder / "engine.plan"))


def test_packed_prefill_logits_equal_the_original_graph(tiny_llama_onnx, tmp_path):
    decoder = paged_decoder(tiny_llama_onnx, 16, tmp_path)
    rng = np.random.default_rng(0)
    lens = [5, 9, 1]
    prompts = [rng.integers(0, 258, n) for n in lens]
    # Blocks handed out in a scrambled order, as a block manager would after some traffic.
    tables = np.array([[9, 3], [7, 1], [5, 0]])
    batch = PagedBatch(tables, np.zeros(3, np.int64), np.concatenate([[0], np.cumsum(lens)]))
    positions = np.concatenate([np.arange(n) for n in lens])
    logits = decoder.step(np.concatenate(prompts), positions, batch)
    original = onnx.load(tiny_llama_onnx)
    for s, prompt in enumerate(prompts):
        feeds = {"input_ids": prompt[None], "attention_mask": np.ones((1, len(prompt)), np.int64),
                 "position_ids": np.arange(len(prompt))[None]}
        for i in range(4):
            for part in ("key", "value"):
                feeds[f"past_key_values.{i}.{part}"] = np.zeros((1, 2, 0, 64), np.float32)
        want = run_onnx(original, feeds)["logits"][0, -1]
        np.testing.assert_allclose(logits[s], want, atol=1e-4, rtol=0)


def test_uncanonicalized_attention_is_refused(tiny_llama_onnx):
    model = onnx.load(tiny_llama_onnx)  # not optimized: attention is still decomposed
    with pytest.raises(LlmcError, match="layer 0's attention could not be canonicalized"):
        LowerPagedAttention().run(model)


def test_unsupported_block_size_is_refused():
    with pytest.raises(LlmcError, match="--block-size: 48 is not supported"):
        LowerPagedAttention(48)


def test_graph_is_cut_at_every_attention(tiny_llama_onnx):
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    LowerPagedAttention(16).run(model)
    graphs, segments = zip(*split_at_paged_attention(model))
    assert len(segments) == 5  # 4 layers: segment, attention, …, segment
    assert [int(s.attention.inputs[3].split(".")[1]) for s in segments[:-1]] == [0, 1, 2, 3]
    assert segments[-1].attention is None and segments[-1].outputs == ("logits",)
    # Only attention runs outside onnxruntime: each middle segment holds a layer's MLP and projections.
    assert all(sum(n.op_type == "MatMul" for n in g.graph.node) >= 3 for g in graphs[1:-1])


def test_engine_graph_without_paged_attention_is_refused(tiny_llama_onnx):
    with pytest.raises(LlmcError, match="no PagedAttention node"):
        split_at_paged_attention(onnx.load(tiny_llama_onnx))


def test_only_the_asked_rows_reach_the_last_layers_mlp_and_the_vocabulary_projection(tiny_llama_onnx):
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    LowerPagedAttention(16).run(model)
    producers = {out: n for n in model.graph.node for out in n.output}
    # Everything the logits are computed from, back to the row gathers: the last attention's
    # output projection, the MLP, the norms and the vocabulary projection, and no attention.
    pending, between = ["logits"], []
    while pending:
        node = producers.get(pending.pop())
        if node is None or (node.op_type == "Gather" and "logits_rows" in node.input):
            continue
        between.append(node)
        pending += node.input
    assert not [n.name for n in between if n.domain == "llmc" or n.op_type == "Reshape"]
    assert sum(n.op_type == "MatMul" for n in between) >= 4
    gathers = [n for n in model.graph.node if n.op_type == "Gather" and "logits_rows" in n.input]
    assert 1 <= len(gathers) <= 2  # the attention's output and the residual beside it


def test_values_computed_from_weights_alone_stay_with_their_readers(tiny_llama_onnx):
    from llmc.precision.int8 import quantize_int8
    from llmc.precision.linears import linear_layers

    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    quantize_int8(model, linear_layers(model), [np.arange(3, 40)], "minmax")
    LowerPagedAttention(16).run(model)
    graphs, segments = zip(*split_at_paged_attention(model))
    # Each weight's DequantizeLinear runs in the segment of its MatMul: no dequantized weight
    # crosses a cut (it would be recomputed and copied every step).
    crossing = [name for s in segments for name in s.outputs if name.endswith(".weight.int8.dq")]
    assert crossing == []
    assert sum(n.op_type == "DequantizeLinear" for g in graphs for n in g.graph.node) >= 2 * 17


def test_each_layer_gets_its_window(tiny_llama_onnx):
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    LowerPagedAttention(16, windows=[4, 0, 4, 0]).run(model)
    segments = [segment for _, segment in split_at_paged_attention(model)]
    # Layer i's window on the attention that reads layer i's pool.
    assert [(s.attention.inputs[3], s.attention.window) for s in segments[:-1]] == [
        ("key_cache.0", 4), ("key_cache.1", 0), ("key_cache.2", 4), ("key_cache.3", 0)]


def test_windows_must_cover_every_layer(tiny_llama_onnx):
    model, _ = optimize(onnx.load(tiny_llama_onnx), level=2)
    with pytest.raises(LlmcError, match="paged lowering: 2 layer windows for a graph of 4 layers"):
        LowerPagedAttention(16, windows=[4, 0]).run(model)
