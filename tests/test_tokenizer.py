"""The Tokenizer wrapper and the built-in byte-level tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers

from llmc.errors import LlmcError
from llmc.models import Tokenizer, byte_level_tokenizer

TEXTS = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\r\n",
    "héllo wörld, ça va? 日本語のテキスト 🎉👩‍👩‍👧",
    "literal specials <s> and </s> stay text",
    "\x00\x01\x7f control bytes",
]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip(text: str) -> None:
    tok = byte_level_tokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert len(ids) == 1 + len(text.encode("utf-8"))  # one token per byte, after BOS
    assert tok.decode(ids) == text


def test_byte_level_layout() -> None:
    tok = byte_level_tokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    assert tok.encode("A")[1:] == [ord("A")]  # id == byte value
    assert tok.decode([65, 257, 256, 66]) == "AB"  # special tokens are skipped


def test_json_round_trip_keeps_everything() -> None:
    tok = byte_level_tokenizer()
    again = Tokenizer.from_json(tok.to_json())
    assert (again.bos_id, again.eos_id, again.add_bos, again.split_special_tokens) == (256, 257, True, True)
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
        assert again.decode(again.encode(text)) == text
    json.loads(tok.to_json())  # a plain JSON string, embeddable as-is


def test_from_json_rejects_garbage() -> None:
    with pytest.raises(LlmcError, match="not valid JSON"):
        Tokenizer.from_json("{nope")
    with pytest.raises(LlmcError, match="format"):
        Tokenizer.from_json(json.dumps({"tokenizer": {}}))


def test_save_and_from_folder(tmp_path: Path) -> None:
    byte_level_tokenizer().save(tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (256, 257, True, 258)
    assert tok.decode(tok.encode(TEXTS[4])) == TEXTS[4]


def test_from_folder_reads_ids_from_config_json(tmp_path: Path) -> None:
    # No tokenizer_config.json: ids come from config.json; a list of eos ids gives the first.
    byte_level_tokenizer().inner.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": [257, 10]}))
    tok = Tokenizer.from_folder(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.eos_ids) == (256, 257, (257, 10))
    assert not tok.add_bos  # neither the config nor the post-processor asks for BOS
    assert tok.encode("hi") == [104, 105]


def test_from_folder_detects_bos_added_by_post_processor(tmp_path: Path) -> None:
    inner = byte_level_tokenizer().inner
    inner.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    inner.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.add_bos and tok.encode("a") == [256, 97]  # BOS once, not twice


def test_from_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(LlmcError, match=f"no tokenizer.json in {tmp_path}"):
        Tokenizer.from_folder(tmp_path)
    byte_level_tokenizer().save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    with pytest.raises(LlmcError, match="tokenizer_config.json.*'<bos>'"):
        Tokenizer.from_folder(tmp_path)


def test_eos_ids_come_from_config_and_generation_config(tmp_path: Path) -> None:
    byte_level_tokenizer().save(tmp_path)  # tokenizer_config.json names </s> (257) as eos_token
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [257, 10]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [10, 33]}))
    tok = Tokenizer.from_folder(tmp_path)
    assert (tok.eos_id, tok.eos_ids) == (257, (257, 10, 33))  # primary first, no repeats
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_folder(tmp_path).eos_ids == (257, 10, 5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(LlmcError, match="generation_config.json: eos_token_id must be an int or a list"):
        Tokenizer.from_folder(tmp_path)


def test_eos_ids_survive_json() -> None:
    tok = byte_level_tokenizer()
    several = Tokenizer(tok.inner, bos_id=256, eos_id=257, eos_ids=(257, 10))
    assert Tokenizer.from_json(several.to_json()).eos_ids == (257, 10)
    with pytest.raises(LlmcError, match="eos_ids=300 is outside the vocabulary"):
        Tokenizer(tok.inner, eos_id=257, eos_ids=(300,))


def test_every_eos_id_of_a_folder_is_kept_through_json_and_save(tmp_path: Path) -> None:
    # As Llama 3 ships: tokenizer_config.json names one EOS token, config.json holds one id and
    # generation_config.json lists several.
    byte_level_tokenizer().save(tmp_path / "src")  # eos_token </s> = 257
    (tmp_path / "src" / "config.json").write_text(json.dumps({"eos_token_id": 40}))
    (tmp_path / "src" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [41, 257, 42], "temperature": 0.6}))
    tok = Tokenizer.from_folder(tmp_path / "src")
    assert (tok.eos_id, tok.eos_ids) == (257, (257, 40, 41, 42))
    again = Tokenizer.from_json(tok.to_json())
    assert (again.eos_id, again.eos_ids) == (257, (257, 40, 41, 42))
    tok.save(tmp_path / "copy")  # no config.json there: generation_config.json carries them all
    assert Tokenizer.from_folder(tmp_path / "copy").eos_ids == (257, 40, 41, 42)
    tok.save(tmp_path / "src")  # an existing generation_config.json keeps its other settings
    assert json.loads((tmp_path / "src" / "generation_config.json").read_text()) == {
        "eos_token_id": [257, 40, 41, 42], "temperature": 0.6}
    byte_level_tokenizer().save(tmp_path / "one")  # a single EOS writes no generation_config.json
    assert not (tmp_path / "one" / "generation_config.json").exists()


def test_bad_files_and_json_are_user_errors_naming_their_source(tmp_path: Path) -> None:
    byte_level_tokenizer().save(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff{}")
    with pytest.raises(LlmcError, match="config.json is not UTF-8 text"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(LlmcError, match="config.json does not hold a JSON object"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 999}))
    with pytest.raises(LlmcError, match=f"{tmp_path}: tokenizer eos_ids=999 is outside the vocabulary"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(LlmcError, match="tokenizer.json could not be read"):
        Tokenizer.from_folder(tmp_path)
    good = json.loads(byte_level_tokenizer().to_json())
    with pytest.raises(LlmcError, match="^engine.plan: tokenizer JSON is not valid JSON"):
        Tokenizer.from_json("{", source="engine.plan")
    with pytest.raises(LlmcError, match="^engine.plan: the tokenizer could not be read"):
        Tokenizer.from_json(json.dumps({**good, "tokenizer_json": "{}"}), source="engine.plan")
    for key in json.loads(byte_level_tokenizer().to_json()):  # every key to_json writes is read back
        if key != "format":
            with pytest.raises(LlmcError, match=f"^engine.plan: tokenizer JSON has no '{key}'$"):
                Tokenizer.from_json(json.dumps({k: v for k, v in good.items() if k != key}), source="engine.plan")
    with pytest.raises(LlmcError, match="^engine.plan: tokenizer JSON's 'tokenizer_json' is not a string$"):
        Tokenizer.from_json(json.dumps({**good, "tokenizer_json": {}}), source="engine.plan")
    with pytest.raises(LlmcError, match="^tokenizer JSON: "):
        Tokenizer.from_json(json.dumps({**good, "eos_ids": 7}))


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("layout", ["jinja file", "tokenizer_config string", "tokenizer_config named"])
def test_chat_template_renders_as_transformers_does(tmp_path: Path, layout: str) -> None:
    import transformers

    byte_level_tokenizer().save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if layout == "jinja file":
        (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    else:
        config["chat_template"] = CHAT_TEMPLATE if layout == "tokenizer_config string" else [
            {"name": "tool_use", "template": "unused"}, {"name": "default", "template": CHAT_TEMPLATE}]
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(MESSAGES) == reference == "<s><|system|>Be brief.</s>\n<|user|>Hi</s>\n<|assistant|>"
    assert Tokenizer.from_json(tok.to_json()).apply_chat_template(MESSAGES) == reference  # kept in engines
    tok.save(tmp_path / "saved")
    assert Tokenizer.from_folder(tmp_path / "saved").chat_template == CHAT_TEMPLATE


def test_no_chat_template_and_template_errors_are_user_errors() -> None:
    with pytest.raises(LlmcError, match="no chat template"):
        byte_level_tokenizer().apply_chat_template(MESSAGES)
    tok = Tokenizer.from_json(byte_level_tokenizer().to_json())
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(LlmcError, match="chat template: roles must alternate"):
        tok.apply_chat_template(MESSAGES)
