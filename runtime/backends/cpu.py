"""The CPU backend: a paged engine's steps in onnxruntime, on the whole graph or on the segments.

The engine holds its graph cut at each ``llmc::PagedAttention`` node into segments
(compiler/segments.py), which onnxruntime cannot run whole: a packed step runs segment (an
onnxruntime session), attention (plugins/paged_attention_cpu.py, reading the pool in place),
segment, … and carries the values that cross a cut; the step's new keys and values are stored at
the slots the sequences own afterwards, one vectorized scatter per layer per step, never a copy of
the pool. A step the plan sends to the whole graph (runtime/step_plan.py) runs the engine's
single-sequence graph instead (runtime/backends/whole_graph.py), on the KV cache's rows.

Each path's sessions are built when it first runs a step (the whole graph's at load): a process
that never mixes a prompt with other sequences never builds the segments, nor loads the kernel,
and holds its weights once.
"""

from __future__ import annotations

import numpy as np

from llmc.errors import LlmcError
from llmc.formats.engine_file import EngineFile, FileRange
from llmc.formats.manifest import PADDING_ROW
from llmc.formats.sessions import open_session, session_options
from llmc.plugins.paged_attention import PagedBatch
from llmc.plugins.paged_attention_cpu import DENSE_MIN_TOKENS, CpuPagedAttention
from llmc.runtime.backends.base import BackendOptions, PoolPlacement
from llmc.runtime.backends.onnxruntime import drop_file_pages, release_model_bytes
from llmc.runtime.backends.whole_graph import WholeGraph
from llmc.runtime.kv_cache import KvCache
from llmc.runtime.step_plan import PACKED, WHOLE_GRAPH, StepPaths, StepPlan
from llmc.runtime.timeline import KERNEL, ONNXRUNTIME


class CpuBackend:
    """The sessions and the attention kernel that read and write an engine's KV pool on the CPU.

    Args:
        engine: a paged onnxruntime engine file.
        options: threads; `single_sequence` runs the steps it can take on the whole graph, when
            the engine has one; `concurrent` builds the segments at load even then, and has the
            warm-up wait for the attention kernel (no step of several sequences waits for either,
            and the weights are held twice from the start).
    """

    placement = PoolPlacement()

    def __init__(self, engine: EngineFile, options: BackendOptions = BackendOptions()):
        manifest, paged = engine.manifest, engine.manifest.paged
        if paged is None:
            raise LlmcError(f"{engine.path}: not a paged engine ({manifest.not_paged})")
        self.geometry = manifest.geometry
        self.block_size, self.max_seq_len, self.max_batch = paged.block_size, paged.max_seq_len, paged.max_batch
        self.segments = paged.segments
        self.windows = tuple(s.attention.window for s in self.segments if s.attention is not None)
        self._engine, self._threads, self._kv_dtype = engine, options.threads, paged.kv_dtype
        self._options = session_options(options.threads)
        self.timeline = options.timeline
        self._attention: CpuPagedAttention | None = None
        self._sessions: list | None = None
        self._single = None
        if options.single_sequence and paged.single_sequence:
            self._single = self._open(paged.single_sequence)
            drop_file_pages(engine)  # as after the segments' sessions (see `_segmented`)
        self._kernel_at_load = options.concurrent
        if self._single is None or options.concurrent:
            self._segmented()
        pads = self._single is not None and self._single.get_modelmeta().custom_metadata_map.get(PADDING_ROW) == "1"
        self.paths = StepPaths(paged.max_batch if self._single is not None else 0, pads)
        self.whole: WholeGraph | None = None
        self.kv: KvCache | None = None

    def attach(self, kv: KvCache) -> None:
        self.kv, self.pools = kv, kv.layer_pools()
        if self._single is not None:
            rows = kv.mirror_rows(self.max_seq_len + self.paths.padding_row, self.max_batch, eager=any(self.windows))
            self.whole = WholeGraph(self._single, rows, self.paths.padding_row, self.timeline)

    def _open(self, section: str):
        """A session over one of the engine's graph sections, its weights mapped from the file."""
        engine = self._engine
        weights = engine.offsets.get("model.onnx.data")
        if self.timeline.enabled:
            self.timeline.session_options(self._options, section)
        session = open_session({"model.onnx": engine.sections[section],
                                **({"model.onnx.data": FileRange(engine.path, weights)} if weights is not None else {})},
                               self._options)
        # Each as soon as it is built: freed together, the segments' bytes would leave the
        # heap fragmented (measured +400 MB resident for SmolLM2-135M's 30 segments).
        release_model_bytes(session)
        if self.timeline.enabled:
            self.timeline.watch(session, section)
        return session

    def _segmented(self) -> tuple[CpuPagedAttention, list]:
        """The attention kernel and the segments' sessions, built on first use."""
        if self._sessions is None:
            engine, geometry = self._engine, self.geometry
            # First: it loads the attention kernel in a thread while the sessions are built.
            dense_models = {(s.attention.scale, s.attention.softcap): engine.sections[s.attention.dense]
                            for s in self.segments if s.attention is not None}
            self._attention = CpuPagedAttention(geometry.num_heads, geometry.num_kv_heads, geometry.head_dim,
                                                self.block_size, self._threads, self._kv_dtype, dense_models)
            self._sessions = [segment.section and self._open(segment.section) for segment in self.segments]
            # The sessions hold their weights now: the file's pages that building them read go
            # from this process's resident set (they stay in the page cache).
            drop_file_pages(engine)
        return self._attention, self._sessions

    def run(self, plan: StepPlan) -> np.ndarray:
        if plan.path == WHOLE_GRAPH:
            return self.whole.run(plan)
        with self.timeline.span("sync pool from rows", KERNEL):
            self.kv.synced()  # the segments read the pool
        attention, sessions = self._segmented()
        batch = plan.batch
        layout = attention.layout(batch, self.windows)
        values = {"input_ids": plan.tokens[None], "position_ids": plan.positions[None],
                  "logits_rows": np.asarray(plan.rows, np.int64), **self.pools}
        stores = []
        timeline = self.timeline
        for segment, session in zip(self.segments, sessions):
            if session is not None:
                with timeline.span(segment.section, ONNXRUNTIME):
                    outputs = session.run(segment.outputs, {name: values[name] for name in segment.inputs})
                values.update(zip(segment.outputs, outputs))
            call = segment.attention
            if call is not None:
                query, key, value, key_cache, value_cache = (values[name] for name in call.inputs[:5])
                # In the pool's type before attention reads them: a step sees its own keys and
                # values as every later step will, so outputs do not depend on how prompts are chunked.
                key, value = (np.ascontiguousarray(a, key_cache.dtype) for a in (key, value))
                with timeline.span("paged attention", KERNEL):
                    attended = attention(query, key, value, key_cache, value_cache, layout, call.scale,
                                         call.window, call.softcap)
                values[call.output] = attended.astype(query.dtype, copy=False)  # the kernel computes in fp32
                stores += [(key_cache, key), (value_cache, value)]
        blocks, offsets = batch.slots(self.block_size)
        self.kv.wrote(blocks)
        with timeline.span("store keys and values", KERNEL):
            for pool, new in stores:
                attention.store(pool, new, blocks, offsets)
        return values["logits"][0]

    def steps_round_alike(self) -> bool:
        return self.whole is not None and self.whole.steps_round_alike()

    def warm_up(self, tokens: int = DENSE_MIN_TOKENS + 1, seqs: int = 2) -> None:
        """Run one throw-away step of `tokens` tokens (one prompt, the rest decodes of `seqs`
        sequences) on each path built so far, so the first real steps don't pay for first calls:
        onnxruntime's first allocations, and on the segments the attention kernel's threads and
        the dense form's session. The default, one prompt chunk (dense form) and one decode
        (kernel), is what start-up pays for: measured on SmolLM2-135M, 0.10 s, while a step of the
        scheduler's largest size (128 tokens, 63 of them decodes) took 0.5 s at load and saved the
        first real step of that size about 0.07 s. The decodes are left out while the kernel is
        still loading, except for concurrent traffic (`concurrent`), where the first mixed step
        would wait for it instead (Numba's start, 0.4-1.6 s): a single request's start-up does
        not. It writes only into pool blocks no request owns yet; nothing reads them before a
        request's own keys and values overwrite them."""
        blocks = self.kv.num_blocks
        if self.whole is not None:
            prompt = max(1, min(tokens, blocks * self.block_size))
            width = -(-prompt // self.block_size)
            batch = PagedBatch(np.arange(width)[None], np.zeros(1, np.int64), np.array([0, prompt]))
            self.run(StepPlan(WHOLE_GRAPH, np.zeros(prompt, np.int64), np.arange(prompt), batch, np.array([prompt - 1])))
            self.whole.rows.invalidate()
        if self._sessions is None:
            return
        if self._kernel_at_load:
            self._attention.wait_until_loaded()
        elif not self._attention.loaded:
            seqs = 1
        decodes = max(0, min(seqs - 1, tokens - 1, blocks - 1))
        prompt = max(1, min(tokens - decodes, (blocks - decodes) * self.block_size))
        width = -(-prompt // self.block_size)
        tables = np.zeros((decodes + 1, width), np.int64)
        tables[0] = np.arange(width)
        tables[1:, 0] = width + np.arange(decodes)
        starts = np.concatenate([[0], prompt + np.arange(decodes + 1)])
        batch = PagedBatch(tables, np.array([0] + [1] * decodes), starts)
        positions = np.concatenate([np.arange(prompt), np.ones(decodes, np.int64)])
        self.run(StepPlan(PACKED, np.zeros(prompt + decodes, np.int64), positions, batch, starts[1:] - 1))


def deploy_checks(manifest, record) -> None:
    """The CPU's execution provider, beside the importable libraries the registry lists."""
    import onnxruntime

    providers = onnxruntime.get_available_providers()
    record("CPU execution provider", "CPUExecutionProvider" in providers, ", ".join(providers))
