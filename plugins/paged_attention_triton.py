"""The paged-attention op (``llmc::paged_attention``) as a Triton kernel.

Implements exactly the contract of :mod:`llmc.plugins.paged_attention` (whose NumPy
``paged_attention_reference`` is the ground truth): a packed ragged batch of prefill chunks and
decode tokens, past keys/values read in place from the block pool through the block table, causal
attention over each sequence's new tokens, grouped-query attention, online softmax with fp32
accumulators, fp16/bf16/fp32 inputs.

One kernel serves two callers: :func:`paged_attention_triton` launches it on torch tensors (JIT),
and :mod:`llmc.plugins.tensorrt_plugin` compiles it ahead of time to PTX for a TensorRT engine.
Its runtime parameters are therefore ordered the way TensorRT's AOT plugins launch a kernel:
the op's inputs, then the int32 scalars, then the output. Everything that is fixed when an engine
is built (heads, head size, block size, scale, tile sizes) is a compile-time constant, and every
tensor is taken as contiguous, so strides follow from shapes.

Work split: program (i, kv_head) handles BLOCK_Q consecutive new tokens of one sequence times all
query heads that share kv_head (BLOCK_M = BLOCK_Q * GROUPS_P2 rows for one tensor-core tile).
Sequences are ragged, so the grid is the upper bound ``T // BLOCK_Q + num_seqs + 1`` programs
along axis 0 (never zero: an empty batch is still a valid launch); each finds its sequence by
binary search over query_start_loc, and surplus programs exit.

The pools may hold another float type than query (``--kv-cache-dtype``): what is read from them is
cast to the query's type, as the reference reads any pool type.

Metadata outside the contract never makes the kernel read or write outside its tensors or loop
past them: TensorRT times plugins on made-up input values while building. query_start_loc
entries are clamped into [0, num_tokens] and each sequence's end to no less than its start,
context lengths into [0, max_blocks_per_seq * BLOCK_SIZE] (0 with an empty pool), block ids
into [0, num_blocks). Within the contract the clamps change nothing; outside it the output is
unspecified (rows no sequence owns are not written).

``import triton`` is optional: this module imports without it (launching then raises LlmcError),
and nothing in ``llmc.plugins`` imports this module eagerly. Set ``TRITON_INTERPRET=1`` before
the first import of triton to run the kernel on CPU tensors with Triton's interpreter.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from llmc.errors import LlmcError
from llmc.plugins.paged_attention import BLOCK_SIZES

try:
    import triton
    import triton.language as tl
except ImportError:  # the module stays importable; launching explains what is missing
    triton = None
    tl = None

HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class KernelConfig:
    """The compile-time constants of one specialization of the kernel."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    scale: float
    block_q: int
    groups_p2: int
    fp32: bool
    num_warps: int
    block_n: int  # keys per inner-loop tile
    window: int = 0  # sliding window (0: full attention)
    softcap: float = 0.0  # score soft-capping (0: none)

    @property
    def block_m(self) -> int:
        return self.block_q * self.groups_p2

    def constexprs(self) -> dict[str, Any]:
        return {
            "NUM_HEADS": self.num_heads, "NUM_KV_HEADS": self.num_kv_heads,
            "HEAD_DIM": self.head_dim, "BLOCK_SIZE": self.block_size, "SCALE": self.scale,
            "BLOCK_Q": self.block_q, "GROUPS_P2": self.groups_p2, "BLOCK_N": self.block_n,
            "WINDOW": self.window, "SOFTCAP": self.softcap,
            # fp32 inputs get exact fp32 products; TF32 would miss the reference by ~1e-3.
            "DOT_PRECISION": "ieee" if self.fp32 else "tf32",
        }

    def num_programs(self, num_tokens, num_seqs):
        """Axis-0 grid size: an upper bound on the query tiles of any packing of the batch, at
        least 1. Ints, or TensorRT's symbolic dimensions (only // and + are used)."""
        return num_tokens // self.block_q + num_seqs + 1


def kernel_config(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  scale: float | None, fp32: bool, decode_only: bool = False,
                  max_rows: int = 64, block_n: int = 64, window: int = 0, softcap: float = 0.0) -> KernelConfig:
    """Check the compiled kernel's limits and choose its tile sizes.

    Args:
        num_heads, num_kv_heads, head_dim, block_size: the op's static dimensions.
        scale: softmax scale; None means 1/sqrt(head_dim).
        fp32: whether the inputs are float32 (selects exact fp32 dot products).
        decode_only: every sequence brings one new token, so a tile needs one token.
        max_rows: rows (tokens x grouped heads) per tile when prefilling; fewer rows need less
            shared memory.
        block_n: keys per inner-loop tile (16, 32 or 64); 64 keeps the fp32 scores and a
            [64, 128] accumulator in registers, smaller tiles need less shared memory.
        window: the sliding window (0: full attention), a compile-time constant like the scale.
        softcap: score soft-capping c·tanh(s / c) (0: none), a compile-time constant too.
    """
    if softcap < 0:
        raise LlmcError(f"paged_attention_triton: softcap must be ≥ 0 (0: none), got {softcap}")
    if window < 0:
        raise LlmcError(f"paged_attention_triton: window must be ≥ 0 (0: full attention), got {window}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise LlmcError(f"paged_attention_triton: {num_heads} query heads is not a multiple of "
                        f"{num_kv_heads} kv heads")
    if head_dim not in HEAD_DIMS:
        raise LlmcError(f"paged_attention_triton: head_dim {head_dim} is not supported "
                        f"(compiled kernels take {HEAD_DIMS})")
    if block_size not in BLOCK_SIZES:
        raise LlmcError(f"paged_attention_triton: block size {block_size} is not supported "
                        f"(powers of two from 1 to 256)")
    groups_p2 = 1 << (num_heads // num_kv_heads - 1).bit_length()
    # tl.dot wants at least 16 rows; decode fills them with query heads, prefill with tokens.
    rows = max(16 if decode_only else max(16, max_rows), groups_p2)
    block_q = rows // groups_p2
    return KernelConfig(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        block_size=block_size,
                        scale=float(head_dim ** -0.5 if scale is None else scale),
                        block_q=block_q, groups_p2=groups_p2, fp32=fp32,
                        num_warps=4 if rows * head_dim <= 64 * 64 else 8, block_n=block_n, window=window,
                        softcap=float(softcap))


def _paged_attention_kernel(
    query, key, value, key_cache, value_cache, block_tables, context_lens, query_start_loc,
    num_seqs, max_blocks_per_seq, num_tokens, num_blocks,
    output,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SCALE: tl.constexpr, BLOCK_Q: tl.constexpr,
    GROUPS_P2: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    GROUPS: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUPS_P2
    LOG2E: tl.constexpr = 1.4426950408889634
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The sequence owning tile `pid`: the last s with start(s) // BLOCK_Q + s <= pid, where
    # start(s) is query_start_loc[s] clamped into [0, num_tokens] (see the module docstring).
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.minimum(tl.maximum(tl.load(query_start_loc + mid), 0), num_tokens).to(tl.int32)
        if start // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    found = lo > 0  # false only for made-up metadata (or no sequence at all)
    seq = tl.maximum(lo - 1, 0)
    seq_begin = tl.load(query_start_loc + seq, mask=found, other=0)
    seq_begin = tl.minimum(tl.maximum(seq_begin, 0), num_tokens).to(tl.int32)
    seq_end = tl.load(query_start_loc + seq + 1, mask=found, other=0)
    seq_new = tl.minimum(tl.maximum(seq_end, seq_begin), num_tokens).to(tl.int32) - seq_begin
    tile = pid - (seq_begin // BLOCK_Q + seq)
    if (tile >= 0) & (tile * BLOCK_Q < seq_new):
        past = tl.load(context_lens + seq)
        past = tl.minimum(tl.maximum(past, 0), max_blocks_per_seq * BLOCK_SIZE).to(tl.int32)
        past = tl.where(num_blocks > 0, past, 0)

        rows = tl.arange(0, BLOCK_M)
        row_token = tile * BLOCK_Q + rows // GROUPS_P2  # within the sequence's new tokens
        row_head = kv_head * GROUPS + rows % GROUPS_P2
        row_ok = (row_token < seq_new) & (rows % GROUPS_P2 < GROUPS)
        dims = tl.arange(0, HEAD_DIM)
        q_offs = ((seq_begin + row_token).to(tl.int64) * (NUM_HEADS * HEAD_DIM)
                  + row_head * HEAD_DIM)[:, None] + dims[None, :]
        q = tl.load(query + q_offs, mask=row_ok[:, None], other=0.0)

        # Finite start so a row with nothing visible yet never computes inf - inf.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        qk_scale = SCALE * LOG2E

        # The past, read in place: slot j is cache[block_tables[seq, j // BLOCK_SIZE], kv_head,
        # j % BLOCK_SIZE]. Every new token sees all of it, or with a window W the slots after
        # its position - W: the loop starts at the tile's first token's window, and table entries
        # before it are never read (the runtime may have freed those blocks).
        table_row = block_tables + seq.to(tl.int64) * max_blocks_per_seq
        row_pos = past + row_token  # each row's position in its sequence
        past_lo = past * 0
        if WINDOW > 0:
            past_lo = tl.maximum(past + tile * BLOCK_Q - WINDOW + 1, 0)
        for start in range(past_lo, past, BLOCK_N):
            slots = start + tl.arange(0, BLOCK_N)
            slot_ok = slots < past
            blocks = tl.load(table_row + slots // BLOCK_SIZE, mask=slot_ok, other=0)
            blocks = tl.minimum(tl.maximum(blocks, 0), num_blocks - 1).to(tl.int64)
            kv_offs = ((blocks * NUM_KV_HEADS + kv_head) * BLOCK_SIZE + slots % BLOCK_SIZE) * HEAD_DIM
            kv_offs = kv_offs[:, None] + dims[None, :]
            k = tl.load(key_cache + kv_offs, mask=slot_ok[:, None], other=0.0).to(q.dtype)
            v = tl.load(value_cache + kv_offs, mask=slot_ok[:, None], other=0.0).to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if SOFTCAP > 0:  # c·tanh(s / c) of the scaled score, tanh(x) = 2σ(2x) - 1
                scores = SOFTCAP * (2.0 * tl.sigmoid(scores * (2.0 * SCALE / SOFTCAP)) - 1.0) * LOG2E
            else:
                scores = scores * qk_scale
            seen = slot_ok[None, :]
            if WINDOW > 0:
                seen = seen & (slots[None, :] > row_pos[:, None] - WINDOW)
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.math.exp2(scores - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # The sequence's new tokens, causally: row token t sees new tokens 0..t.
        new_end = tl.minimum(seq_new, (tile + 1) * BLOCK_Q)
        new_lo = new_end * 0
        if WINDOW > 0:
            new_lo = tl.maximum(tile * BLOCK_Q - WINDOW + 1, 0)
        for start in range(new_lo, new_end, BLOCK_N):
            toks = start + tl.arange(0, BLOCK_N)
            tok_ok = toks < new_end
            kv_offs = ((seq_begin + toks).to(tl.int64) * NUM_KV_HEADS + kv_head) * HEAD_DIM
            kv_offs = kv_offs[:, None] + dims[None, :]
            k = tl.load(key + kv_offs, mask=tok_ok[:, None], other=0.0)
            v = tl.load(value + kv_offs, mask=tok_ok[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if SOFTCAP > 0:  # c·tanh(s / c) of the scaled score, tanh(x) = 2σ(2x) - 1
                scores = SOFTCAP * (2.0 * tl.sigmoid(scores * (2.0 * SCALE / SOFTCAP)) - 1.0) * LOG2E
            else:
                scores = scores * qk_scale
            visible = tok_ok[None, :] & (toks[None, :] <= row_token[:, None])
            if WINDOW > 0:
                visible = visible & (toks[None, :] > row_token[:, None] - WINDOW)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.math.exp2(scores - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        # Rows outside the tile have l_i == 0 and are not stored.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(output + q_offs, out.to(output.dtype.element_ty), mask=row_ok[:, None])


@functools.lru_cache(maxsize=None)
def jit_kernel(interpret: bool | None = None):
    """The kernel wrapped by triton.jit (an interpreted function under TRITON_INTERPRET=1).

    Args:
        interpret: None follows triton's knob; False forces a compilable JITFunction (the AOT
            path compiles it to PTX even when this process interprets).
    """
    require_triton()
    if interpret is False:
        from triton.runtime.jit import JITFunction
        return JITFunction(_paged_attention_kernel)
    return triton.jit(_paged_attention_kernel)


def require_triton() -> None:
    if triton is None:
        raise LlmcError("paged_attention_triton needs triton: pip install 'llmc[gpu]' "
                        "(or pip install triton) on a machine with an NVIDIA GPU")


def interpreting() -> bool:
    """Whether triton runs kernels with its CPU interpreter here (TRITON_INTERPRET=1, which triton
    reads when it wraps a kernel), so that tensors live in host memory."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def paged_attention_triton(query, key, value, key_cache, value_cache, block_tables, context_lens,
                           query_start_loc, scale: float | None = None, window: int = 0,
                           softcap: float = 0.0, out=None):
    """Run the op on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1); returns ``output``.

    Checks shapes and limits without reading device data; metadata values are not checked but
    clamped by the kernel (module docstring; ``llmc.plugins.paged_attention.check_inputs``
    validates them on the host when wanted).

    Args: as in :mod:`llmc.plugins.paged_attention`; scale defaults to 1/sqrt(head_dim), window
    to 0 (full attention), softcap to 0 (none); out: a contiguous tensor shaped and typed like
    query to write into (default: a new one).
    """
    import torch

    require_triton()
    if query.ndim != 3 or key.ndim != 3 or key.shape != value.shape:
        raise LlmcError(f"paged_attention_triton: query {tuple(query.shape)}, key "
                        f"{tuple(key.shape)} and value {tuple(value.shape)} must be 3-D, "
                        f"key and value equal")
    tokens, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    if key.shape[0] != tokens or key.shape[2] != head_dim:
        raise LlmcError(f"paged_attention_triton: key {tuple(key.shape)} does not match query "
                        f"{tuple(query.shape)}")
    if key_cache.shape != value_cache.shape or key_cache.ndim != 4 \
            or key_cache.shape[1] != kv_heads or key_cache.shape[3] != head_dim:
        raise LlmcError(f"paged_attention_triton: pools {tuple(key_cache.shape)} / "
                        f"{tuple(value_cache.shape)} must both be [blocks, {kv_heads}, "
                        f"block_size, {head_dim}]")
    floats = (torch.float16, torch.bfloat16, torch.float32)
    if len({query.dtype, key.dtype, value.dtype}) != 1 or query.dtype not in floats \
            or key_cache.dtype != value_cache.dtype or key_cache.dtype not in floats:
        raise LlmcError(f"paged_attention_triton: query, key and value must share one of float16/bfloat16/"
                        f"float32 and the pools one too, got {query.dtype}, {key.dtype}, {value.dtype} "
                        f"and {key_cache.dtype}, {value_cache.dtype}")
    num_seqs = context_lens.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs \
            or tuple(query_start_loc.shape) != (num_seqs + 1,):
        raise LlmcError(f"paged_attention_triton: {num_seqs} sequences but block_tables "
                        f"{tuple(block_tables.shape)} and query_start_loc "
                        f"{tuple(query_start_loc.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens),
                    ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise LlmcError(f"paged_attention_triton: {name} must be int32 or int64, got {t.dtype}")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise LlmcError(f"paged_attention_triton: out must be a contiguous {query.dtype} tensor of "
                        f"shape {tuple(query.shape)}, got {out.dtype} {tuple(out.shape)}")
    cfg = kernel_config(heads, kv_heads, head_dim, key_cache.shape[2], scale,
                        fp32=query.dtype == torch.float32, decode_only=tokens == num_seqs, window=window,
                        softcap=softcap)
    if tokens == 0 or num_seqs == 0:
        return out
    args = [t.contiguous() for t in (query, key, value, key_cache, value_cache, block_tables,
                                     context_lens, query_start_loc)]
    grid = (cfg.num_programs(tokens, num_seqs), kv_heads)
    jit_kernel()[grid](*args, num_seqs, block_tables.shape[1], tokens, key_cache.shape[0], out,
                       **cfg.constexprs(), num_warps=cfg.num_warps)
    return out
