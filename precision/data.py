"""Token data for calibration and accuracy checks: a folder of text or pre-tokenized arrays.

    *.txt     text, tokenized with the model's tokenizer (one document per file)
    *.jsonl   one JSON object per line; its "text" field is a document
    *.npy     an integer array: one document ([tokens]) or several ([documents, tokens])
    *.npz     every array inside, as for .npy

Every problem is found before any long work starts and named by file: a missing or empty folder,
no usable file, a file that cannot be read or decoded, ids outside the vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.tokenizer import Tokenizer

SUFFIXES = (".txt", ".jsonl", ".npy", ".npz")


def read_documents(folder: str | Path, tokenizer: Tokenizer, vocab_size: int, what: str = "--data") -> list[np.ndarray]:
    """Every document in `folder` as int64 token ids, files in name order.

    Args:
        folder: the data folder.
        tokenizer: the model's tokenizer, for text files.
        vocab_size: the model's vocabulary; pre-tokenized ids must be below it.
        what: the option named in errors.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise LlmcError(f"{what}: {folder} is not a folder")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in SUFFIXES)
    if not files:
        raise LlmcError(f"{what}: {folder} holds no {', '.join(SUFFIXES)} file")
    documents = []
    for path in files:
        for doc in _read(path, tokenizer):
            doc = np.asarray(doc, np.int64).reshape(-1)
            if doc.size and (doc.min() < 0 or doc.max() >= vocab_size):
                raise LlmcError(f"{path}: token id {int(doc.max() if doc.max() >= vocab_size else doc.min())} "
                                f"is outside the model's vocabulary of {vocab_size}")
            if doc.size:
                documents.append(doc)
    if not documents:
        raise LlmcError(f"{what}: no tokens in {folder}")
    return documents


def windows(documents: list[np.ndarray], length: int, max_tokens: int) -> list[np.ndarray]:
    """Cut documents into windows of at most `length` tokens (≥ 2, so one prediction each), up to
    `max_tokens` tokens in all."""
    out, total = [], 0
    for doc in documents:
        for start in range(0, len(doc) - 1, length):
            piece = doc[start:start + length]
            if len(piece) < 2 or total >= max_tokens:
                continue
            piece = piece[:max_tokens - total] if total + len(piece) > max_tokens else piece
            if len(piece) >= 2:
                out.append(piece)
                total += len(piece)
    return out


def _read(path: Path, tokenizer: Tokenizer) -> list:
    try:
        if path.suffix == ".npy":
            array = np.load(path, allow_pickle=False)
            return list(array) if array.ndim == 2 else [array]
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as arrays:
                return [row for name in arrays.files for row in
                        (list(arrays[name]) if arrays[name].ndim == 2 else [arrays[name]])]
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise LlmcError(f"{path}: cannot be read ({str(exc).splitlines()[0][:120]})") from None
    if path.suffix == ".txt":
        return [tokenizer.encode(text)]
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LlmcError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise LlmcError(f"{path}:{number}: expected an object with a \"text\" string")
        documents.append(tokenizer.encode(record["text"]))
    return documents
