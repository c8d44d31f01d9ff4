"""The Python API for running an engine: `LLM("engine.plan").generate(prompts, SamplingParams())`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from llmc.compiler.engine_file import read_engine
from llmc.errors import LlmcError
from llmc.plugins.paged_attention import PagedBatch
from llmc.tokenizer import Tokenizer
from llmc.runtime.backends.onnxruntime import OnnxRuntimeDecoder
from llmc.runtime.contiguous_generation import TokenEvent, generate_tokens
from llmc.runtime.backends.paged_onnxruntime import PagedDecoder
from llmc.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class Completion:
    """One finished request."""

    prompt: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str


@dataclass(frozen=True)
class StreamChunk:
    """A piece of a streamed completion: the new token and the text it completes."""

    token_id: int
    text: str
    finish_reason: str | None


class LLM:
    """An engine loaded for generation.

    Args:
        engine_path: a file written by `llmc compile`.
        threads: CPU threads for the backend; None uses every core.
    """

    def __init__(self, engine_path: str | os.PathLike, threads: int | None = None):
        self.path = Path(engine_path)
        engine = read_engine(engine_path)
        if engine.manifest.get("backend") != "onnxruntime":
            raise LlmcError(f"{engine_path}: backend '{engine.manifest.get('backend')}' cannot run "
                            "here; this build of llmc runs onnxruntime engines")
        self.manifest = engine.manifest
        self.tokenizer = Tokenizer.from_json(bytes(engine.sections["tokenizer.json"]).decode())
        paged = engine.manifest.get("paged")
        self._decoder = None if paged else OnnxRuntimeDecoder(engine, threads)
        self.paged_decoder = paged and PagedDecoder.from_engine(engine, threads)
        self.max_seq_len = paged["max_seq_len"] if paged else self._decoder.geometry.max_positions

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """[tokens, vocab] logits at every position of one sequence, computed from scratch
        (accuracy checks: perplexity, agreement with a reference)."""
        ids = np.asarray(token_ids, np.int64)
        if not 0 < len(ids) <= self.max_seq_len:
            raise LlmcError(f"logits: {len(ids)} tokens; this engine takes 1 to {self.max_seq_len}")
        positions = np.arange(len(ids))
        if self.paged_decoder:
            decoder = self.paged_decoder
            blocks = -(-len(ids) // decoder.block_size)
            batch = PagedBatch(np.arange(blocks)[None], np.zeros(1, np.int64), np.array([0, len(ids)]))
            # A fresh sequence in the pool's first blocks: only Engine hands out blocks, and it
            # is not running on this decoder while this call is.
            return decoder.step(ids, positions, batch, rows=positions)
        cache = self._decoder.empty_cache(1)
        logits, _ = self._decoder.step(ids[None], np.ones((1, len(ids)), np.int64), positions[None], cache)
        return logits[0]

    def generate(self, prompts: str | Sequence[str],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Complete every prompt; returns completions in prompt order.

        Args:
            prompts: one prompt or several, run together as one batch.
            params: one setting for all prompts, or one per prompt; defaults to greedy, 32 tokens.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            return []
        params = self._params_per_prompt(params, len(prompts))
        ids = [self.encode(p, i) for i, p in enumerate(prompts)]
        outputs: list[list[int]] = [[] for _ in prompts]
        reasons = [""] * len(prompts)
        for event in self._generate(ids, params):
            outputs[event.index].append(event.token_id)
            reasons[event.index] = event.finish_reason or ""
        return [Completion(prompt, self.tokenizer.decode(out), out, prompt_ids, reason)
                for prompt, out, prompt_ids, reason in zip(prompts, outputs, ids, reasons)]

    def stream(self, prompt: str, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Generate for one prompt, yielding each token with the text it completes.

        Text is held back while it ends inside a multi-byte character, so every chunk is valid.
        """
        params = self._params_per_prompt(params, 1)
        tokens: list[int] = []
        shown = ""
        for event in self._generate([self.encode(prompt, 0)], params):
            tokens.append(event.token_id)
            text = self.tokenizer.decode(tokens)
            if text.endswith("\ufffd") and event.finish_reason is None:
                yield StreamChunk(event.token_id, "", None)
                continue
            yield StreamChunk(event.token_id, text[len(shown):], event.finish_reason)
            shown = text

    def encode(self, prompt: str, index: int = 0) -> list[int]:
        """Tokenize a prompt, checking it fits the model; `index` names it in errors."""
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise LlmcError(f"prompt {index}: empty after tokenization")
        if len(ids) >= self.max_seq_len:
            raise LlmcError(f"prompt {index}: {len(ids)} tokens leave no room in the engine's "
                            f"{self.max_seq_len} positions")
        return ids

    def _generate(self, ids: list[list[int]], params: list[SamplingParams]) -> Iterator[TokenEvent]:
        """Token events from the continuous-batching engine (paged engines) or the dense loop."""
        if not self.paged_decoder:
            yield from generate_tokens(self._decoder, ids, params, self.tokenizer.eos_ids)
            return
        from llmc.runtime.engine import Engine

        engine = Engine(self)
        index = {engine.add_request(prompt, p): i for i, (prompt, p) in enumerate(zip(ids, params))}
        while engine.has_unfinished():
            for output in engine.step():
                yield TokenEvent(index[output.request_id], output.new_token_ids[0], output.finish_reason)

    @staticmethod
    def _params_per_prompt(params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise LlmcError(f"got {len(params)} sampling settings for {count} prompts")
        return list(params)
