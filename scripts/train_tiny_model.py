"""Train the small Llama-style model that precision tests and benchmarks measure accuracy on.

Random weights make perplexity meaningless, so this trains a ~3.5M-parameter model on the Python
standard library's own sources, which every machine with Python has, with a byte-level BPE
tokenizer trained on the same text. Seeded and deterministic on one machine (CPU, fixed thread
count). It writes:

    data/pystdlib-llama/     Hugging Face checkpoint (config.json, model.safetensors in fp16,
                             tokenizer.json, tokenizer_config.json): `llmc export` reads it
    data/pystdlib-text/calib/calib.txt      calibration text (training files, not trained on
    data/pystdlib-text/heldout/heldout.txt  held-out text: files never trained on

    python scripts/train_tiny_model.py [--steps 600] [--out data]

Needs transformers (the `test` extra). The committed checkpoint is this script's output with
the defaults; it is under 10 MB, so tests never train.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

VOCAB = 2048
CONTEXT = 256
HELD_OUT_EVERY = 10  # every 10th stdlib file (sorted by path) is held out
TEXT_SAMPLE_CHARS = 120_000  # size of each committed text sample


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "idlelib", "lib2to3", "tkinter", "turtledemo", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts) & set(skip))


def read(files: list[Path]) -> str:
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


def train_tokenizer(text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([text], trainer)
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default="data")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    files = stdlib_files()
    train_files = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY]
    held_files = [f for i, f in enumerate(files) if not i % HELD_OUT_EVERY]
    train_text, held_text = read(train_files), read(held_files)
    print(f"stdlib: {len(train_files)} training files ({len(train_text) / 1e6:.1f} MB), "
          f"{len(held_files)} held out", file=sys.stderr)

    tokenizer = train_tokenizer(train_text)
    ids = torch.tensor(tokenizer.encode(train_text).ids, dtype=torch.long)
    print(f"tokenizer: {VOCAB} tokens, {len(ids) / 1e6:.2f}M training tokens", file=sys.stderr)

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps))))
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    model.train()
    for step in range(args.steps):
        offsets = torch.randint(0, len(ids) - CONTEXT - 1, (args.batch,), generator=generator)
        batch = torch.stack([ids[o:o + CONTEXT] for o in offsets])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}/{args.steps}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)",
                  file=sys.stderr)

    out = Path(args.out)
    folder = out / "pystdlib-llama"
    folder.mkdir(parents=True, exist_ok=True)
    model.eval().half().save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False}, indent=2) + "\n")
    for name, text in (("calib", train_text), ("heldout", held_text)):
        sample = out / "pystdlib-text" / name
        sample.mkdir(parents=True, exist_ok=True)
        (sample / f"{name}.txt").write_text(text[:TEXT_SAMPLE_CHARS], encoding="utf-8")
    print(f"wrote {folder} ({params / 1e6:.2f}M parameters, fp16) and {out / 'pystdlib-text'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
