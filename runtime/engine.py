"""The serving engine: one object that owns everything a paged engine file needs to serve.

`Engine` is built from an engine file and owns, for its lifetime, the tokenizer, the backend (its
sessions or TensorRT engine), the KV cache (pool and block manager) and the scheduler. Nothing else writes
the pool or hands out its blocks: `LLM` (llm.py) and `AsyncEngine` (async_engine.py) are thin
drivers of one `Engine`, so the prefix cache and the warmed-up sessions last across their calls.

`step()` is schedule → plan → execute → postprocess. Requests join and leave the running batch at
every step (continuous batching). The plan (runtime/step_plan.py) adds guesses, packs the
scheduled chunks and picks the backend's path, as a value logged at debug level; execute applies
the block copies the block manager asked for and hands the plan to the backend
(runtime/backends/base.py: one contract, the backend found by the engine file's name in
runtime/backends/registry.py), which stores the step's new keys and values in the pool; postprocess samples for every request whose prompt (or last token) is now fully
computed, turns tokens into text incrementally, applies stop conditions and releases finished
requests' blocks. A step that raises fails the requests it held (their outputs carry the error)
and frees their blocks; the engine keeps serving the others. A greedy request's decode may
carry guesses of its next tokens (runtime/prompt_lookup.py): postprocess keeps those greedy
decoding picks, one output per token, and gives back the slots of the rest.

Not thread-safe: one thread at a time may call it (AsyncEngine queues adds and aborts to the
thread that steps).
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llmc.errors import LlmcError
from llmc.formats.engine_file import EngineFile, SectionCheck, read_engine
from llmc.formats.manifest import linears_in_fp32
from llmc.plugins.paged_attention import PagedBatch
from llmc.runtime.backends.base import Backend, BackendOptions
from llmc.runtime.backends.registry import entry_for, open_backend
from llmc.runtime.contiguous_generation import finish_reason
from llmc.runtime.detokenizer import IncrementalText
from llmc.runtime.logprobs import TokenLogprob, token_logprobs
from llmc.runtime.prompt_lookup import PromptLookup
from llmc.runtime.sampler import is_argmax, sample
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.scheduler import Chunk, Request, Scheduler, SchedulerConfig
from llmc.runtime.step_plan import StepPlan, StepPlanner, packed_plan
from llmc.runtime.timeline import OFF
from llmc.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Guesses a step may add (`Engine`'s speculative_tokens). On 12 real-text prompts to SmolLM2-135M
# fp32, the decode rate against one token a step: up to 2 guesses 1.40×, 4 1.61×, 6 1.45×, 8 1.44×
# (more guesses kept, but more dropped and dearer steps); bench/latency_bench.py measures the default.
SPECULATIVE_TOKENS = 4


def default_speculative_tokens(manifest) -> int:
    """SPECULATIVE_TOKENS for an engine whose linear layers compute in fp32, else 0 (guessing is
    then the user's choice).

    fp32 linear layers give each token of a step of several the logits a step of one would, to
    float rounding (SmolLM2-135M: 5e-5), and read their weights once for all its rows: a guess
    costs a step little. A weight-only int4/int8 engine's MatMulNBits quantize each row's input
    to int8 (accuracy_level 4), which turns any change of rounding into different codes now and
    then (SmolLM2-135M int4: 0.7 on average in the logits, against 8.9 from fp32), so its guesses
    are exact only with the lone token of a request that may guess given the padding row, and
    only where the backend's check passes (`steps_round_alike`). And on x86-64 those kernels
    compute row by row: on a Xeon without AMX, SmolLM2-135M int4, a padded step took 1.37x a lone
    token's and a step of 4 guesses 2.5x; guessing, its 12 chat answers decoded about as fast as
    one token a step, the 6 not about source code 0.8x as fast. Text that repeats itself (code
    edits, quotes, loops) repays it: there `--speculative-tokens 4` is worth asking for."""
    return SPECULATIVE_TOKENS if linears_in_fp32(manifest) else 0


@dataclass(frozen=True)
class RequestOutput:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    text: str  # the new text (held back while it may end inside a character or a stop string)
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    error: BaseException | None = None  # why the request failed, with finish_reason "error"
    # With SamplingParams.logprobs: one per new token. With prompt_logprobs: every prompt token's
    # (None for the first), on the output of the first new token.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def load_engine_file(path: str | os.PathLike | EngineFile, verify: bool = True) -> EngineFile:
    """Read an engine file this build can run (runtime/backends/registry.py); `verify=False` leaves
    the sections' checksums to the caller (formats/engine_file.py, `SectionCheck`)."""
    engine = path if isinstance(path, EngineFile) else read_engine(path, verify=verify)
    entry_for(engine)
    return engine


def load_tokenizer(engine: EngineFile) -> Tokenizer:
    where = f"{engine.path}: section 'tokenizer.json'"
    if "tokenizer.json" not in engine.sections:
        raise LlmcError(f"{where} is missing")
    try:
        text = bytes(engine.sections["tokenizer.json"]).decode()
    except UnicodeDecodeError:
        raise LlmcError(f"{where}: not UTF-8 text") from None
    return Tokenizer.from_json(text, where)


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int], max_seq_len: int, vocab_size: int,
                  name: object) -> list[int]:
    """A prompt's token ids (text, or ids below the model's `vocab_size`), checked to leave room for
    output; `name` names it in errors."""
    if isinstance(prompt, str):
        if not prompt:
            raise LlmcError(f"prompt {name}: empty")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:  # a lone surrogate: bytes that were not UTF-8
            raise LlmcError(f"prompt {name}: not valid text (character {error.start + 1} is not "
                            "Unicode; was the input UTF-8?)") from None
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
        if any(not 0 <= t < vocab_size for t in ids):
            raise LlmcError(f"prompt {name}: a token id is outside the model's vocabulary of {vocab_size}")
    if not ids:
        raise LlmcError(f"prompt {name}: empty after tokenization")
    if len(ids) >= max_seq_len:
        raise LlmcError(f"prompt {name}: {len(ids)} tokens leave no room in the engine's {max_seq_len} positions")
    return ids


class Engine:
    """Continuous batching over a paged engine file; owns its backend, KV cache and scheduler.

    Args:
        engine: the engine file (a path, or one already read: its checksums are then the
            reader's to verify, or `section_check`'s).
        config: scheduling limits; each it leaves None (all, where it is None) is the engine's:
            its max batch, the backend's step size (`StepPaths.step_tokens`: 512 tokens, 2,048 on
            OpenVINO), and `concurrent`'s choice for a lone prompt.
        threads: CPU threads for the backend; None uses every core.
        kv_pool_mb: KV pool size in MiB; None: the compiled size or the default rule
            (runtime/kv_cache.py, `pool_blocks`).
        section_check: the checksums of an engine read by the caller, still being verified: a
            mismatch fails the steps after it is found.
        single_sequence: run steps that hold one sequence, or only decodes, on the engine's
            single-sequence graph (runtime/backends/whole_graph.py), when it has one; False:
            every step packed (the CPU backend only).
        concurrent: requests are expected to overlap (a server, a throughput benchmark): what a
            step of several sequences needs is built at load, not by the first such step (see
            `BackendOptions`), and by default a lone prompt's steps stay as short as beside
            others (`SchedulerConfig.lone_prompt_uses_budget`).
        speculative_tokens: tokens a step may guess ahead for a greedy request (prompt-lookup
            decoding, runtime/prompt_lookup.py; beside other requests, only guesses likely to be
            kept); the step keeps those greedy decoding picks anyway. 0 turns it off; None:
            `default_speculative_tokens`.
        timeline: records where each step's time goes (runtime/timeline.py; `llmc profile`);
            None records nothing.
        decode_model: OpenVINO backend: decode steps on a second model where the CPU and memory
            allow it (`BackendOptions.decode_model`); False: one model, less memory, a faster load.
    """

    def __init__(self, engine: str | os.PathLike | EngineFile, config: SchedulerConfig | None = None,
                 threads: int | None = None, kv_pool_mb: float | None = None, *,
                 section_check: SectionCheck | None = None, single_sequence: bool = True,
                 concurrent: bool = False, speculative_tokens: int | None = None, timeline=None,
                 decode_model: bool = True):
        if speculative_tokens is not None and (not isinstance(speculative_tokens, int) or speculative_tokens < 0):
            raise LlmcError(f"--speculative-tokens: must be an integer ≥ 0, got {speculative_tokens!r}")
        self.section_check = section_check
        self.timeline = timeline or OFF
        options = BackendOptions(threads, single_sequence, concurrent, self.timeline, decode_model)
        if isinstance(engine, EngineFile):
            self._load(engine, options, kv_pool_mb)
        else:
            engine = load_engine_file(engine, verify=False)
            self.section_check = SectionCheck(engine)
            with self.section_check.graphs_checked():  # in a thread while the sessions are built
                self._load(engine, options, kv_pool_mb)
        paged = engine.manifest.paged
        self.config = (config or SchedulerConfig()).filled(paged.max_batch, self.backend.paths.step_tokens,
                                                           lone_prompt_uses_budget=not concurrent)
        self.scheduler = Scheduler(self.config, self.kv.blocks)
        self.max_seq_len = paged.max_seq_len
        self.backend.warm_up()  # the first calls of each path, not a step of largest size
        self._ids = itertools.count()
        self._texts: dict[str, IncrementalText] = {}
        self._utilization_sum, self._steps = 0.0, 0
        fp32 = linears_in_fp32(self.manifest)
        guesses = default_speculative_tokens(self.manifest) if speculative_tokens is None else speculative_tokens
        if guesses and not fp32 and not self.backend.steps_round_alike():
            log.warning("%s: here this engine's logits may change with how guesses cut a request's steps: "
                        "greedy outputs may differ from one token a step's", self.path)
        # Beside other requests a step with a guess runs packed, whose attention rounds unlike the
        # whole graph's: exact enough for fp32 linear layers only.
        self.planner = StepPlanner(self.backend.paths, guesses, fp32, self.scheduler,
                                   self._budget)
        self._lookups: dict[str, PromptLookup] = {}  # requests that may speculate
        self._drafted = self._accepted = 0

    def _load(self, engine: EngineFile, options: BackendOptions, kv_pool_mb: float | None) -> None:
        if engine.manifest.paged is None:
            raise LlmcError(f"{engine.path}: not a paged engine ({engine.manifest.not_paged}); Engine needs one")
        self.path, self.manifest = engine.path, engine.manifest
        self.tokenizer = load_tokenizer(engine)
        self.backend: Backend
        self.backend, self.kv = open_backend(engine, options, kv_pool_mb)

    @property
    def speculative_tokens(self) -> int:
        """The most tokens a greedy request guesses ahead (the planner's; 0: none)."""
        return self.planner.speculative_tokens

    @speculative_tokens.setter
    def speculative_tokens(self, tokens: int) -> None:
        self.planner.speculative_tokens = tokens

    @property
    def blocks(self):
        """The KV cache's block manager."""
        return self.kv.blocks

    def request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                priority: int = 0, request_id: str | None = None) -> Request:
        """A checked request, not yet queued (see `add`); raises LlmcError if it could never run.
        Touches no engine state but the id counter, so any thread may call it."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        ids = encode_prompt(self.tokenizer, prompt, self.max_seq_len, self.manifest.geometry.vocab_size, request_id)
        longest = min(len(ids) + params.max_new_tokens, self.max_seq_len)
        needed = -(-longest // self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            raise LlmcError(f"request {request_id}: needs {needed} KV blocks, the pool has "
                            f"{self.blocks.num_blocks} (KV pool too small)")
        return Request(request_id, ids, params, priority)

    def add(self, request: Request) -> str:
        """Queue a request made by `request`."""
        if request.request_id in self._texts:
            raise LlmcError(f"request {request.request_id}: this id is already in use")
        self._texts[request.request_id] = IncrementalText(self.tokenizer, request.prompt_ids, request.params.stop)
        if self.speculative_tokens and is_argmax(request.params):
            self._lookups[request.request_id] = PromptLookup(request.token_ids)
        self.scheduler.add(request)
        return request.request_id

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    priority: int = 0, request_id: str | None = None) -> str:
        """Check and queue a request; returns its id."""
        return self.add(self.request(prompt, params, priority=priority, request_id=request_id))

    def abort(self, request_id: str) -> bool:
        """Cancel a request; returns whether it was still pending."""
        self._texts.pop(request_id, None)
        self._lookups.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        timeline = self.timeline
        with timeline.span("step") as step:
            with timeline.span("schedule"):
                chunks = self.scheduler.schedule()
            if not chunks:
                return []
            with timeline.span("plan"):
                plan = self.planner.plan(chunks, self._lookups)
            if timeline.enabled:
                step.update(kind=plan.kind, path=plan.path, tokens=len(plan.tokens), seqs=plan.num_seqs,
                            context=int(np.sum(plan.batch.context_lens)) + len(plan.tokens),
                            attended=plan.attended_positions(), rows=len(plan.rows))
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s", plan)
            try:
                with timeline.span("execute"):
                    logits = self._execute(plan)
            except Exception as error:  # the requests of this step fail; the others keep running
                return [self._fail(chunk.request, error) for chunk in plan.chunks]
            with timeline.span("postprocess"):
                return self._postprocess(plan, logits)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """[tokens, vocab] logits at every position of one sequence, computed from scratch in
        blocks the block manager lends for the call (accuracy checks: perplexity, agreement)."""
        if self.section_check is not None:
            self.section_check.raise_if_failed()
        ids = np.asarray(token_ids, np.int64)
        if not 0 < len(ids) <= self.max_seq_len:
            raise LlmcError(f"logits: {len(ids)} tokens; this engine takes 1 to {self.max_seq_len}")
        sequence = ("logits", next(self._ids))
        if not self.blocks.can_allocate(sequence, ids.tolist(), use_cache=False):
            raise LlmcError(f"logits: {len(ids)} tokens need more KV blocks than are free now")
        self.blocks.allocate(sequence, ids.tolist(), use_cache=False)
        try:
            table = np.array([self.blocks.block_table(sequence)], np.int64)
            positions = np.arange(len(ids))
            batch = PagedBatch(table, np.zeros(1, np.int64), np.array([0, len(ids)]))
            return self.backend.run(packed_plan(self.backend.paths, ids, positions, batch, positions))
        finally:
            self.blocks.free(sequence)

    @property
    def stats(self) -> dict:
        return {"kv_utilization": self._utilization_sum / self._steps if self._steps else 0.0,
                "prefix_hit_rate": self.blocks.stats.prefix_hit_rate,
                "preemptions": self.scheduler.preemptions,
                "speculative_tokens": self._drafted, "speculative_tokens_kept": self._accepted}

    def _execute(self, plan: StepPlan) -> np.ndarray:
        if self.section_check is not None:
            self.section_check.raise_if_failed()  # corrupted weights: no step may run
        self.kv.copy_blocks(plan.copies)
        self._utilization_sum += self.blocks.utilization
        self._steps += 1
        return self.backend.run(plan)

    def _postprocess(self, plan: StepPlan, logits: np.ndarray) -> list[RequestOutput]:
        outputs = []
        best = None  # every row's largest logit, found once for the requests that take it
        end = 0  # past the chunk's last logits row
        for index, (chunk, rows) in enumerate(zip(plan.chunks, plan.chunk_rows)):
            request = chunk.request
            end += rows
            row = end - 1  # the logits row of the chunk's last token
            try:
                if chunk.draft:
                    with self.timeline.span("sample"):
                        best = logits.argmax(axis=1) if best is None else best
                    outputs += self._verify(index, chunk, best[row - len(chunk.draft):row + 1].tolist(),
                                            logits[row - len(chunk.draft):row + 1])
                    continue
                if rows > 1:
                    self._add_prompt_logprobs(request, chunk.start, logits[end - rows:end])
                request.num_computed += chunk.count
                self.blocks.mark_computed(request.request_id, request.num_computed)
                if request.num_computed < len(request.token_ids):
                    continue  # a prefill chunk short of the prompt's end: no token yet
                with self.timeline.span("sample"):
                    if is_argmax(request.params):
                        best = logits.argmax(axis=1) if best is None else best
                        token = int(best[row])
                    else:
                        token = sample(logits[row], request.params, request.rng, request.prompt_ids,
                                       request.output_ids)
                request.add_output(token)
                outputs.append(self._emit(request, token, logits[row]))
            except Exception as error:  # this request fails alone
                outputs.append(self._fail(request, error))
        return outputs

    @staticmethod
    def _add_prompt_logprobs(request: Request, start: int, logits: np.ndarray) -> None:
        """Record the prompt tokens' log-probabilities that the logits of a chunk's every token
        (from position `start`) give and that are not recorded yet (a preempted request
        computes its prompt again)."""
        found = request.prompt_logprobs
        first, stop = len(found), min(start + len(logits) + 1, len(request.prompt_ids))
        if first < stop:  # the logits at position p are those of the token at p + 1
            found += token_logprobs(logits[first - 1 - start:stop - 1 - start], request.prompt_ids[first:stop],
                                    request.params.prompt_logprobs)

    def _verify(self, index: int, chunk: Chunk, picks: list[int], logits: np.ndarray) -> list[RequestOutput]:
        """Keep the guesses greedy decoding picked (`picks`: its token after each of the chunk's
        tokens, from those tokens' `logits`) and the token it picked after the last of them; the
        rest of the step's keys and values, and their blocks, are dropped. One output per token,
        up to a stop."""
        request, draft = chunk.request, chunk.draft
        kept = 0
        while kept < len(draft) and draft[kept] == picks[kept]:
            kept += 1
        self._drafted += len(draft)
        self._accepted += kept
        self._lookups[request.request_id].record(len(draft), kept)
        request.num_computed = chunk.start + 1 + kept
        self.blocks.truncate(request.request_id, request.num_computed)
        self.kv.keep(index, request.num_computed)
        self.blocks.mark_computed(request.request_id, request.num_computed)
        outputs = []
        for token, row in zip(picks[:kept + 1], logits):
            request.add_output(token)
            outputs.append(self._emit(request, token, row))
            if outputs[-1].finished:
                break
        return outputs

    def _budget(self, request: Request) -> int:
        """The most tokens the request may generate: its own limit, or what positions allow."""
        return min(request.params.max_new_tokens, self.max_seq_len - len(request.prompt_ids))

    def _emit(self, request: Request, token: int, logits: np.ndarray) -> RequestOutput:
        """The output of `token`, just generated from `logits` (its position's)."""
        text = self._texts[request.request_id]
        with self.timeline.span("detokenize"):
            delta, stopped = text.add(token)
        reason = "stop" if stopped else finish_reason(token, len(request.output_ids), self._budget(request),
                                                      request.params, self.tokenizer.eos_ids)
        if reason is not None:
            if not stopped:
                delta += text.flush()
            del self._texts[request.request_id]
            self._lookups.pop(request.request_id, None)
            self.scheduler.finish(request, reason)
        top = request.params.logprobs
        return RequestOutput(request.request_id, [token], delta, reason is not None, reason,
                             logprobs=None if top is None else token_logprobs(logits[None], [token], top),
                             prompt_logprobs=request.prompt_logprobs if len(request.output_ids) == 1 else None)

    def _fail(self, request: Request, error: BaseException) -> RequestOutput:
        self.abort(request.request_id)
        request.finish_reason = "error"
        return RequestOutput(request.request_id, [], "", True, "error", error)
