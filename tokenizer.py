"""Text <-> token ids, wrapping a Hugging Face `tokenizers.Tokenizer`.

The wrapper adds the few facts the runtime needs and `tokenizers` does not keep in its
own JSON: which ids are BOS/EOS, whether to prepend BOS, and whether special-token text
typed by a user is treated as plain text. `to_json` carries all of it, so an engine file
can embed one string and rebuild the exact tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from llmc.errors import LlmcError, first_line

# Version tag of the string written by `Tokenizer.to_json`, so a later format can be told apart.
_JSON_FORMAT = "llmc-tokenizer/1"
# The keys `Tokenizer.to_json` writes, every one of which `from_json` reads.
_JSON_KEYS = ("tokenizer_json", "bos_id", "eos_id", "eos_ids", "add_bos", "split_special_tokens", "chat_template")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus BOS/EOS ids and the BOS policy.

    Args:
        inner: the wrapped `tokenizers.Tokenizer`.
        bos_id: id of the beginning-of-sequence token, or None if the model has none.
        eos_id: id of the end-of-sequence token, or None if the model has none.
        eos_ids: every id that ends generation (Llama 3 lists several); `eos_id` is always
            among them, first.
        add_bos: prepend `bos_id` in `encode` (ignored when `bos_id` is None).
        split_special_tokens: encode special-token text found in the input (e.g. a literal
            "</s>") as ordinary text instead of as the special token.
        chat_template: the model's Jinja chat template (Hugging Face's), or None if it has none.
    """

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eos_ids: Sequence[int] = (),
        add_bos: bool = False,
        split_special_tokens: bool = False,
        chat_template: str | None = None,
    ) -> None:
        size = inner.get_vocab_size(with_added_tokens=True)
        # dict.fromkeys: ordered and without repeats, the primary EOS first.
        all_eos = tuple(dict.fromkeys(i for i in (eos_id, *eos_ids) if i is not None))
        for field, value in (("bos_id", bos_id), ("eos_id", eos_id), *(("eos_ids", i) for i in all_eos)):
            if value is not None and not (isinstance(value, int) and 0 <= value < size):
                raise LlmcError(f"tokenizer {field}={value} is outside the vocabulary of size {size}")
        self._inner = inner
        # Not part of tokenizers' own JSON, so it is re-applied from our flag on every load.
        self._inner.encode_special_tokens = split_special_tokens
        self.bos_id = bos_id
        self.eos_id = eos_id if eos_id is not None else (all_eos[0] if all_eos else None)
        self.eos_ids = all_eos
        self.add_bos = add_bos
        self.split_special_tokens = split_special_tokens
        self.chat_template = chat_template

    @property
    def inner(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (BOS policy and split_special_tokens not applied)."""
        return self._inner

    @property
    def vocab_size(self) -> int:
        """Number of ids, added (special) tokens included."""
        return self._inner.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Turn text into ids, prepending BOS when the tokenizer is set to.

        Args:
            text: the text to encode.
        """
        # add_special_tokens=False: BOS is our decision, not the post-processor's.
        ids = self._inner.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        """Turn ids back into text, dropping special tokens such as BOS/EOS.

        Args:
            ids: token ids, each in [0, vocab_size).
        """
        return self._inner.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of `token`, or None if it is not in the vocabulary.

        Args:
            token: the token's text as it appears in the vocabulary.
        """
        return self._inner.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt text of a conversation, ending where the assistant's reply starts (Hugging
        Face's `apply_chat_template(..., add_generation_prompt=True, tokenize=False)`).

        Args:
            messages: {"role": ..., "content": ...} dicts, oldest first.
        """
        if self.chat_template is None:
            raise LlmcError("this model's tokenizer has no chat template (use completions with a prompt)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        token = lambda i: None if i is None else self._inner.id_to_token(i)  # noqa: E731
        try:
            return environment.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=True, bos_token=token(self.bos_id) or "",
                eos_token=token(self.eos_id) or "")
        except TemplateError as e:
            raise LlmcError(f"chat template: {first_line(e)}") from None

    def to_json(self) -> str:
        """A JSON string from which `from_json` rebuilds this exact tokenizer."""
        return json.dumps(
            {
                "format": _JSON_FORMAT,
                # As a string, not a nested object: reading it back is one `from_str`, where the
                # object cost a parse and a re-serialization (0.15 s of SmolLM2-135M's start-up).
                "tokenizer_json": self._inner.to_str(),
                "bos_id": self.bos_id,
                "eos_id": self.eos_id,
                "eos_ids": list(self.eos_ids),
                "add_bos": self.add_bos,
                "split_special_tokens": self.split_special_tokens,
                "chat_template": self.chat_template,
            }
        )

    @classmethod
    def from_json(cls, s: str, source: str = "tokenizer JSON") -> Tokenizer:
        """Rebuild a tokenizer from a `to_json` string.

        Args:
            s: the string returned by `to_json`.
            source: where the string came from (e.g. an engine file), to name in errors.
        """
        try:
            data = json.loads(s)
        except json.JSONDecodeError as e:
            raise LlmcError(f"{source}: tokenizer JSON is not valid JSON: {e}") from None
        if not isinstance(data, dict) or data.get("format") != _JSON_FORMAT:
            raise LlmcError(f"{source}: tokenizer JSON is not in the {_JSON_FORMAT!r} format")
        missing = [key for key in _JSON_KEYS if key not in data]
        if missing:
            raise LlmcError(f"{source}: tokenizer JSON has no '{missing[0]}'")
        if not isinstance(data["tokenizer_json"], str):
            raise LlmcError(f"{source}: tokenizer JSON's 'tokenizer_json' is not a string")
        try:
            inner = tokenizers.Tokenizer.from_str(data["tokenizer_json"])
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise LlmcError(f"{source}: the tokenizer could not be read: {first_line(e)}") from None
        try:
            return cls(
                inner,
                bos_id=data["bos_id"],
                eos_id=data["eos_id"],
                eos_ids=data["eos_ids"],
                add_bos=bool(data["add_bos"]),
                split_special_tokens=bool(data["split_special_tokens"]),
                chat_template=data["chat_template"],
            )
        except (LlmcError, TypeError) as e:  # TypeError: eos_ids not a list
            raise LlmcError(f"{source}: {first_line(e)}") from None

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face tokenizer folder.

        Reads `tokenizer.json`; BOS/EOS come from `tokenizer_config.json` (`bos_token`,
        `eos_token`) or else from `config.json` (`bos_token_id`, `eos_token_id`). Every id in
        `eos_token_id` of `config.json` and `generation_config.json` (an int or a list) also
        ends generation.

        Args:
            path: folder holding `tokenizer.json` (usually the checkpoint folder).
        """
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise LlmcError(f"no tokenizer.json in {folder}")
        try:
            inner = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise LlmcError(f"{tok_file} could not be read: {first_line(e)}") from None
        tok_config = _read_json_if_exists(folder / "tokenizer_config.json")
        model_config = _read_json_if_exists(folder / "config.json")

        bos_id = _special_id(inner, tok_config, "bos_token", model_config, "bos_token_id", folder)
        eos_id = _special_id(inner, tok_config, "eos_token", model_config, "eos_token_id", folder)
        eos_ids = [*_id_list(model_config, folder / "config.json"),
                   *_id_list(_read_json_if_exists(folder / "generation_config.json"),
                             folder / "generation_config.json")]
        if "add_bos_token" in tok_config:
            add_bos = bool(tok_config["add_bos_token"])
        else:
            # Tokenizers such as Llama 3 prepend BOS in their post-processor instead of saying
            # so in the config; we encode without the post-processor, so detect it here.
            with_specials = inner.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and with_specials[:1] == [bos_id]
        try:
            return cls(
                inner,
                bos_id=bos_id,
                eos_id=eos_id,
                eos_ids=eos_ids,
                add_bos=add_bos,
                split_special_tokens=bool(tok_config.get("split_special_tokens", False)),
                chat_template=_chat_template(folder, tok_config),
            )
        except LlmcError as e:
            raise LlmcError(f"{folder}: {e}") from None

    def save(self, folder: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` so `from_folder` reloads this tokenizer.

        EOS ids beyond `eos_id` go into `generation_config.json`'s `eos_token_id`, the rest of an
        existing file kept.

        Args:
            folder: destination folder, created if missing.
        """
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        self._inner.save(str(out / "tokenizer.json"))
        config: dict[str, Any] = {
            "add_bos_token": self.add_bos,
            "split_special_tokens": self.split_special_tokens,
        }
        for key, token_id in (("bos_token", self.bos_id), ("eos_token", self.eos_id)):
            if token_id is not None:
                config[key] = self._inner.id_to_token(token_id)
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if self.chat_template is not None:
            (out / "chat_template.jinja").write_text(self.chat_template)
        if self.eos_ids != (() if self.eos_id is None else (self.eos_id,)):
            generation = _read_json_if_exists(out / "generation_config.json")
            generation["eos_token_id"] = list(self.eos_ids)
            (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def byte_level_tokenizer() -> Tokenizer:
    """A deterministic 258-token byte-level tokenizer built in code.

    Ids 0..255 are the bytes 0..255 (as GPT-2's printable byte symbols), 256 is `<s>` (BOS)
    and 257 is `</s>` (EOS). There are no merges, so every UTF-8 byte is one token and
    `decode(encode(s)) == s` for any text, including text that spells `<s>`.
    """
    byte_symbols = _bytes_to_unicode()
    vocab = {byte_symbols[b]: b for b in range(256)}
    inner = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(
        inner,
        bos_id=inner.token_to_id("<s>"),
        eos_id=inner.token_to_id("</s>"),
        add_bos=True,
        split_special_tokens=True,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            # Unprintable bytes map to code points above 255, in byte order.
            table[b] = chr(256 + shift)
            shift += 1
    return table


def _chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    """The folder's chat template: chat_template.jinja (transformers' current layout), or
    tokenizer_config.json's "chat_template" (a string, or named templates: the "default" one)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _read_json_if_exists(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise LlmcError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise LlmcError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise LlmcError(f"{path} does not hold a JSON object")
    return data


def _id_list(config: dict[str, Any], path: Path) -> list[int]:
    """The `eos_token_id` entry of a config file as a list (it may be an int, a list or absent)."""
    value = config.get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise LlmcError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return values


def _special_id(
    inner: tokenizers.Tokenizer,
    tok_config: dict[str, Any],
    token_key: str,
    model_config: dict[str, Any],
    id_key: str,
    folder: Path,
) -> int | None:
    """Resolve a BOS/EOS id: the token text in tokenizer_config.json wins over config.json's id."""
    token = tok_config.get(token_key)
    if isinstance(token, dict):  # older files store an AddedToken dict
        token = token.get("content")
    if isinstance(token, str):
        token_id = inner.token_to_id(token)
        if token_id is None:
            raise LlmcError(f"{folder / 'tokenizer_config.json'}: {token_key} {token!r} is not in tokenizer.json")
        return token_id
    value = model_config.get(id_key)
    if isinstance(value, list):
        # Several stop ids (e.g. Llama 3); the first one is the primary EOS.
        value = value[0] if value else None
    if value is not None and not isinstance(value, int):
        raise LlmcError(f"{folder / 'config.json'}: {id_key} must be an int, got {value!r}")
    return value
