"""The KV cache's one owner: the pool (its size and its memory), the block accounting, copy-on-write,
and the contiguous rows the CPU's whole graph runs on.

The pool is sized at load, not at compile time: an engine file may run on machines with more or
less memory than the one that built it. The manifest's `num_blocks` is the most the engine will
ever use (what `llmc compile --kv-pool-mb` asked for, or by default room for min(max batch, 16)
sequences of max_seq_len tokens); a pool the user did not size (no --kv-pool-mb at compile, no
`kv_pool_mb` at load) is capped at `MEMORY_FRACTION` of the memory available when the engine loads
(its weights already loaded), and never below one sequence of max_seq_len tokens.

The pool is allocated, not filled: its pages are mapped on first write, so start-up and resident
memory pay only for blocks that requests have used (SmolLM2-135M's default 5.76 GB pool made
`llmc run` peak at 10 GB when it was zero-filled at load). A step that writes into blocks no
request used before pays their page faults, once per block for the pool's lifetime (measured on
SmolLM2-135M's 60 pools, 2 loaded cores: 16 decodes each starting a fresh block, 10-20 ms on top
of the step; a 2,048-token prompt, 140 ms). The block manager hands out blocks in id order until
each has been used once, so a pool that stays lightly used stays small.

The rows (`RowCache`) are the pool's contiguous mirror for the whole graph
(runtime/backends/whole_graph.py), which runs onnxruntime's GroupQueryAttention over buffers
[rows, kv heads, max_seq_len, head dim] per layer that the session appends to in place. A step
of one sequence uses row 0; a decode of several gives each sequence a row and keeps it there
while it runs. The pool stays the record every other reader uses: a segmented step, a
prefix-cache hit seated in another row, a copy-on-write. What a row appends reaches the pool when
something is about to read it there, or when the row is dropped (`flush`), block by block:
per-step scatters of a token's keys and values into every layer's pool cost 0.7-0.8 ms of a
16-sequence decode step of the 25M Llama. (A model with attention windows stores every step at
once: its rows may hold positions whose blocks the window has released.) A row caches the
sequence it last ran: the next step reuses it when it continues that sequence (same leading
blocks) and copies from the pool only the positions it lacks. Whatever writes pool blocks another
way (`wrote`) cuts what each row holds back to before those blocks; a row left out of a step is
released, since that step may reuse its blocks. The rows grow to the most a step has used
(powers of two up to the engine's max batch) and are mapped on first write: the keys and values
of the sequences run there are resident twice.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Callable

import numpy as np

from llmc.errors import LlmcError
from llmc.formats.manifest import Manifest, blocks_in, kv_block_bytes
from llmc.runtime.block_manager import BlockManager

# The default pool's share of the memory available at load (weights and sessions already counted
# out): the rest is left to the process's other arrays, the page cache and other processes.
MEMORY_FRACTION = 0.5


def pool_blocks(paged, geometry, kv_pool_mb: float | None = None, available: int | None = None,
                block_bytes: int | None = None) -> int:
    """Blocks in the KV pool.

    Args:
        paged: the manifest's paged layout (its `num_blocks` is the ceiling).
        geometry: the model's geometry.
        kv_pool_mb: the pool asked for at load, in MiB; None keeps the compiled one when
            `llmc compile --kv-pool-mb` set it, or else sizes the default by `available`.
        available: bytes of memory available now; None reads it from the system.
        block_bytes: bytes a block takes in every layer, as the pool stores it; None: in the
            manifest's kv_dtype.
    """
    block_bytes = block_bytes or kv_block_bytes(geometry, paged.block_size, paged.kv_dtype)
    if kv_pool_mb is not None:
        if not kv_pool_mb > 0:
            raise LlmcError(f"kv_pool_mb: must be > 0, got {kv_pool_mb}")
        return blocks_in(kv_pool_mb, block_bytes, paged.block_size, paged.max_seq_len, "kv_pool_mb")
    if paged.kv_pool_mb is not None:
        return paged.num_blocks
    available = available_memory() if available is None else available
    if available is None:
        return paged.num_blocks
    per_sequence = -(-paged.max_seq_len // paged.block_size)
    return max(per_sequence, min(paged.num_blocks, int(MEMORY_FRACTION * available // block_bytes)))


def allocate_pool(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A zeroed array whose pages are mapped on first write, in small pages.

    NumPy asks for transparent huge pages on arrays this large (madvise), and where the kernel
    compacts memory for madvised regions on fault (transparent_hugepage/defrag = madvise, a
    common default) a first write can stall for milliseconds a page: measured on a loaded 2-core
    machine, 960 fresh blocks of SmolLM2-135M's pools took 14 s to touch, against 10-20 ms in
    small pages (and zero-filling its 5.76 GB default pool at load took 110 s). Nor do huge pages
    speed attention's reads enough to pay for those faults: SmolLM2-135M serving 64 requests on
    2 cores of an AMD EPYC (OpenVINO backend, f32) ran 0.86-0.96x as fast with the pool on them
    (4 pairs), with 1.3-3.7 s more kernel time in a 35 s run."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.zeros(shape, dtype)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mapping, dtype).reshape(shape)


def available_memory() -> int | None:
    """Bytes of memory the system can give without swapping (Linux's MemAvailable), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class KvCache:
    """The pool, its block manager, copy-on-write and the whole graph's rows, for an engine's lifetime.

    Args:
        manifest: a paged engine's manifest (geometry, block size, pool dtype, windows).
        kv_pool_mb: the pool asked for at load, in MiB (see `pool_blocks`).
        allocate: makes the zeroed pool on the backend's device, given a shape and a dtype name.
        available: bytes of the device's memory available now; None reads the system's.
        max_blocks: the most blocks the backend's step can address (TensorRT: its profile's).
        dtype: the type the pool is stored in; None: the manifest's kv_dtype.
        block_shapes: the shapes of one layer's key block and value block where the backend
            stores them in a layout of its own (`PoolPlacement.block_shapes`); None: both
            [kv heads, block size, head dim].
    """

    def __init__(self, manifest: Manifest, kv_pool_mb: float | None = None, *,
                 allocate: Callable[[tuple[int, ...], str], Any] = allocate_pool,
                 available: int | None = None, max_blocks: int | None = None, dtype: str | None = None,
                 block_shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None):
        paged, geometry = manifest.paged, manifest.geometry
        dtype = dtype or paged.kv_dtype
        layers = geometry.num_layers
        shapes = block_shapes or ((geometry.num_kv_heads, paged.block_size, geometry.head_dim),) * 2
        block_bytes = layers * sum(int(np.prod(shape)) for shape in shapes) * np.dtype(dtype).itemsize
        blocks = pool_blocks(paged, geometry, kv_pool_mb, available, block_bytes)
        self.num_blocks = blocks if max_blocks is None else min(blocks, max_blocks)
        self.block_size = paged.block_size
        if block_shapes is None:
            # Every layer's keys and values in one array, [layer and part, block, kv head, slot, head dim]:
            # storing a step, or copying a block, is one operation instead of one a layer.
            self.pool = allocate((2 * layers, self.num_blocks, *shapes[0]), dtype)
            self.parts = (self.pool[0::2], self.pool[1::2])
        else:  # keys and values of different shapes: an array each, [layer, block, ...]
            self.pool = None
            self.parts = tuple(allocate((layers, self.num_blocks, *shape), dtype) for shape in shapes)
        self.blocks = BlockManager(self.num_blocks, paged.block_size, paged.window)
        self.rows: RowCache | None = None

    def layer_pools(self) -> dict[str, Any]:
        """Each layer's key and value pool by its graph input name (views of `parts`)."""
        return {f"{part}_cache.{layer}": self.parts[i][layer]
                for layer in range(len(self.parts[0])) for i, part in enumerate(("key", "value"))}

    def mirror_rows(self, capacity: int, max_rows: int, eager: bool) -> RowCache:
        """The contiguous rows a whole graph runs on (see `RowCache`), owned here."""
        self.rows = RowCache(self.pool, capacity, self.block_size, max_rows, eager)
        return self.rows

    def synced(self) -> Any:
        """The pool, with everything the rows hold written back: for a reader of the pool."""
        if self.rows is not None:
            self.rows.flush()
        return self.pool

    def wrote(self, blocks: np.ndarray) -> None:
        """Pool `blocks` were written by a reader of `synced()`'s pool: the rows drop what they
        held from there on."""
        if self.rows is not None:
            self.rows.written(blocks)

    def copy_blocks(self, pairs) -> None:
        """Copy-on-write: block `src` into `dst` for each pair, in every layer."""
        if not pairs:
            return
        self.synced()
        self.wrote(np.array([dst for _, dst in pairs]))
        for src, dst in pairs:
            for part in self.parts:
                part[:, dst] = part[:, src]

    def keep(self, sequence: int, length: int) -> None:
        """Of the last step's `sequence` (its index in the step), only the first `length` positions
        are the sequence's: the rest were guesses not kept, whose blocks may go to other
        sequences. A packed step wrote them into the pool, where they are never read; the rows
        must not write them back later."""
        if self.rows is not None:
            self.rows.keep(sequence, length)


class RowCache:
    """The pool's contiguous mirror for the whole graph: a buffer row per sequence it runs.

    Args:
        pool: the KV pool, [layer and part, block, kv head, slot, head dim].
        capacity: positions a row holds (max_seq_len, plus one for a graph's padding row).
        block_size: slots per pool block.
        max_rows: the most sequences a step may run here (the engine's max batch).
        eager: store each step's keys and values at once (a model with attention windows: the
            blocks a window has left behind are released, and their table entries read 0, so a
            late write-back could not tell where they went).
    """

    def __init__(self, pool: np.ndarray, capacity: int, block_size: int, max_rows: int, eager: bool = False):
        self.pool, self.block_size, self.max_rows, self.eager = pool, block_size, max_rows, eager
        self._shape = (pool.shape[2], capacity, pool.shape[4])
        self._tables: list[np.ndarray | None] = []
        self.generation = 0
        self._grow(1)

    def seat(self, tables: np.ndarray, pasts: np.ndarray) -> np.ndarray:
        """Each of a step's sequences' row, holding its first `pasts` positions (copied from the
        pool where the row lacks them); rows no sequence of the step took are released."""
        if len(tables) == 1:
            self._release(range(1, self.rows))
            self._seat(0, tables[0], int(pasts[0]))
            return np.zeros(1, np.int64)
        return self._seats(tables, pasts)

    def ran(self, seats: np.ndarray, tables: np.ndarray, totals: np.ndarray) -> None:
        """The step ran on `seats`: each now holds its sequence's first `totals` positions."""
        for seat, table in zip(seats.tolist(), tables):
            self._tables[seat] = table
        self._held[seats] = totals
        self._seated = seats
        self._last = (seats, tables) if len(seats) > 1 else None
        if self.eager:
            self.flush(seats)

    def release_all(self) -> None:
        """Every row written back and emptied (before a throw-away run in row 0)."""
        self._release(range(self.rows))

    def invalidate(self) -> None:
        """Nothing in the buffers is reusable, nor to be written back (a throw-away step)."""
        self._tables = [None] * self.rows
        self._last = None  # (seats, block tables) of the last step of several sequences
        self._seated = None  # each sequence's row in the last step, while that step's writes are the latest
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
        if self._seated is None:  # the step ran elsewhere
            return
        row = int(self._seated[sequence])
        self._held[row] = min(self._held[row], length)
        self._stored[row] = min(self._stored[row], length)

    def written(self, blocks: np.ndarray) -> None:
        """Pool `blocks` were written another way (the caller flushed first): each row keeps only
        what lies before them."""
        self._seated = None
        for row, table in enumerate(self._tables):
            if table is not None and self._held[row]:
                hit = np.isin(table[:-(-self._held[row] // self.block_size)], blocks)
                if hit.any():
                    self._held[row] = min(self._held[row], int(hit.argmax()) * self.block_size)
                    self._stored[row] = min(self._stored[row], self._held[row])

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
        self.generation += 1  # a new buffer: bindings of the old one are stale
        # [layer and part, row, kv head, position, head dim], layers and parts in the pool's order
        self.buffer = allocate_pool((len(self.pool), self.rows, *self._shape), self.pool.dtype)
        self.invalidate()
