"""lower-paged-attention on 4-D Attention nodes: given the 3-D form itself, or refused naming the layer."""

import copy

import numpy as np
import onnx
import pytest
from pass_testing import op_counts

from llmc import LLM, SamplingParams
from llmc.compiler.build import compile_model
from llmc.compiler.pipeline import CLEANUP, optimize, refresh_shapes
from llmc.errors import LlmcError
from llmc.passes.graph import Graph
from llmc.passes.lower_paged_attention import LowerPagedAttention

# Level 2 without attention-3d-layout: every Attention is left 4-D.
WITHOUT_3D_LAYOUT = [*CLEANUP, "fuse-rms-norm", "fuse-rotary", "fuse-attention", "merge-sibling-matmuls"]


@pytest.fixture(scope="module")
def fused_4d(tiny_llama_onnx):
    model, _ = optimize(onnx.load(tiny_llama_onnx), passes=WITHOUT_3D_LAYOUT)
    return model


def test_4d_attention_is_lowered(fused_4d):
    result = LowerPagedAttention().run(copy.deepcopy(fused_4d))
    assert result.matches == 4
    assert op_counts(result.model)["llmc.PagedAttention"] == 4


def test_4d_attention_without_head_count_names_the_layer(fused_4d):
    """Layer 0's query through a Reshape that leaves its heads open, and no llmc.num_heads."""
    model = copy.deepcopy(fused_4d)
    del model.metadata_props[:]
    attention = next(n for n in model.graph.node if n.op_type == "Attention")
    head_dim = Graph(model).shape(attention.input[0])[3]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0, -1, 0, head_dim]), "open_heads"))
    model.graph.node.insert(list(model.graph.node).index(attention), onnx.helper.make_node(
        "Reshape", [attention.input[0], "open_heads"], ["query_open_heads"]))
    attention.input[0] = "query_open_heads"
    refresh_shapes(model)
    with pytest.raises(LlmcError, match=r"^paged lowering: layer 0's Attention .* is 4-D .*head counts"):
        LowerPagedAttention().run(model)


def test_engine_of_4d_attention_generates_the_unoptimized_graphs_tokens(tiny_llama_onnx, tmp_path):
    """Paged through the lowering's own 3-D form vs the contiguous engine of the level-0 graph."""
    prompts = ["def f(x):", "Hi"]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    paged = compile_model(tiny_llama_onnx, tmp_path / "paged.plan", passes=WITHOUT_3D_LAYOUT)
    assert paged["paged"] is not None
    reference = compile_model(tiny_llama_onnx, tmp_path / "dense.plan", level="0", paged=None)
    assert reference["paged"] is None
    got = [c.token_ids for c in LLM(tmp_path / "paged.plan").generate(prompts, params)]
    want = [c.token_ids for c in LLM(tmp_path / "dense.plan").generate(prompts, params)]
    assert got == want
