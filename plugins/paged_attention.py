"""The paged-attention op: one contract for every backend, and its NumPy reference.

Registered as ``llmc::paged_attention`` — ONNX node ``PagedAttention`` in domain ``llmc``
(opset 1), TensorRT plugin ``llmc::paged_attention``.

A step of the serving runtime packs the new tokens of several sequences, without padding, into
one batch: prefill chunks and single decode tokens together. Each sequence's cached keys and
values live in fixed-size blocks of one shared pool, found through its row of the block table.

Inputs
    query          [T, num_heads, head_dim]        new tokens of all sequences, packed
    key            [T, num_kv_heads, head_dim]     their keys (after rotary), packed likewise
    value          [T, num_kv_heads, head_dim]     their values
    key_cache      [num_blocks, num_kv_heads, block_size, head_dim]   the pool
    value_cache    [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables   int32/int64 [num_seqs, max_blocks_per_seq]   pool block of each sequence's
                   j-th block; entries past a sequence's last block are ignored (any value)
    context_lens   int32/int64 [num_seqs]           cached (past) tokens of each sequence
    query_start_loc int32/int64 [num_seqs + 1]     sequence s owns packed rows
                   query_start_loc[s] : query_start_loc[s + 1] (0 first, T last, non-decreasing)
Attributes
    scale          float, default 1/sqrt(head_dim)
    window         int, default 0: each new token attends to at most the last `window` keys,
                   itself included (sliding-window attention: Mistral, Gemma-2/3's local
                   layers); 0 is full causal attention. Per node, so per layer.
    softcap        float, default 0: when c > 0, each scaled score s becomes c·tanh(s / c) before
                   masking and softmax (Gemma-2's attn_logit_softcapping, as ONNX
                   Attention-23's softcap); 0 leaves scores as they are.
Output
    output         [T, num_heads, head_dim]

Semantics: new token i (0-based within sequence s, whose past length is P) attends to the P cached
tokens — past token j is at ``cache[block_tables[s, j // block_size], :, j % block_size]`` — and
causally to its sequence's new tokens 0..i. Query head h reads kv head h // (num_heads /
num_kv_heads) (grouped-query attention). With a window W, the token at position p = P + i sees
only positions p - W + 1 … p, and block-table entries of blocks wholly before the step's first
token's window are never read (the runtime may have freed them: any value). The op reads the pool and never writes it: the runtime
stores the step's new keys and values at their slots P + i afterwards (one scatter per step), so
a step has no side effects and is easy to test and retry.

Limits every implementation accepts: block_size a power of two from 1 to 256; num_heads a
multiple of num_kv_heads; head_dim 64 or 128 in the compiled kernels (the reference takes any).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.errors import LlmcError

DOMAIN = "llmc"
OP_TYPE = "PagedAttention"
PLUGIN_ID = "llmc::paged_attention"
BLOCK_SIZES = tuple(2 ** i for i in range(9))  # 1 … 256
# Measured (bench/serving_bench.py): live KV utilization 0.954 at block 32, under the 0.96 goal;
# 16 wastes half as much per sequence, and the CPU attention runs within a few percent of block
# 32 (bench/paged_attention_bench.py).
DEFAULT_BLOCK_SIZE = 16
OPENVINO_BLOCK_SIZE = 32  # OpenVINO's CPU paged attention keeps its caches in blocks of 32 tokens


@dataclass(frozen=True)
class PagedBatch:
    """The metadata half of the op's inputs, checked once: where each sequence's tokens are."""

    block_tables: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def slots(self, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Pool block and offset of every packed token's slot (its sequence's past length + its
        index): where the runtime stores the step's new keys and values."""
        starts = np.asarray(self.query_start_loc, np.int64)
        sequence = np.repeat(np.arange(self.num_seqs), np.diff(starts))  # of each packed token
        slots = np.asarray(self.context_lens, np.int64)[sequence] + np.arange(starts[-1]) - starts[sequence]
        blocks = np.asarray(self.block_tables, np.int64)[sequence, slots // block_size]
        return blocks, slots % block_size


def first_visible_block(past: int, window: int, block_size: int) -> int:
    """The first block a sequence's new tokens read, when the first of them is at position
    `past`: 0 without a window, else the block of its earliest visible key."""
    return max(0, past - window + 1) // block_size if window else 0


# Runtime-computed inputs of the dense form.
PLAN_INPUTS = ("paged_block_ids", "paged_mask")


@dataclass(frozen=True)
class StepPlan:
    """The step's block list and mask, the dense form's runtime inputs (see
    plugins/paged_attention_onnx.py)."""

    block_ids: np.ndarray  # int64 [used blocks]: every sequence's blocks, sequence after sequence
    mask: np.ndarray       # float [1, 1, tokens, used blocks · block + tokens]: 0 or lowest

    def feeds(self) -> dict[str, np.ndarray]:
        return dict(zip(PLAN_INPUTS, (self.block_ids, self.mask)))


def plan_step(batch: PagedBatch, block_size: int, dtype=np.float32, window: int = 0) -> StepPlan:
    """Derive the dense form's block list and mask (plugins/paged_attention_onnx.py) from the
    op's metadata inputs.

    Args:
        batch: block tables, past lengths and packed offsets of the step.
        block_size: tokens per pool block.
        dtype: the attention dtype (the mask's fill is its lowest finite value).
        window: the attention window (0: full); only blocks some new token sees are gathered.
    """
    starts = batch.query_start_loc.astype(np.int64)
    tokens = int(starts[-1])
    lens = batch.context_lens.astype(np.int64)
    used = -(-lens // block_size)
    skipped = [first_visible_block(int(lens[s]), window, block_size) for s in range(batch.num_seqs)]
    block_ids = np.concatenate([batch.block_tables[s, skipped[s]:used[s]] for s in range(batch.num_seqs)]
                               + [np.zeros(0, np.int64)]).astype(np.int64)
    past_width = len(block_ids) * block_size
    visible = np.zeros((tokens, past_width + tokens), bool)
    past_offset = 0
    for s in range(batch.num_seqs):
        rows = slice(starts[s], starts[s + 1])
        past, new, base = int(lens[s]), int(starts[s + 1] - starts[s]), skipped[s] * block_size
        # distance[i, j]: new token i (position past + i) to key position j (cached base…past-1, then new)
        positions = np.concatenate([np.arange(base, past), past + np.arange(new)])
        distance = (past + np.arange(new))[:, None] - positions[None, :]
        seen = (distance >= 0) & ((distance < window) if window else True)
        visible[rows, past_offset:past_offset + past - base] = seen[:, :past - base]
        visible[rows, past_width + starts[s]:past_width + starts[s + 1]] = seen[:, past - base:]
        past_offset += (int(used[s]) - skipped[s]) * block_size
    mask = np.where(visible, 0, np.finfo(dtype).min).astype(dtype)[None, None]
    return StepPlan(block_ids, mask)


def check_inputs(query: np.ndarray, key: np.ndarray, value: np.ndarray, key_cache: np.ndarray,
                 value_cache: np.ndarray, batch: PagedBatch, window: int = 0) -> None:
    """Raise LlmcError naming the input at fault; never let a bad table read the wrong memory.

    Args:
        query, key, value, key_cache, value_cache: as in the module docstring.
        batch: block tables, past lengths and packed offsets.
        window: the attention window (0: none); table entries before it are not checked.
    """
    tokens, heads, head_dim = _dims(query, 3, "query")
    if key.shape != value.shape or key.ndim != 3 or key.shape[0] != tokens or key.shape[2] != head_dim:
        raise LlmcError(f"paged_attention: key/value shape {key.shape}/{value.shape} does not match "
                        f"query {query.shape}")
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise LlmcError(f"paged_attention: {heads} query heads is not a multiple of {kv_heads} kv heads")
    if key_cache.shape != value_cache.shape or key_cache.ndim != 4:
        raise LlmcError(f"paged_attention: key_cache {key_cache.shape} and value_cache "
                        f"{value_cache.shape} must be equal 4-D pools")
    num_blocks, cache_kv_heads, block_size, cache_dim = key_cache.shape
    if (cache_kv_heads, cache_dim) != (kv_heads, head_dim):
        raise LlmcError(f"paged_attention: pool {key_cache.shape} does not hold {kv_heads} kv heads "
                        f"of size {head_dim}")
    if block_size not in BLOCK_SIZES:
        raise LlmcError(f"paged_attention: block size {block_size} is not supported "
                        f"(powers of two from 1 to 256)")
    starts, lens, tables = batch.query_start_loc, batch.context_lens, batch.block_tables
    if starts.shape != (batch.num_seqs + 1,) or tables.ndim != 2 or tables.shape[0] != batch.num_seqs:
        raise LlmcError(f"paged_attention: {batch.num_seqs} sequences but query_start_loc "
                        f"{starts.shape} and block_tables {tables.shape}")
    if starts[0] != 0 or starts[-1] != tokens or np.any(np.diff(starts) < 0):
        raise LlmcError(f"paged_attention: query_start_loc must rise from 0 to {tokens} tokens, "
                        f"got {starts.tolist()}")
    if np.any(lens < 0):
        raise LlmcError(f"paged_attention: negative context length in {lens.tolist()}")
    if window < 0:
        raise LlmcError(f"paged_attention: window must be ≥ 0 (0: full attention), got {window}")
    for s in range(batch.num_seqs):
        used = -(-int(lens[s]) // block_size)
        if used > tables.shape[1]:
            raise LlmcError(f"paged_attention: sequence {s} has {lens[s]} cached tokens but its block "
                            f"table holds only {tables.shape[1]} blocks of {block_size}")
        first = first_visible_block(int(lens[s]), window, block_size)
        bad = [int(b) for b in tables[s, first:used] if not 0 <= b < num_blocks]
        if bad:
            raise LlmcError(f"paged_attention: sequence {s} points at block {bad[0]} outside the pool "
                            f"of {num_blocks} blocks")


def paged_attention_reference(query: np.ndarray, key: np.ndarray, value: np.ndarray,
                              key_cache: np.ndarray, value_cache: np.ndarray,
                              block_tables: np.ndarray, context_lens: np.ndarray,
                              query_start_loc: np.ndarray, scale: float | None = None,
                              window: int = 0, softcap: float = 0.0) -> np.ndarray:
    """The ground truth: gathers each sequence's past from the pool and attends, in float64.

    Args: as in the module docstring.
    """
    batch = PagedBatch(np.asarray(block_tables), np.asarray(context_lens), np.asarray(query_start_loc))
    check_inputs(query, key, value, key_cache, value_cache, batch, window)
    heads, head_dim = query.shape[1:]
    groups = heads // key.shape[1]
    block_size = key_cache.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    if softcap < 0:
        raise LlmcError(f"paged_attention: softcap must be ≥ 0 (0: none), got {softcap}")
    output = np.zeros(query.shape, np.float64)
    for s in range(batch.num_seqs):
        begin, end = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
        if begin == end:
            continue  # a sequence with nothing new this step
        past = int(batch.context_lens[s])
        # Slots before the window's first block are never read: their table entries may be stale.
        # They stay in `keys` as zeros, masked below, so that column j is position j.
        slots = np.arange(first_visible_block(past, window, block_size) * block_size, past)
        blocks = batch.block_tables[s, slots // block_size]
        cached_k = np.zeros((past, *key.shape[1:]), key_cache.dtype)
        cached_v = np.zeros_like(cached_k)
        cached_k[slots], cached_v[slots] = key_cache[blocks, :, slots % block_size], value_cache[blocks, :, slots % block_size]
        # [past + new, kv_heads, head_dim]
        keys = np.concatenate([cached_k, key[begin:end]]).astype(np.float64)
        values = np.concatenate([cached_v, value[begin:end]]).astype(np.float64)
        keys, values = np.repeat(keys, groups, axis=1), np.repeat(values, groups, axis=1)
        q = query[begin:end].astype(np.float64)
        scores = np.einsum("qhd,khd->hqk", q, keys) * scale
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        new = end - begin
        distance = past + np.arange(new)[:, None] - np.arange(past + new)[None, :]
        visible = (distance >= 0) & (distance < window if window else True)
        scores = np.where(visible[None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        output[begin:end] = np.einsum("hqk,khd->qhd", probs, values)
    return output.astype(query.dtype)


def _dims(array: np.ndarray, rank: int, name: str) -> tuple[int, ...]:
    if array.ndim != rank:
        raise LlmcError(f"paged_attention: {name} must be {rank}-D, got shape {array.shape}")
    return array.shape
