"""A paged engine's steps of one sequence, or of decodes only, as one onnxruntime call.

The segmented path (runtime/backends/cpu.py) pays per layer for a session run, an attention
kernel call and the Python between them. A chat user, an agent loop or a batch past its prompts
runs steps that hold one sequence, or one new token for each of several: the step plan
(runtime/step_plan.py) sends such a step here, to the engine's single-sequence graph
(passes/lower_single_sequence.py): the whole model in one session, attention by onnxruntime's
GroupQueryAttention over the KV cache's contiguous rows (runtime/kv_cache.py, `RowCache`), which
the session appends to in place (bound as both its past and its present).

The session holds its own prepacked weights: with the segments' sessions built as well (the first
packed step builds them), resident memory holds the weights twice.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from llmc.runtime.kv_cache import RowCache
from llmc.runtime.step_plan import StepPlan
from llmc.runtime.timeline import KERNEL, OFF, ONNXRUNTIME

# Steps of one sequence up to this many tokens (a decode with its guesses) run through arrays
# bound once per shape; a longer one (a prompt) binds its inputs for the call.
SHORT_STEP = 8


class WholeGraph:
    """The single-sequence session, run on the KV cache's rows.

    Args:
        session: the engine's single-sequence graph, opened.
        rows: the rows it runs on; their buffer's layers and parts are in the pool's order.
        pads: the graph has room for a lone token's padding row (passes/lower_single_sequence.py).
        timeline: where its session calls are recorded.
    """

    def __init__(self, session: ort.InferenceSession, rows: RowCache, pads: bool, timeline=OFF):
        self.session, self.rows, self.pads, self.timeline = session, rows, pads, timeline
        self._names = [(layer, part) for layer in range(len(rows.pool) // 2) for part in ("key", "value")]
        self._binding = session.io_binding()
        self._binding.bind_output("logits")  # first: get_outputs()[0]
        self._vocab = session.get_outputs()[0].shape[-1]  # fixed: the lowering declares it
        self._shapes: dict[tuple[int, int, int], tuple[dict, dict]] = {}  # see `_arrays`
        self._bound_shape: tuple[int, int, int] | None = None  # the shape whose arrays the binding holds
        self._bound: tuple[int, int] | None = None  # (buffer generation, rows) bound as past and present

    def run(self, plan: StepPlan) -> np.ndarray:
        """Run one step; returns the logits of the plan's rows. Its keys and values stay in the
        rows until the KV cache writes them back."""
        batch, rows, tokens = plan.batch, plan.rows, plan.tokens
        pad = int(plan.pad)
        pasts, tables = np.asarray(batch.context_lens, np.int64), np.asarray(batch.block_tables)
        starts = np.asarray(batch.query_start_loc)
        totals = pasts + (starts[1:] - starts[:-1])
        # Seating a sequence that last ran packed copies its keys and values from the pool.
        with self.timeline.span("seat rows", KERNEL):
            seats = self.rows.seat(tables, pasts)
        used = int(seats.max()) + 1
        self._bind(used)
        if len(tokens) == batch.num_seqs and not pad:  # decodes: a token per sequence
            logits = self._run_decode(tokens, plan.positions, seats, totals, seats[rows], used)
        else:  # one sequence's prompt (or part of it), or a padded lone token
            logits = self._run_tokens(tokens, plan.positions, int(totals[0]), rows, pad)
        self.rows.ran(seats, tables, totals)
        return logits

    def steps_round_alike(self) -> bool:
        """Whether a sequence's logits come out bit for bit the same however its tokens are cut
        into steps of one to five, a token and its guesses (the lowering's padding row, and linear
        layers that compute each row alone, as MatMulNBits does on x86-64 for 4-bit blocks of up
        to 32 and, on an AMD EPYC, 8-bit ones of 64, not 128): checked on row 0 with a made-up
        sequence, since it depends on onnxruntime's kernels for this CPU. Eight session runs: 4-6 ms
        for the 25M Llama int4, 44 ms for SmolLM2-135M int4, 0.2 s for a 1B int4 model."""
        self.rows.release_all()
        self._bind(1)
        tokens, length = np.arange(1, 6, dtype=np.int64), 5
        cuts = [(0, length), (0, 1, 3, length), (0, 4, length), (0, 3, length)]
        runs = []
        for cut in cuts:
            runs.append(np.concatenate([
                self._run_tokens(tokens[start:end], np.arange(start, end), end, np.arange(end - start),
                                 pad=int(self.pads and end - start == 1))
                for start, end in zip(cut, cut[1:])]))
        self.rows.invalidate()  # row 0 holds the made-up sequence: nothing to write back
        return all(np.array_equal(runs[0], run) for run in runs[1:])

    def _run_tokens(self, tokens: np.ndarray, positions: np.ndarray, total: int, rows, pad: int = 0) -> np.ndarray:
        """One sequence's `tokens` in row 0, which then holds `total` positions; the logits of
        `rows`. `pad`: 1 to give a lone token its padding row, the token again one position on
        (on a graph with room for it)."""
        if pad:
            tokens, positions, total = np.repeat(tokens, 2), positions[0] + np.arange(2), total + 1
        if len(tokens) <= SHORT_STEP:  # a request's guesses: the arrays bound for this shape
            arrays = self._arrays(len(tokens), 1, len(rows))
            arrays["input_ids"][0], arrays["position_ids"][0] = tokens, positions
            arrays["seqlens_k"][0], arrays["total_sequence_length"][()] = total - 1, total
            return self._run_arrays(arrays, rows)
        binding = self._binding
        self._bound_shape = None  # these inputs replace the bound arrays
        binding.bind_cpu_input("input_ids", tokens[None])
        binding.bind_cpu_input("position_ids", positions[None])
        binding.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        binding.bind_cpu_input("logits_rows", np.asarray(rows, np.int64))
        binding.bind_output("logits")  # again: a bound output keeps the last run's shape
        with self.timeline.span("whole graph", ONNXRUNTIME):
            self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[0]

    def _bind(self, rows: int) -> None:
        """Bind the buffers' first `rows` rows as the session's past and present."""
        if self._bound == (self.rows.generation, rows):
            return
        self._values = []  # the binding's views of the buffers, kept with it
        for index, (layer, part) in enumerate(self._names):
            value = ort.OrtValue.ortvalue_from_numpy(self.rows.buffer[index, :rows])  # shares memory
            self._values.append(value)
            self._binding.bind_ortvalue_input(f"past_key_values.{layer}.{part}", value)
            self._binding.bind_ortvalue_output(f"present.{layer}.{part}", value)
        self._bound = (self.rows.generation, rows)

    def _run_decode(self, tokens: np.ndarray, positions: np.ndarray, seats: np.ndarray, totals: np.ndarray,
                    logits_rows: np.ndarray, used: int) -> np.ndarray:
        """A new token for each sequence, in its seat; an empty seat decodes a throw-away token
        at position 0."""
        arrays = self._arrays(used, used, len(logits_rows))
        if len(seats) < used:  # seats between the sequences' are empty
            for name in ("input_ids", "position_ids", "seqlens_k"):
                arrays[name].fill(0)
        arrays["input_ids"][0, seats], arrays["position_ids"][0, seats] = tokens, positions
        arrays["seqlens_k"][seats] = totals - 1
        arrays["total_sequence_length"][()] = totals.max()
        return self._run_arrays(arrays, logits_rows)

    def _arrays(self, tokens: int, sequences: int, rows: int) -> dict[str, np.ndarray]:
        """The inputs and logits of a step of this shape: arrays made and bound once per shape and
        rewritten in place (binding fresh ones and collecting every output, the presents
        included, cost 10-20% of a small model's batch-1 decode step, and ~0.1 ms of a
        16-sequence one)."""
        shape = (tokens, sequences, rows)
        if shape not in self._shapes:
            arrays = {"input_ids": np.zeros((1, tokens), np.int64), "position_ids": np.zeros((1, tokens), np.int64),
                      "seqlens_k": np.zeros(sequences, np.int32), "total_sequence_length": np.zeros((), np.int32),
                      "logits_rows": np.zeros(rows, np.int64),
                      "logits": np.zeros((1, rows, self._vocab), np.float32)}
            self._shapes[shape] = arrays, {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in arrays.items()}
        arrays, values = self._shapes[shape]
        if self._bound_shape != shape:
            for name, value in values.items():
                if name == "logits":
                    self._binding.bind_ortvalue_output(name, value)
                else:
                    self._binding.bind_ortvalue_input(name, value)
            self._bound_shape = shape
        return arrays

    def _run_arrays(self, arrays: dict[str, np.ndarray], logits_rows) -> np.ndarray:
        arrays["logits_rows"][:] = logits_rows
        with self.timeline.span("whole graph", ONNXRUNTIME):
            self.session.run_with_iobinding(self._binding)
        return arrays["logits"][0].copy()  # the array is the next step's of this shape too
