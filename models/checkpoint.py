"""Load a Hugging Face checkpoint folder (config.json, safetensors, tokenizer.json) into an llmc model.

For the families in llmc's table (`FAMILIES`), weights are read with safetensors directly into
llmc's own modules: every tensor in the files must map to one of our parameters (buffers such as
rotary tables and GPT-2 causal masks are skipped) and every parameter must be found, with the
right shape; otherwise an LlmcError names the tensor and the file. Any other model_type is built
by transformers (models/transformers_module.py).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .base import DecoderLM
from .decoder import Decoder, DecoderArgs
from .gpt2 import GPT2, GPT2Args
from .hf_config import READERS
from llmc.tokenizer import Tokenizer
from llmc.errors import LlmcError, first_line

# model_type in config.json -> (args class, model class): the generic decoder's families, and GPT-2.
FAMILIES: dict[str, tuple[Any, type[DecoderLM]]] = {
    **{model_type: (DecoderArgs, Decoder) for model_type in READERS},
    "gpt2": (GPT2Args, GPT2),
}


@dataclass
class LoadedModel:
    """A model ready to run (eval mode, float32) with its tokenizer.

    Args:
        model: the llmc model (a `DecoderLM`).
        tokenizer: its tokenizer.
        name: built-in name or checkpoint folder name.
    """

    model: torch.nn.Module
    tokenizer: Tokenizer
    name: str


def load_checkpoint(folder: str | Path) -> LoadedModel:
    """Load a Hugging Face checkpoint folder.

    Args:
        folder: holds config.json, model.safetensors (or model.safetensors.index.json
            and its shards) and tokenizer.json.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise LlmcError(f"checkpoint folder {folder} does not exist")
    cfg = read_config(folder)
    if cfg.get("model_type") in FAMILIES:
        with _without_weight_init():
            model = build_model(cfg, folder / "config.json")
        load_weights(model, folder)
    else:
        model = _transformers_model(folder, cfg)
    try:
        tokenizer = Tokenizer.from_folder(folder)
    except LlmcError:
        raise
    except ValueError as e:  # the tokenizer module reports bad files as plain ValueErrors
        raise LlmcError(first_line(e)) from None
    return LoadedModel(model=model.eval(), tokenizer=tokenizer, name=folder.resolve().name)


def _transformers_model(folder: Path, cfg: dict[str, Any]) -> torch.nn.Module:
    """A family outside the table, as transformers builds it (models/transformers_module.py)."""
    try:
        from .transformers_module import load_transformers_checkpoint
    except ModuleNotFoundError as e:
        raise LlmcError(f"{folder / 'config.json'}: model_type {cfg.get('model_type')!r} is not one of llmc's own "
                        f"families ({', '.join(FAMILIES)}) and is exported through transformers, which is not "
                        f"installed ({e.name}): pip install transformers") from None
    return load_transformers_checkpoint(folder, cfg)


def read_config(folder: Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint folder.

    Args:
        folder: the checkpoint folder.
    """
    path = folder / "config.json"
    if not path.is_file():
        raise LlmcError(f"no config.json in {folder}")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise LlmcError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise LlmcError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LlmcError(f"{path} does not hold a JSON object")
    return cfg


def build_model(cfg: dict[str, Any], config_path: Path) -> DecoderLM:
    """An untrained float32 model for an HF config dict, dispatching on model_type.

    Args:
        cfg: the parsed config.json.
        config_path: where cfg came from, for error messages.
    """
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise LlmcError(
            f"{config_path}: model_type {model_type!r} is not supported "
            f"(nearest supported: {_nearest(str(model_type))}; supported: {', '.join(FAMILIES)})"
        )
    args_cls, model_cls = FAMILIES[model_type]
    try:
        args = args_cls.from_hf_config(cfg)
    except LlmcError as e:
        raise LlmcError(f"{config_path}: {e}") from None
    except (TypeError, ValueError) as e:  # int()/float() of a field holding the wrong JSON type
        raise LlmcError(f"{config_path}: a field has the wrong type ({first_line(e, 200)})") from None
    return model_cls(args).float()


@contextlib.contextmanager
def _without_weight_init():
    """Build layers without drawing their random initial weights (1.4 s of SmolLM2-135M's
    export): `load_weights` overwrites every parameter, and a tensor the checkpoint lacks is an
    error, so none is left as built. (transformers builds a checkpoint's model the same way.)"""
    skipped = ("kaiming_uniform_", "uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_")
    originals = {name: getattr(torch.nn.init, name) for name in skipped}
    for name in skipped:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(torch.nn.init, name, function)


def _nearest(model_type: str) -> str:
    """The supported model_type most like `model_type`: longest shared prefix, then difflib's ratio."""
    def likeness(known: str) -> tuple[int, float]:
        prefix = len(os.path.commonprefix([model_type, known]))
        return prefix, difflib.SequenceMatcher(None, model_type, known).ratio()

    return max(FAMILIES, key=likeness)


def load_weights(model: DecoderLM, folder: Path) -> None:
    """Copy the checkpoint's tensors into `model`'s parameters, checking names and shapes.

    Args:
        model: built by `build_model` for this checkpoint.
        folder: the checkpoint folder.
    """
    # named_parameters() lists a tied lm_head once, under the embedding's name.
    params = dict(model.named_parameters())
    tied_head = getattr(model.args, "tie_word_embeddings", False)
    loaded: set[str] = set()
    files = weight_files(folder)
    for file in files:
        with _open_safetensors(file) as f:
            for hf_name in f.keys():
                name = model.normalize_hf_name(hf_name)
                if name is None or (tied_head and name == "lm_head.weight"):
                    continue  # a buffer, or a stored copy of the tied embedding
                tensor = f.get_tensor(hf_name)
                try:
                    parts = model.split_hf_tensor(name, tensor)  # a fused tensor (e.g. qkv) -> our parameters
                except LlmcError as e:
                    raise LlmcError(f"{file}: {hf_name!r}: {e}") from None
                for name, tensor in (parts or {name: tensor}).items():
                    _copy_tensor(params, loaded, model, file, hf_name, name, tensor)
    missing = [model.hf_name(n) for n in params if n not in loaded]
    if missing:
        # A sharded checkpoint's tensor list is its index file.
        where = files[0] if files[0].name == "model.safetensors" else folder / "model.safetensors.index.json"
        raise LlmcError(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")


def _open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise LlmcError(f"{file}: not a readable safetensors file ({first_line(e, 200)})") from None


def _copy_tensor(params: dict[str, torch.Tensor], loaded: set[str], model: DecoderLM, file: Path,
                 hf_name: str, name: str, tensor: torch.Tensor) -> None:
    """Check one tensor against our parameter `name` and copy it in (transposed where HF stores it so)."""
    if name not in params:
        raise LlmcError(f"{file}: unexpected tensor {hf_name!r}")
    if name in loaded:
        raise LlmcError(f"{file}: tensor {hf_name!r} is stored more than once")
    expected = tuple(params[name].shape)
    if model.hf_transposed(name):
        expected = expected[::-1]
    if tuple(tensor.shape) != expected:
        raise LlmcError(f"{file}: tensor {hf_name!r} has shape {list(tensor.shape)}, expected {list(expected)}")
    if model.hf_transposed(name):
        tensor = tensor.t()
    with torch.no_grad():
        params[name].copy_(tensor.to(torch.float32))
    loaded.add(name)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: model.safetensors, or the shards its index lists.

    Args:
        folder: the checkpoint folder.
    """
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        raise LlmcError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise LlmcError(f"{index} has no valid weight_map") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise LlmcError(f"{index} has no valid weight_map")
    files = [folder / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise LlmcError(f"{index}: shard {file.name} does not exist")
    return files
