"""`llmc export` of decoder families outside llmc's own table, through transformers' module.

Each family is a tiny checkpoint written by transformers with seeded random weights; `llmc export`
(its parity check included), then `compile_model` (paged, CPU) and `LLM.generate`, must give
transformers' own greedy tokens. What the paged engine cannot carry is refused in one line naming
the layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers
from click.testing import CliRunner

from llmc import LLM, SamplingParams
from llmc.cli import main
from llmc.compiler.build import compile_model
from llmc.compiler.export import export
from llmc.errors import LlmcError
from llmc.models import load_model
from llmc.models.checkpoint import FAMILIES
from llmc.tokenizer import byte_level_tokenizer

# vocab 258 fits the byte-level tokenizer; 2 layers, hidden 64: each checkpoint is well under 1 MB.
_COMMON = dict(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=128, bos_token_id=256, eos_token_id=257, pad_token_id=0)
_GQA = dict(_COMMON, num_key_value_heads=2)
# Each exercises what the table's families lack: Falcon's parallel attention with a shared
# layer norm; Mixtral's and OLMoE's top-2 experts; StableLM's partial rotary and LayerNorm;
# Starcoder2's biased LayerNorm, GELU MLP and sliding window; OLMo2's q/k norms over all heads
# and post-norms; Granite's embedding, residual, attention and logit multipliers; Cohere's
# interleaved rotary, parallel block and logit scale; Phi's partial rotary and dense GELU MLP.
CONFIGS = {
    "falcon": lambda: transformers.FalconConfig(
        vocab_size=258, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, parallel_attn=True, bias=False, max_position_embeddings=128,
        bos_token_id=256, eos_token_id=257),
    "mixtral": lambda: transformers.MixtralConfig(**_GQA, num_local_experts=4, num_experts_per_tok=2,
                                                  tie_word_embeddings=False),
    "olmoe": lambda: transformers.OlmoeConfig(**_GQA, num_experts=4, num_experts_per_tok=2),
    "stablelm": lambda: transformers.StableLmConfig(**_GQA, partial_rotary_factor=0.25, use_qkv_bias=True),
    "starcoder2": lambda: transformers.Starcoder2Config(**_GQA, sliding_window=4, use_bias=True),
    "olmo2": lambda: transformers.Olmo2Config(**_GQA),
    "granite": lambda: transformers.GraniteConfig(**_GQA, embedding_multiplier=2.0, residual_multiplier=0.5,
                                                  attention_multiplier=0.2, logits_scaling=2.0),
    "cohere": lambda: transformers.CohereConfig(**_GQA, logit_scale=0.5, tie_word_embeddings=True),
    "phi": lambda: transformers.PhiConfig(**_COMMON, partial_rotary_factor=0.5, tie_word_embeddings=False),
}
_INIT_STD = 0.1  # activations of O(1): a numerical slip moves the greedy tokens
PROMPTS = ("def fibonacci(", "Hi")
NEW_TOKENS = 12


def write_checkpoint(folder: Path, config: transformers.PretrainedConfig, seed: int = 0) -> Path:
    """A transformers checkpoint of `config` with seeded random weights (biases and norm scales
    randomized too) and llmc's byte-level tokenizer."""
    torch.manual_seed(seed)
    config.initializer_range = _INIT_STD
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)
    byte_level_tokenizer().save(folder)
    return folder


def transformers_greedy(model: transformers.PreTrainedModel, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy continuation, a full forward per token (no cache involved)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_exported_family_compiles_paged_and_generates_transformers_greedy_tokens(family, tmp_path):
    assert family not in FAMILIES  # the transformers path, not the table's
    folder = write_checkpoint(tmp_path / family, CONFIGS[family]())
    check = export(str(folder), tmp_path / "model.onnx")
    assert check.max_abs < 1e-4
    engine = tmp_path / "engine.plan"
    manifest = compile_model(tmp_path / "model.onnx", engine)
    assert manifest["paged"] is not None, manifest.get("not_paged")
    completions = LLM(engine).generate(list(PROMPTS), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    # transformers' defaults (sdpa attention, its own experts loop), not the exported eager forms.
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for completion in completions:
        assert completion.token_ids == transformers_greedy(reference, completion.prompt_token_ids), completion.prompt


# What the decoder-with-past interface and the paged op cannot carry, each refused before any trace.
REFUSED = {
    # Multi-head latent attention caches one compressed latent and a rotary key, not keys and values.
    "deepseek_v2": (lambda: transformers.DeepseekV2Config(
        **_COMMON, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        ": layer 0 (DeepseekV2Attention) caches keys of 1 x 16 (heads x head dim) and values of 1 x 8, as "
        "multi-head latent attention does; llmc's paged attention needs keys and values of one shape"),
    # A hybrid: convolution layers keep a state of their own.
    "lfm2": (lambda: transformers.Lfm2Config(**_GQA, layer_types=["conv", "full_attention"]),
             "/config.json: layer 0 is a 'conv' layer (layer_types), not attention; llmc's paged engine carries "
             "only attention layers' keys and values"),
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_what_the_paged_engine_cannot_carry_is_one_line_naming_the_layer(family, tmp_path):
    config, message = REFUSED[family]
    folder = write_checkpoint(tmp_path / family, config())
    result = CliRunner().invoke(main, ["export", str(folder), "-o", str(tmp_path / "model.onnx")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"llmc: error: {folder}{message}"]
    assert not (tmp_path / "model.onnx").exists()


def test_a_model_type_without_a_decoder_only_model_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 64, "num_layers": 2}))
    with pytest.raises(LlmcError, match=r"config\.json: model_type 't5' has no causal-LM \(decoder-only\) model in "
                                        r"transformers"):
        load_model(tmp_path)


def test_both_paths_export_a_table_family_to_the_same_logits(tmp_path):
    """A family both paths load (Llama): transformers' module, forced, writes the interface and
    metadata the table's writes, and onnxruntime gives the same logits and presents."""
    from hf_checkpoints import write_hf_checkpoint

    from llmc.compiler.export import io_names, model_geometry, sample_inputs
    from llmc.models.checkpoint import LoadedModel, read_config
    from llmc.models.transformers_module import load_transformers_checkpoint
    from llmc.tokenizer import Tokenizer

    folder = write_hf_checkpoint(tmp_path / "llama", "llama")
    table = load_model(folder)
    forced = LoadedModel(load_transformers_checkpoint(folder, read_config(folder)), Tokenizer.from_folder(folder),
                         folder.name)
    assert model_geometry(forced.model) == model_geometry(table.model)
    graphs = []
    for name, loaded in (("table", table), ("transformers", forced)):
        export(loaded, tmp_path / f"{name}.onnx")
        graphs.append(onnx.load(tmp_path / f"{name}.onnx"))
    inputs, outputs = io_names(table.model.num_layers)
    for graph in graphs:
        assert [i.name for i in graph.graph.input] == inputs and [o.name for o in graph.graph.output] == outputs
    metadata = [{p.key: p.value for p in g.metadata_props if p.key != "llmc.source_model"} for g in graphs]
    assert metadata[0] == metadata[1]
    feeds = {k: v.numpy() for k, v in sample_inputs(model_geometry(table.model), 2, 6, 3, seed=4).items()}
    got, want = (ort.InferenceSession(g.SerializeToString()).run(None, feeds) for g in graphs)
    for name, g, w in zip(outputs, got, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0, err_msg=name)
