"""No invalid engine, ever: compile checks each pass's graph, the optimized graph against its
source, and the final graph; a graph whose attention is not recognized compiles unfused."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from llmc import LLM, SamplingParams
from llmc.compiler.build import compile_model
from llmc.compiler.compare import seeded_feeds
from llmc.formats.engine_file import read_manifest
from llmc.formats.onnx_io import tensor_array
from llmc.compiler.pipeline import PIPELINES, optimize, structural_problem
from llmc.errors import LlmcError
from llmc.passes.base import Pass, PassResult
from llmc.passes.registry import PASSES


def _relu_chain(order=("a", "b")):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    nodes = {"a": helper.make_node("Relu", ["x"], ["h"], name="a"),
             "b": helper.make_node("Relu", ["h"], ["y"], name="b")}
    return helper.make_graph([nodes[k] for k in order], "g", [x], [y])


def test_structural_problem_names_the_node_and_value():
    assert structural_problem(_relu_chain()) is None
    assert structural_problem(_relu_chain(("b", "a"))) == "node 'b' reads 'h', which no earlier node defines"
    graph = _relu_chain()
    graph.node[1].output[0] = "h"
    assert structural_problem(graph) == "node 'b' defines 'h' a second time"
    graph = _relu_chain()
    graph.node[1].input[0] = "nowhere"
    assert "reads 'nowhere'" in structural_problem(graph)


class DropsANode(Pass):
    """Removes the first MatMul but not its readers: a dangling input, as a buggy pass leaves."""

    name = "drop-a-node"

    def run(self, model):
        first = next(n for n in model.graph.node if n.op_type == "MatMul")
        model.graph.node.remove(first)
        return PassResult(model, 1)


class ScalesWeights(Pass):
    """Changes results without breaking the graph."""

    name = "scale-weights"

    def run(self, model):
        for tensor in model.graph.initializer:
            value = tensor_array(tensor)  # a loaded model's weights are external references
            if value.dtype == np.float32 and value.ndim == 2:
                tensor.CopyFrom(onnx.numpy_helper.from_array(value * 1.5, tensor.name))
        return PassResult(model, 1)


@pytest.mark.parametrize("bad_pass, message", [
    (DropsANode, "pass 'drop-a-node' left an invalid graph: node '.*' reads '.*', which no earlier node defines"),
    (ScalesWeights, "pass 'scale-weights' changed the outputs beyond tolerance"),
])
def test_compile_names_the_pass_that_broke_the_graph_and_writes_nothing(
        tiny_llama_onnx, tmp_path, monkeypatch, bad_pass, message):
    # Without --verify: compile's own checks must catch both kinds of damage.
    monkeypatch.setitem(PASSES, bad_pass.name, bad_pass)
    monkeypatch.setitem(PIPELINES, "2", ["fold-constants", bad_pass.name, "eliminate-dead-code"])
    with pytest.raises(LlmcError, match=message):
        compile_model(tiny_llama_onnx, tmp_path / "engine.plan")
    assert list(tmp_path.iterdir()) == []


def test_unrecognized_attention_compiles_a_correct_contiguous_engine(tiny_llama_onnx, tiny_llama_engine,
                                                                    tmp_path):
    messages = []
    without_attention = [p for p in PIPELINES["2"] if p not in ("fuse-attention", "attention-3d-layout")]
    manifest = compile_model(tiny_llama_onnx, tmp_path / "engine.plan", passes=without_attention,
                             progress=messages.append)
    assert manifest["paged"] is None
    assert manifest["not_paged"].startswith("attention not recognized in 4 of 4 layers (layers 0, 1, 2, 3)")
    assert any(m.startswith("attention not recognized in 4 of 4 layers") for m in messages)
    assert read_manifest(tmp_path / "engine.plan")["not_paged"] == manifest["not_paged"]
    params = SamplingParams(max_new_tokens=10)
    prompts = ["def f(x):", "import"]
    ours = [c.token_ids for c in LLM(tmp_path / "engine.plan").generate(prompts, params)]
    reference = [c.token_ids for c in LLM(tiny_llama_engine).generate(prompts, params)]
    assert ours == reference


def _decoder_graph(inputs: dict[str, tuple[int, list]]) -> onnx.ModelProto:
    """A graph with the given inputs whose only output is logits (vocab 11), for seeded_feeds."""
    values = [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()]
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 11])
    node = helper.make_node("Cast", ["input_ids"], ["c"], to=TensorProto.FLOAT)
    out = helper.make_node("Expand", ["c", "shape"], ["logits"])
    shape = helper.make_tensor("shape", TensorProto.INT64, [3], [1, 1, 11])
    graph = helper.make_graph([node, out], "g", values, [logits], [shape])
    return helper.make_model(graph)


def test_seeded_feeds_without_past_or_positions():
    model = _decoder_graph({"input_ids": (TensorProto.INT64, ["b", "s"]),
                            "attention_mask": (TensorProto.INT64, ["b", "t"])})
    feeds = seeded_feeds(model, batch=2, seq=5, past=3)
    assert feeds["input_ids"].shape == (2, 5) and feeds["input_ids"].max() < 11
    assert feeds["attention_mask"].shape == (2, 5)  # no past: the mask spans the new tokens only


def test_seeded_feeds_for_contrib_attention_inputs():
    kv = (TensorProto.FLOAT, ["b", 2, "p", 8])
    model = _decoder_graph({"input_ids": (TensorProto.INT64, ["b", "s"]),
                            "attention_mask": (TensorProto.INT64, ["b", "t"]),
                            "seqlens_k": (TensorProto.INT32, ["b"]),
                            "total_sequence_length": (TensorProto.INT32, []),
                            "past_key_values.0.key": kv, "past_key_values.0.value": kv})
    feeds = seeded_feeds(model, batch=2, seq=5, past=3)
    assert feeds["attention_mask"].shape == (2, 8)
    assert feeds["seqlens_k"].dtype == np.int32 and feeds["seqlens_k"].tolist() == [7, 7]
    assert feeds["total_sequence_length"].shape == () and int(feeds["total_sequence_length"]) == 8
    assert feeds["past_key_values.0.key"].shape == (2, 2, 3, 8)


def test_verify_on_a_decoder_without_past(tmp_path):
    # What torch.onnx.export of a Hugging Face model with use_cache=False writes.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.config.use_cache = False

    class NoCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    ids = torch.ones(2, 5, dtype=torch.int64)
    torch.onnx.export(NoCache(), (ids, torch.ones_like(ids)), tmp_path / "nocache.onnx", dynamo=False,
                      input_names=["input_ids", "attention_mask"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"}})
    optimized, report = optimize(onnx.load(tmp_path / "nocache.onnx"), level=2, verify=True)
    assert all(entry["verify"]["max_abs"] <= 1e-4 for entry in report)
