"""Decoder model definitions, checkpoint loading and tokenizers.

`load_model(name_or_path)` is the entry point: a built-in name (see BUILTIN_MODELS) or a
Hugging Face checkpoint folder gives a `LoadedModel` (model in eval mode + tokenizer).
"""

from .checkpoint import LoadedModel, load_checkpoint
from .registry import BUILTIN_MODELS, load_model
from llmc.tokenizer import Tokenizer, byte_level_tokenizer

__all__ = [
    "BUILTIN_MODELS",
    "LoadedModel",
    "Tokenizer",
    "byte_level_tokenizer",
    "load_checkpoint",
    "load_model",
]
