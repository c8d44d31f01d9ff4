"""A paged engine's steps of one sequence, or of decodes only, as one onnxruntime call.

The segmented path (runtime/backends/paged_onnxruntime.py) pays per layer for a session run, an
attention kernel call and the Python between them: measured on the 25M Llama at batch 1, 1.3 ms
of a 5.9 ms decode step, and the larger part of an int4 one. A chat user, an agent loop or a
batch past its prompts runs steps that hold one sequence, or one new token for each of several:
such a step runs the engine's single-sequence graph (passes/lower_single_sequence.py) instead,
the whole model in one session, attention by onnxruntime's GroupQueryAttention over contiguous
buffers [rows, kv heads, max_seq_len, head dim] per layer that the session appends to in place
(bound as both its past and its present). A step of one sequence uses row 0; a decode of several
gives each sequence a row and keeps it there while it runs. GroupQueryAttention takes several new
tokens with a past for one sequence only, so a decode step in which several sequences carry
guesses (runtime/prompt_lookup.py) runs on the segments.

The pool stays the record every other reader uses: a segmented step, a prefix-cache hit seated
in another row, a copy-on-write. What a row appends reaches the pool when something is about to
read it there, or when the row is dropped (`flush`), block by block: per-step scatters of a
token's keys and values into every layer's pool cost 0.7-0.8 ms of a 16-sequence decode step of
the 25M Llama. (A model with attention windows stores every step at once: its rows may hold
positions whose blocks the window has released.) A row caches the sequence it last ran: the next
step reuses it when it continues that sequence (same leading blocks) and copies from the pool
only the positions it lacks (those a segmented step appended). Whatever writes pool blocks
another way (`written`) cuts what each row holds back to before those blocks; a row left out of
a step is released, since that step may reuse its blocks.

Memory: the buffers grow to the most rows a step has used (powers of two up to the engine's max
batch) and, like the pool, are mapped on first write, so they hold what the sequences run here
hold: the keys and values of those sequences are resident twice. The session holds its own
prepacked weights: with the segments' sessions built as well (the first step this path does not
take builds them), resident memory holds the weights twice.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from llmc.plugins.paged_attention import PagedBatch

# Steps of one sequence up to this many tokens (a decode with its guesses) run through arrays
# bound once per shape; a longer one (a prompt) binds its inputs for the call.
SHORT_STEP = 8


class WholeGraph:
    """The single-sequence session and its key/value buffers.

    Args:
        session: the engine's single-sequence graph, opened.
        pool: the KV pool, [layer and part, block, kv head, slot, head dim] (layers and parts in
            `_names`' order), which this path writes back into.
        capacity: the positions a sequence may reach (max_seq_len); the buffers hold one more
            where the graph has a padding row for a lone token (passes/lower_single_sequence.py).
        max_rows: the most sequences a decode step may run here (the engine's max batch).
        allocate: makes a zeroed array whose pages are mapped on first write.
        eager: store each step's keys and values at once (a model with attention windows: the
            blocks a window has left behind are released, and their table entries read 0, so a
            late write-back could not tell where they went).
    """

    def __init__(self, session: ort.InferenceSession, pool: np.ndarray, capacity: int, block_size: int,
                 max_rows: int, allocate, eager: bool = False):
        layers, kv_heads, head_dim, dtype = pool.shape[0] // 2, pool.shape[2], pool.shape[4], pool.dtype
        self.session, self.pool, self.block_size, self.max_rows, self.eager = session, pool, block_size, max_rows, eager
        self.pads = any(i.name == "padding_rows" for i in session.get_inputs())  # a lone token's padding row
        self._shape, self._dtype, self._allocate = (kv_heads, capacity + self.pads, head_dim), dtype, allocate
        self._names = [(layer, part) for layer in range(layers) for part in ("key", "value")]  # the pool's order
        self._binding = session.io_binding()
        self._binding.bind_output("logits")  # first: get_outputs()[0]
        self._vocab = session.get_outputs()[0].shape[-1]  # fixed: the lowering declares it
        self._shapes: dict[tuple[int, int, int], tuple[dict, dict]] = {}  # see `_arrays`
        self._bound_shape: tuple[int, int, int] | None = None  # the shape whose arrays the binding holds
        self._tables: list[np.ndarray | None] = []
        self._grow(1)

    def runs(self, batch: PagedBatch, tokens: int) -> bool:
        """Whether this path runs a step: one sequence, or one token for each of at most max_rows."""
        return batch.num_seqs == 1 or (tokens == batch.num_seqs <= self.max_rows)

    def invalidate(self) -> None:
        """Nothing in the buffers is reusable, nor to be written back (a throw-away step)."""
        self._tables = [None] * self.rows
        self._last = None  # (seats, block tables) of the last step of several sequences
        self._held = np.zeros(self.rows, np.int64)  # positions each row holds
        self._stored = np.zeros(self.rows, np.int64)  # of which the pool has these first ones

    def flush(self, rows=None) -> None:
        """Write back into the pool what `rows` (default: all) hold and it lacks. Called before
        anything reads the pool or a row's contents are dropped."""
        for row in range(self.rows) if rows is None else rows:
            table, stored, held = self._tables[row], int(self._stored[row]), int(self._held[row])
            if table is not None and stored < held:
                for block, offset, start, end in self._spans(table, stored, held):
                    self.pool[:, block, :, offset:offset + end - start] = self.buffer[:, row, :, start:end]
                self._stored[row] = held

    def keep(self, sequence: int, length: int) -> None:
        """The last step's `sequence` is its first `length` positions: its row drops the rest
        unwritten (speculative tokens not kept, whose blocks are no longer the sequence's)."""
        row = int(self._seated[sequence])
        self._held[row] = min(self._held[row], length)
        self._stored[row] = min(self._stored[row], length)

    def written(self, blocks: np.ndarray) -> None:
        """Pool `blocks` were written another way (the caller flushed first): each row keeps only
        what lies before them."""
        for row, table in enumerate(self._tables):
            if table is not None and self._held[row]:
                hit = np.isin(table[:-(-self._held[row] // self.block_size)], blocks)
                if hit.any():
                    self._held[row] = min(self._held[row], int(hit.argmax()) * self.block_size)
                    self._stored[row] = min(self._stored[row], self._held[row])

    def step(self, tokens: np.ndarray, positions: np.ndarray, batch: PagedBatch, rows: np.ndarray,
             exact: bool = False) -> np.ndarray:
        """Run one step (see `runs`); returns the logits of the packed `rows`. Its keys and values
        reach the pool when it is next flushed (at once when `eager`). `exact`: a lone token gets
        the graph's padding row, where it has one (passes/lower_single_sequence.py)."""
        pad = int(exact and self.pads and len(tokens) == 1)
        pasts, tables = np.asarray(batch.context_lens, np.int64), np.asarray(batch.block_tables)
        starts = np.asarray(batch.query_start_loc)
        totals = pasts + (starts[1:] - starts[:-1])
        if batch.num_seqs == 1:
            seats = np.zeros(1, np.int64)
            self._release(range(1, self.rows))
            self._seat(0, tables[0], int(pasts[0]))
            used = 1
        else:
            seats = self._seats(tables, pasts)
            used = int(seats.max()) + 1
        self._bind(used)
        if len(tokens) == batch.num_seqs:  # decodes: a token per sequence
            logits = self._run_decode(tokens, positions, seats, totals, seats[rows], used, pad)
        else:  # one sequence's prompt (or part of it)
            logits = self._run_tokens(tokens, positions, int(totals[0]), rows, pad)
        for seat, table in zip(seats.tolist(), tables):
            self._tables[seat] = table
        self._held[seats] = totals
        self._seated = seats
        self._last = (seats, tables) if batch.num_seqs > 1 else None
        if self.eager:
            self.flush(seats)
        return logits

    def steps_round_alike(self) -> bool:
        """Whether a sequence's logits come out bit for bit the same however its tokens are cut
        into steps of one to five, a token and its guesses (the lowering's padding row, and linear
        layers that compute each row alone, as MatMulNBits does for blocks of up to 32 on
        x86-64): checked on row 0 with a made-up sequence, since it depends on onnxruntime's
        kernels for this CPU. Eight session runs: 4-6 ms for the 25M Llama int4, 44 ms for
        SmolLM2-135M int4, 0.2 s for a 1B int4 model."""
        self._release(range(self.rows))
        self._bind(1)
        tokens, length = np.arange(1, 6, dtype=np.int64), 5
        cuts = [(0, length), (0, 1, 3, length), (0, 4, length), (0, 3, length)]
        runs = []
        for cut in cuts:
            runs.append(np.concatenate([
                self._run_tokens(tokens[start:end], np.arange(start, end), end, np.arange(end - start), pad=1)
                for start, end in zip(cut, cut[1:])]))
        self.invalidate()  # row 0 holds the made-up sequence: nothing to write back
        return all(np.array_equal(runs[0], run) for run in runs[1:])

    def _run_tokens(self, tokens: np.ndarray, positions: np.ndarray, total: int, rows, pad: int = 0) -> np.ndarray:
        """One sequence's `tokens` in row 0, which then holds `total` positions; the logits of
        `rows`. `pad`: 1 for the padding row (a lone token's, on a graph that has one)."""
        if len(tokens) <= SHORT_STEP:  # a request's guesses: the arrays bound for this shape
            arrays = self._arrays(len(tokens), 1, len(rows))
            arrays["input_ids"][0], arrays["position_ids"][0] = tokens, positions
            arrays["seqlens_k"][0], arrays["total_sequence_length"][()] = total - 1, total
            return self._run_arrays(arrays, rows, pad)
        binding = self._binding
        self._bound_shape = None  # these inputs replace the bound arrays
        binding.bind_cpu_input("input_ids", tokens[None])
        binding.bind_cpu_input("position_ids", positions[None])
        binding.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        binding.bind_cpu_input("logits_rows", np.asarray(rows, np.int64))
        if self.pads:
            binding.bind_cpu_input("padding_rows", np.array([pad], np.int64))
        binding.bind_output("logits")  # again: a bound output keeps the last run's shape
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[0]

    def _release(self, rows) -> None:
        """Rows no sequence holds any more: what they hold goes to the pool first."""
        self.flush(rows)
        for row in rows:
            self._tables[row], self._held[row], self._stored[row] = None, 0, 0

    def _seats(self, tables: np.ndarray, pasts: np.ndarray) -> np.ndarray:
        """Each sequence's row: the one holding it if any, else a free one (lowest first), its
        missing positions copied from the pool. Rows no sequence of the step took are released."""
        if self._same_as_last(tables, pasts):
            return self._last[0]
        if len(tables) > self.rows:
            self.flush()
            self._grow(len(tables))
        seats = np.full(len(tables), -1, np.int64)
        by_first = {}
        for row, held in enumerate(self._tables):
            if held is not None and len(held):
                by_first.setdefault(int(held[0]), []).append(row)
        taken = set()
        for i, table in enumerate(tables):
            for row in by_first.get(int(table[0]), ()):
                if row not in taken and self._continues(row, table):
                    seats[i] = row
                    taken.add(row)
                    break
        free = iter(row for row in range(self.rows) if row not in taken)
        self._release([row for row in range(self.rows) if row not in taken])
        for i, table in enumerate(tables):
            continues = seats[i] >= 0
            if not continues:
                seats[i] = next(free)
            self._seat(int(seats[i]), table, int(pasts[i]), continues)
        return seats

    def _same_as_last(self, tables: np.ndarray, pasts: np.ndarray) -> bool:
        """Whether this step holds the last step's sequences, in its order, each continuing its
        row with nothing to copy (the usual decode step: then the rows are seated already)."""
        if self._last is None:
            return False
        seats, last_tables = self._last
        if len(seats) != len(pasts) or not (self._held[seats] == pasts).all():
            return False
        needed = -(-pasts // self.block_size)  # the blocks the rows hold: in both tables
        width = int(needed.max())
        if width > min(tables.shape[1], last_tables.shape[1]):
            return False
        same = tables[:, :width] == last_tables[:, :width]
        return bool((same | (np.arange(width) >= needed[:, None])).all())

    def _continues(self, row: int, table: np.ndarray) -> bool:
        """Whether `row` holds the start of the sequence with this block table: what it holds
        lies in the same blocks (a block's contents are the same in the pool and here, whichever
        sequence owns it now)."""
        held = self._tables[row]
        needed = -(-int(self._held[row]) // self.block_size)
        return needed <= min(len(held), len(table)) and bool((held[:needed] == table[:needed]).all())

    def _seat(self, row: int, table: np.ndarray, past: int, continues: bool | None = None) -> None:
        """Make `row` hold the sequence's first `past` positions, copying from the pool what it
        lacks; `continues`: whether the row holds the sequence's start, if the caller checked."""
        if continues is None:
            continues = self._tables[row] is not None and self._continues(row, table)
        held = int(self._held[row]) if continues else 0
        if held == past and past:  # a decode continuing its row: the usual step
            self._tables[row] = table
            return
        if held < self._held[row] or past < held:
            self.flush([row])  # what it held past `held` or `past` is dropped: the pool keeps it
        first = min(held, past)
        if first < past:
            self.flush()  # the pool must be current where it is read (another row may hold those blocks)
            for block, offset, start, end in self._spans(table, first, past):
                self.buffer[:, row, :, start:end] = self.pool[:, block, :, offset:offset + end - start]
            self._stored[row] = past
        self._tables[row], self._held[row] = table, past
        self._stored[row] = min(self._stored[row], past)

    def _spans(self, table: np.ndarray, first: int, end: int):
        """(block, offset in it, first position, end position) of each block-sized run of a
        sequence's positions [first, end): a row's [kv_heads, positions, head_dim] run is the
        same as a block's [kv_heads, slots, head_dim] slice."""
        size = self.block_size
        while first < end:
            offset = first % size
            stop = min(end, first - offset + size)
            yield int(table[first // size]), offset, first, stop
            first = stop

    def _grow(self, rows: int) -> None:
        """Buffers of at least `rows` rows (a power of two, at most max_rows); what the old ones
        held is dropped (the pool has it)."""
        self.rows = min(self.max_rows, 1 << (rows - 1).bit_length())
        # [layer and part, row, kv head, position, head dim], layers and parts in the pool's order
        self.buffer = self._allocate((len(self._names), self.rows, *self._shape), self._dtype)
        self._bound_rows = 0
        self.invalidate()

    def _bind(self, rows: int) -> None:
        """Bind the buffers' first `rows` rows as the session's past and present."""
        if rows == self._bound_rows:
            return
        self._values = []  # the binding's views of the buffers, kept with it
        for index, (layer, part) in enumerate(self._names):
            value = ort.OrtValue.ortvalue_from_numpy(self.buffer[index, :rows])  # shares memory
            self._values.append(value)
            self._binding.bind_ortvalue_input(f"past_key_values.{layer}.{part}", value)
            self._binding.bind_ortvalue_output(f"present.{layer}.{part}", value)
        self._bound_rows = rows

    def _run_decode(self, tokens: np.ndarray, positions: np.ndarray, seats: np.ndarray, totals: np.ndarray,
                    logits_rows: np.ndarray, used: int, pad: int) -> np.ndarray:
        """A new token for each sequence, in its seat; an empty seat decodes a throw-away token
        at position 0."""
        arrays = self._arrays(used, used, len(logits_rows))
        if len(seats) < used:  # seats between the sequences' are empty
            for name in ("input_ids", "position_ids", "seqlens_k"):
                arrays[name].fill(0)
        arrays["input_ids"][0, seats], arrays["position_ids"][0, seats] = tokens, positions
        arrays["seqlens_k"][seats] = totals - 1
        arrays["total_sequence_length"][()] = totals.max()
        return self._run_arrays(arrays, logits_rows, pad)

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
                      **({"padding_rows": np.zeros(1, np.int64)} if self.pads else {}),
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

    def _run_arrays(self, arrays: dict[str, np.ndarray], logits_rows, pad: int) -> np.ndarray:
        arrays["logits_rows"][:] = logits_rows
        if self.pads:
            arrays["padding_rows"][0] = pad
        self.session.run_with_iobinding(self._binding)
        return arrays["logits"][0].copy()  # the array is the next step's of this shape too
