"""Token data for calibration and accuracy checks, and prompt files for generation and benchmarks.

A data folder holds text or pre-tokenized arrays:

    *.txt     text, tokenized with the model's tokenizer (one document per file)
    *.jsonl   one JSON object per line; its "text" field is a document
    *.npy     an integer array: one document ([tokens]) or several ([documents, tokens])
    *.npz     every array inside, as for .npy

Every problem is found before any long work starts and named by file: a missing or empty folder,
no usable file, a file that cannot be read or decoded, ids outside the vocabulary.

A prompt file (`read_prompts`) holds one prompt per line, or with the .jsonl suffix one JSON
object per line whose "prompt" field is one.
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
    return [tokenizer.encode(text) for text in jsonl_strings(text.splitlines(), path, "text")]


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a prompt file, blank lines skipped; a byte-order mark and CRLF line ends are
    taken as written by Windows editors. Callers check each prompt with `check_prompt`."""
    path = Path(path)
    if not path.is_file():
        raise LlmcError(f"{path}: no such file")
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
    try:
        # Only newlines end a line: str.splitlines would also split a prompt at U+2028 or a form feed.
        lines = [line.removesuffix("\r") for line in data.decode("utf-8").split("\n")]
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise LlmcError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    return jsonl_strings(lines, path, "prompt")


def jsonl_strings(lines: list[str], path: Path, key: str) -> list[str]:
    """The string `key` of each JSON object line (blank lines skipped); one line naming the file
    and line where one is not."""
    values = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise LlmcError(f"{path}:{number}: not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise LlmcError(f"{path}:{number}: expected an object with a string '{key}'")
        values.append(record[key])
    return values


def check_prompt(prompt: str, index: int) -> None:
    """Refuse an empty prompt, and text that is not Unicode: a command-line argument whose bytes were
    not UTF-8 arrives holding surrogate escapes (U+DC80-U+DCFF), as can a JSON string's lone \\ud800."""
    if not prompt:
        raise LlmcError(f"prompt {index}: empty: give some text to continue")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(prompt[e.start])
        what = (f"byte 0x{code - 0xDC00:02x} is not UTF-8" if 0xDC80 <= code <= 0xDCFF
                else f"lone surrogate U+{code:04X}")
        raise LlmcError(f"prompt {index}: not valid text: {what} (character {e.start})") from None
