"""Bad checkpoint folders and names fail with an LlmcError naming the file and the thing at fault."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from llmc.cli import main
from llmc.errors import LlmcError
from llmc.models import load_checkpoint, load_model


@pytest.fixture
def llama_copy(hf_checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    """A writable copy of the single-file llama checkpoint."""
    return Path(shutil.copytree(hf_checkpoint("llama"), tmp_path / "ckpt"))


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _edit_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_model_type_unknown_to_llmc_and_transformers(llama_copy: Path) -> None:
    _edit_config(llama_copy, model_type="lama")
    with pytest.raises(LlmcError, match=r"config\.json: model_type 'lama' is neither one of llmc's own families nor "
                                        r"known to transformers .* \(nearest: llama\)"):
        load_checkpoint(llama_copy)


def test_tensors_transformers_model_lacks_are_one_cli_line(llama_copy: Path) -> None:
    # Outside llmc's table transformers builds the model, and would fill what the files lack with
    # random weights: a llama checkpoint relabeled as Mixtral has no experts.
    _edit_config(llama_copy, model_type="mixtral")
    result = CliRunner().invoke(main, ["export", str(llama_copy), "-o", str(llama_copy / "model.onnx")])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"{llama_copy}: missing tensor 'model.layers.0.mlp.experts." in lines[0]
    assert "of MixtralForCausalLM (" in lines[0]


def test_unsupported_rope_type(llama_copy: Path) -> None:
    _edit_config(llama_copy, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(LlmcError, match=r"config\.json.*'yarn'"):
        load_checkpoint(llama_copy)


def test_legacy_rope_fields_are_read(llama_copy: Path) -> None:
    # Pre-v5 configs carry rope_theta and rope_scaling ({"type": ...}) instead of rope_parameters.
    cfg = json.loads((llama_copy / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    cfg["rope_scaling"] = params
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    args = load_checkpoint(llama_copy).model.args
    assert args.rope_theta == 10000.0 and args.rope_scaling["type"] == "llama3"


def test_missing_tensor(llama_copy: Path) -> None:
    _edit_weights(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(LlmcError, match=r"model\.safetensors: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_checkpoint(llama_copy)


def test_unexpected_tensor(llama_copy: Path) -> None:
    _edit_weights(llama_copy, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(LlmcError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        load_checkpoint(llama_copy)


def test_shape_mismatch(llama_copy: Path) -> None:
    _edit_weights(llama_copy, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(LlmcError, match=re.escape("model.safetensors: tensor 'model.norm.weight' has shape [63], expected [64]")):
        load_checkpoint(llama_copy)


def test_gpt2_missing_tensor_uses_hf_name(hf_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(hf_checkpoint("gpt2"), tmp_path / "ckpt"))
    _edit_weights(folder, lambda t: t.pop("transformer.ln_f.bias"))
    with pytest.raises(LlmcError, match=r"missing tensor 'transformer\.ln_f\.bias'"):
        load_checkpoint(folder)


def test_missing_shard(hf_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(hf_checkpoint("qwen2", sharded=True), tmp_path / "ckpt"))
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(LlmcError, match=rf"model\.safetensors\.index\.json: shard {shard.name} does not exist"):
        load_checkpoint(folder)


def test_missing_config_json(llama_copy: Path) -> None:
    (llama_copy / "config.json").unlink()
    with pytest.raises(LlmcError, match=f"no config.json in {llama_copy}"):
        load_checkpoint(llama_copy)


def test_missing_tokenizer_json(llama_copy: Path) -> None:
    (llama_copy / "tokenizer.json").unlink()
    with pytest.raises(LlmcError, match=f"no tokenizer.json in {llama_copy}"):
        load_checkpoint(llama_copy)


def test_missing_weights(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(LlmcError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(llama_copy)


def test_unknown_builtin_name_lists_valid_names() -> None:
    with pytest.raises(LlmcError, match="tiny-gpt2.*tiny-llama") as info:
        load_model("no-such-model")
    assert "'no-such-model'" in str(info.value)


def test_load_model_accepts_a_folder(llama_copy: Path) -> None:
    loaded = load_model(str(llama_copy))
    assert loaded.model.family == "llama" and loaded.name == "ckpt"
    assert loaded.tokenizer.eos_id == 257


def test_fused_tensors_name_the_stored_tensor(hf_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    folder = shutil.copytree(hf_checkpoint("phi3"), tmp_path / "phi3")
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    _edit_weights(folder, lambda t: t.update({qkv: t[qkv][:-1]}))
    with pytest.raises(LlmcError, match=re.escape(f"model.safetensors: '{qkv}': tensor has shape [127, 64], "
                                                   "expected [128, 64]")):
        load_checkpoint(folder)
    _edit_weights(folder, lambda t: t.pop(qkv))
    with pytest.raises(LlmcError, match=re.escape(f"missing tensor '{qkv}' (3 missing in all)")):
        load_checkpoint(folder)


def test_config_field_of_the_wrong_type(llama_copy: Path) -> None:
    _edit_config(llama_copy, rms_norm_eps="tiny")
    with pytest.raises(LlmcError, match=r"config\.json: a field has the wrong type \(could not convert"):
        load_checkpoint(llama_copy)


def test_config_json_that_is_not_utf8(llama_copy: Path) -> None:
    (llama_copy / "config.json").write_bytes(b'{"model_type": "caf\xe9"}')
    with pytest.raises(LlmcError, match=r"config\.json is not UTF-8 text"):
        load_checkpoint(llama_copy)


def test_safetensors_file_that_is_not_one(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(LlmcError, match=r"model\.safetensors: not a readable safetensors file"):
        load_checkpoint(llama_copy)


def test_index_whose_weight_map_is_not_a_mapping(hf_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(hf_checkpoint("qwen2", sharded=True), tmp_path / "ckpt"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model-00001.safetensors"]}))
    with pytest.raises(LlmcError, match=r"model\.safetensors\.index\.json has no valid weight_map"):
        load_checkpoint(folder)


def test_bad_tokenizer_json_is_an_llmc_error(llama_copy: Path) -> None:
    (llama_copy / "tokenizer.json").write_text("{not json")
    with pytest.raises(LlmcError, match=r"tokenizer\.json"):
        load_checkpoint(llama_copy)
