"""Models past protobuf's 2 GB limit: export → compile → run, on the real limit.

The model is Llama-shaped with two very wide layers (MLP width 90,112): 2.2 GB of fp32 weights,
past `onnx_io.EXTERNAL_DATA_THRESHOLD` without lowering it. It is the one slow test of the
compiler suite (about a minute or two, ~5 GiB peak memory), marked `large_model` so it can be
selected or deselected (`-m "not large_model"`); it runs in the normal suite.
"""

from __future__ import annotations

import gc

import numpy as np
import onnx
import pytest
import torch

from llmc.formats import onnx_io
from llmc.compiler.build import compile_model
from llmc.formats.engine_file import read_manifest
from llmc.compiler.export import export
from llmc.llm import LLM
from llmc.models import LoadedModel
from llmc.models.decoder import Decoder as Llama
from llmc.models.decoder import DecoderArgs as LlamaArgs
from llmc.models.registry import init_weights
from llmc.runtime.sampling_params import SamplingParams
from llmc.tokenizer import byte_level_tokenizer

WIDE = LlamaArgs(vocab_size=258, hidden_size=1024, intermediate_size=90112, num_layers=2, num_heads=8,
                 num_kv_heads=4, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5)
PROMPT = "hello"
NEW_TOKENS = 4


def _greedy(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    """PyTorch greedy decoding without a cache (recomputes the sequence; the reference)."""
    empty = [(torch.zeros(1, WIDE.num_kv_heads, 0, WIDE.head_dim),) * 2 for _ in range(WIDE.num_layers)]
    out = []
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.tensor([ids + out])
            n = tokens.shape[1]
            logits, _ = model(tokens, torch.ones(1, n, dtype=torch.int64), torch.arange(n)[None], empty)
            out.append(int(logits[0, -1].argmax()))
    return out


@pytest.mark.large_model
def test_model_past_2gb_exports_compiles_and_runs(tmp_path):
    torch.manual_seed(0)
    model = Llama(WIDE)
    init_weights(model, seed=0)
    model.eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights > 2**31 > onnx_io.EXTERNAL_DATA_THRESHOLD  # the real limit, not a lowered one

    tokenizer = byte_level_tokenizer()
    prompt_ids = tokenizer.encode(PROMPT)
    want = _greedy(model, prompt_ids, NEW_TOKENS)

    check = export(LoadedModel(model=model, tokenizer=tokenizer, name="wide-llama"), tmp_path / "model.onnx")
    assert check.max_abs < 1e-3
    del model
    gc.collect()
    graph_file = tmp_path / "model.onnx"
    # The weights are external, but for a few the exporter keeps inline (under 1 KiB) or folds.
    assert (tmp_path / "model.onnx.data").stat().st_size > 0.99 * weights
    assert graph_file.stat().st_size < 10 * 2**20  # only the graph: the weights are external
    graph_only = onnx.load(graph_file, load_external_data=False)
    assert sum(t.data_location == onnx.TensorProto.EXTERNAL for t in graph_only.graph.initializer) >= 14

    # In memory the weights stay in the file: the loaded graph is small and references them.
    loaded = onnx_io.load_onnx(graph_file)
    assert onnx_io.is_large(loaded)
    assert loaded.graph.ByteSize() < 10 * 2**20
    del loaded

    engine = tmp_path / "engine.plan"
    manifest = compile_model(graph_file, engine)
    assert manifest["paged"] is not None  # the default paged lowering ran
    assert any(e["pass"] == "merge-sibling-matmuls" and e["matches"] for e in manifest["optimization"])
    sections = {s["name"]: s["length"] for s in read_manifest(engine)["sections"]}
    graphs = sum(length for name, length in sections.items() if name.startswith("segment."))
    assert sections["model.onnx.data"] > 0.99 * weights and 0 < graphs < 10 * 2**20  # segments reference the data

    completion = LLM(engine).generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert completion.token_ids == want
    assert np.all(np.array(completion.token_ids) < WIDE.vocab_size)
