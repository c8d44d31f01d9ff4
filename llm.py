"""The Python API for running an engine: `LLM("engine.plan").generate(prompts, SamplingParams())`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from llmc.errors import LlmcError
from llmc.formats.engine_file import SectionCheck
from llmc.runtime.backends.onnxruntime import OnnxRuntimeDecoder
from llmc.runtime.contiguous_generation import generate_tokens
from llmc.runtime.detokenizer import IncrementalText
from llmc.runtime.engine import Engine, RequestOutput, encode_prompt, load_engine_file, load_tokenizer
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import SchedulerConfig


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
    """An engine loaded for generation: a synchronous driver of one `Engine` (paged engines) or of
    the contiguous reference loop (engines compiled with --no-paged).

    Args:
        engine_path: a file written by `llmc compile`.
        threads: CPU threads for the backend; None uses every core.
        config: scheduling limits of a paged engine; what it leaves None is the engine's (`Engine`).
        kv_pool_mb: a paged engine's KV pool in MiB; None: the compiled size or the default rule
            (see `Engine`).
        speculative_tokens: a paged engine's prompt-lookup guesses per step (see `Engine`).
        decode_model: OpenVINO engines: decode steps on a second model where the CPU and memory
            allow it; False: one model, less memory (see `Engine`).
    """

    def __init__(self, engine_path: str | os.PathLike, threads: int | None = None,
                 config: SchedulerConfig | None = None, kv_pool_mb: float | None = None,
                 speculative_tokens: int | None = None, decode_model: bool = True):
        engine = load_engine_file(engine_path, verify=False)
        self.path, self.manifest = engine.path, engine.manifest
        self.section_check = SectionCheck(engine)
        with self.section_check.graphs_checked():  # in a thread while the sessions are built
            if engine.manifest.paged is not None:
                self.engine: Engine | None = Engine(engine, config, threads, kv_pool_mb,
                                                    section_check=self.section_check,
                                                    speculative_tokens=speculative_tokens,
                                                    decode_model=decode_model)
                self.tokenizer, self.max_seq_len = self.engine.tokenizer, self.engine.max_seq_len
                self._contiguous = None
            else:
                self.engine = None
                self.tokenizer = load_tokenizer(engine)
                self._contiguous = OnnxRuntimeDecoder(engine, threads)
                self.max_seq_len = self.manifest.geometry.max_positions

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """[tokens, vocab] logits at every position of one sequence, computed from scratch
        (accuracy checks: perplexity, agreement with a reference)."""
        if self.engine is not None:
            return self.engine.logits(token_ids)
        self.section_check.raise_if_failed()
        ids = np.asarray(token_ids, np.int64)
        if not 0 < len(ids) <= self.max_seq_len:
            raise LlmcError(f"logits: {len(ids)} tokens; this engine takes 1 to {self.max_seq_len}")
        positions = np.arange(len(ids))
        cache = self._contiguous.empty_cache(1)
        logits, _ = self._contiguous.step(ids[None], np.ones((1, len(ids)), np.int64), positions[None], cache)
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
        tokens: list[list[int]] = [[] for _ in prompts]
        texts = [""] * len(prompts)
        reasons = [""] * len(prompts)
        for index, output in self._outputs(ids, params):
            tokens[index] += output.new_token_ids
            texts[index] += output.text
            reasons[index] = output.finish_reason or ""
        return [Completion(*fields) for fields in zip(prompts, texts, tokens, ids, reasons)]

    def stream(self, prompt: str, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Generate for one prompt, yielding each token with the text it completes.

        Text is held back while it may end inside a multi-byte character or a stop string, so every
        chunk is valid and no chunk shows text a stop string later removes.
        """
        params = self._params_per_prompt(params, 1)
        for _, output in self._outputs([self.encode(prompt, 0)], params):
            yield StreamChunk(output.new_token_ids[0] if output.new_token_ids else -1, output.text,
                              output.finish_reason)

    def encode(self, prompt: str, index: int = 0) -> list[int]:
        """Tokenize a prompt, checking it fits the model; `index` names it in errors."""
        return encode_prompt(self.tokenizer, prompt, self.max_seq_len, self.manifest.geometry.vocab_size, index)

    def _outputs(self, ids: list[list[int]], params: list[SamplingParams]) -> Iterator[tuple[int, RequestOutput]]:
        """(prompt index, output) until every prompt is finished; raises the error a request
        failed with. Leaving early aborts the requests still running."""
        if self.engine is None:
            yield from self._contiguous_outputs(ids, params)
            return
        engine = self.engine
        index = {engine.add(engine.request(prompt, p)): i for i, (prompt, p) in enumerate(zip(ids, params))}
        unfinished = set(index)
        try:
            while unfinished:
                for output in engine.step():
                    if output.error is not None:
                        raise output.error
                    if output.finished:
                        unfinished.discard(output.request_id)
                    yield index[output.request_id], output
        finally:
            for request_id in unfinished:
                engine.abort(request_id)

    def _contiguous_outputs(self, ids: list[list[int]], params: list[SamplingParams]) -> Iterator[tuple[int, RequestOutput]]:
        texts = [IncrementalText(self.tokenizer, prompt, p.stop) for prompt, p in zip(ids, params)]
        stopped: set[int] = set()
        for event in generate_tokens(self._contiguous, ids, params, self.tokenizer.eos_ids):
            self.section_check.raise_if_failed()
            if event.index in stopped:
                continue  # a stop string ended it; the batch loop does not know stop strings
            text = texts[event.index]
            delta, hit = text.add(event.token_id)
            reason = "stop" if hit else event.finish_reason
            if reason is not None:
                stopped.add(event.index)
                delta += "" if hit else text.flush()
            yield event.index, RequestOutput(str(event.index), [event.token_id], delta, reason is not None, reason)
            if len(stopped) == len(ids):
                return

    @staticmethod
    def _params_per_prompt(params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise LlmcError(f"got {len(params)} sampling settings for {count} prompts")
        return list(params)
