"""Built-in models (seeded random weights, no download) and `load_model`, the single entry point.

Built-in models exist so the whole toolchain can be exercised offline and
deterministically: the same name always yields bit-identical weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from . import decoder, gpt2
from .base import DecoderLM
from .checkpoint import LoadedModel, load_checkpoint
from .decoder import RMSNorm
from llmc.tokenizer import byte_level_tokenizer
from llmc.errors import LlmcError

# name -> args; the args type picks the model class. All use the 258-token byte-level tokenizer.
BUILTIN_MODELS: dict[str, decoder.DecoderArgs | gpt2.GPT2Args] = {**decoder.CONFIGS, **gpt2.CONFIGS}


def load_model(name_or_path: str | Path) -> LoadedModel:
    """Load a built-in model by name, or a Hugging Face checkpoint folder by path.

    Args:
        name_or_path: a key of BUILTIN_MODELS, or a checkpoint folder.
    """
    key = str(name_or_path)
    if key in BUILTIN_MODELS:
        return LoadedModel(model=build_builtin(key), tokenizer=byte_level_tokenizer(), name=key)
    if Path(key).is_dir():
        return load_checkpoint(key)
    raise LlmcError(
        f"{key!r} is neither a built-in model ({', '.join(sorted(BUILTIN_MODELS))}) nor a checkpoint folder"
    )


def build_builtin(name: str, seed: int = 0) -> DecoderLM:
    """A built-in model with deterministic random weights, in eval mode.

    Args:
        name: a key of BUILTIN_MODELS.
        seed: seed of the weight generator.
    """
    args = BUILTIN_MODELS[name]
    model: DecoderLM = decoder.Decoder(args) if isinstance(args, decoder.DecoderArgs) else gpt2.GPT2(args)
    init_weights(model, seed)
    return model.eval()


def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Normal(0, 0.02) weights, zero biases, unit norm scales, drawn from one seeded generator.

    Args:
        model: the model to initialize in place.
        seed: seed of the torch.Generator; the draw order is named_parameters() order.
    """
    generator = torch.Generator().manual_seed(seed)
    norm_weights = {
        id(m.weight) for m in model.modules() if isinstance(m, (RMSNorm, nn.LayerNorm))
    }
    offset_norms = {id(m.weight): m.offset for m in model.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if id(param) in norm_weights:
                param.fill_(0.0 if offset_norms.get(id(param)) else 1.0)  # Gemma's norms scale by 1 + w
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
