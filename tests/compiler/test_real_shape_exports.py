"""Exports at a real model's attention geometry compile paged and generate transformers' tokens.

The checkpoints are hf_checkpoints' REAL_SHAPE_FAMILIES: 4 layers, hidden 512, 8 heads of 64
(grouped-query with 4 KV heads; plain multi-head for gpt_neox and gpt2; tied and untied
embeddings), small MLP and vocabulary: the 2-layer, hidden-64 checkpoints of the other exporter
tests do not show that `optimum-cli`'s files (no llmc metadata beside config.json) reach the
paged lowering with 4-D attention.

Coverage, kept to one export per cell: every family through `optimum-cli export onnx --task
text-generation-with-past` (the README's command), and each other
exporter on the families in REST: Optimum's `main_export`, torch.onnx dynamo and TorchScript
each on a grouped-query and a multi-head or tied-embedding family, onnxruntime-genai's builder on
phi3 (its qwen2 re-saves the tokenizer with a 259th token, which the 258-word model refuses). The reference: transformers' greedy continuation by
full forward passes (no cache), compared token by token with `LLM.generate` (ignore_eos).
"""

import pytest
import torch
from exporters import OPTIMUM_CLI, ExporterUnavailable, export_decoder
from genai_builder import BuilderRefused, genai_model
from hf_checkpoints import REAL_SHAPE_FAMILIES, hf_model, write_hf_checkpoint

from llmc import LLM, SamplingParams
from llmc.compiler.build import compile_model

GENAI = "genai-builder"
REST = [("llama", "dynamo"), ("gpt2", "dynamo"), ("qwen2", "torchscript"), ("gpt_neox", "torchscript"),
        ("mistral", "optimum"), ("gemma", "optimum"), ("phi3", GENAI)]
CELLS = [(family, OPTIMUM_CLI) for family in REAL_SHAPE_FAMILIES] + REST
PROMPTS = ("def fibonacci(", "Hi")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = write_hf_checkpoint(tmp_path_factory.mktemp(family), family, real_shape=True)
        return cache[family]

    return get


def _greedy(model, prompt_ids: list[int]) -> list[int]:
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("family,exporter", CELLS)
def test_real_shape_export_compiles_paged_and_generates_transformers_tokens(checkpoints, tmp_path,
                                                                           family, exporter):
    try:
        if exporter == GENAI:
            checkpoint, folder = genai_model(family, real_shape=True)
            source = folder / "model.onnx"
        else:
            checkpoint = checkpoints(family)
            source = export_decoder(checkpoint, exporter, tmp_path / "export" / "model.onnx")
    except (ExporterUnavailable, BuilderRefused) as exc:
        pytest.skip(str(exc))
    manifest = compile_model(source, tmp_path / "engine.plan")
    assert manifest["paged"] is not None, manifest.get("not_paged")
    reference = hf_model(checkpoint)
    assert manifest["geometry"]["num_layers"] == reference.config.num_hidden_layers > 1
    completions = LLM(tmp_path / "engine.plan").generate(
        list(PROMPTS), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for completion in completions:
        assert completion.token_ids == _greedy(reference, completion.prompt_token_ids), completion.prompt
