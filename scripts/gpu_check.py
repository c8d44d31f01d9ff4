"""Check the Triton paged-attention kernel against the NumPy reference, then time decode.

On a machine with an NVIDIA GPU, torch and triton (TensorRT is not needed):

    python scripts/gpu_check.py              # full grid + timing, a few minutes
    python scripts/gpu_check.py --quick      # smaller grid

On CPU, with Triton's interpreter (no GPU): ``--cpu-interpret --quick``.

Accuracy: every block size 1..256 and head_dim 64/128, each paired with GQA ratios 1/2/4/8 and
fp16/bf16/fp32 in rotation (each distinct pairing is one Triton compile, so the grid is a
covering design rather than a full product), on two batches each: a mix of prefill chunks and
decode tokens, and decode only. Tolerances (max abs error against the float64 reference of the
same rounded inputs): fp32 1e-4, fp16 5e-3, bf16 3e-2.

Timing: decode of 32 sequences (32 query heads, 8 kv heads, head_dim 128, fp16, block 16) at
contexts 128..4096 against dense torch SDPA over contiguous K/V — the speed a paged kernel pays
its indirection against. Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-interpret", action="store_true",
                        help="run on CPU tensors with TRITON_INTERPRET=1 (no GPU needed)")
    parser.add_argument("--quick", action="store_true", help="a small grid and short timing")
    parser.add_argument("--no-timing", action="store_true", help="accuracy only")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIXED = ((37, 0), (1, 300), (17, 130), (1, 1), (64, 64))   # (new tokens, past tokens) per sequence
DECODE = ((1, 515), (1, 0), (1, 77), (1, 256))


def grid(quick: bool, cpu: bool):
    """(block_size, head_dim, gqa, dtype) cases covering each value of every factor."""
    if cpu:
        return [(1, 64, 1, "float32"), (16, 64, 2, "float16"), (8, 64, 4, "float32")]
    ratios, dtypes = (1, 2, 4, 8), ("float16", "bfloat16", "float32")
    block_sizes = (1, 16, 256) if quick else BLOCK_SIZES
    cases = []
    for i, (block_size, head_dim) in enumerate(itertools.product(block_sizes, (64, 128))):
        cases.append((block_size, head_dim, ratios[i % 4], dtypes[i % 3]))
    return cases


def make_batch(torch, rng, seqs, block_size, head_dim, gqa, dtype, device, kv_heads=2):
    """Random inputs on `device` and their float32 NumPy copies for the reference."""
    import numpy as np

    heads = kv_heads * gqa
    max_blocks = max(1, max(-(-past // block_size) for _, past in seqs))
    num_blocks = len(seqs) * max_blocks + 5
    tokens = sum(new for new, _ in seqs)
    tdtype = getattr(torch, dtype)

    def rand(*shape):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(tdtype)

    tensors = dict(
        query=rand(tokens, heads, head_dim), key=rand(tokens, kv_heads, head_dim),
        value=rand(tokens, kv_heads, head_dim),
        key_cache=rand(num_blocks, kv_heads, block_size, head_dim),
        value_cache=rand(num_blocks, kv_heads, block_size, head_dim),
        block_tables=torch.from_numpy(rng.permutation(num_blocks)[:len(seqs) * max_blocks]
                                      .reshape(len(seqs), max_blocks).astype(np.int32)),
        context_lens=torch.tensor([past for _, past in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum([n for n, _ in seqs])]),
                                     dtype=torch.int32),
    )
    host = {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in tensors.items()}
    return {k: v.to(device) for k, v in tensors.items()}, host


def check_accuracy(torch, args, device) -> list[str]:
    import numpy as np

    from llmc.plugins.paged_attention import paged_attention_reference
    from llmc.plugins.paged_attention_triton import paged_attention_triton

    rng = np.random.default_rng(args.seed)
    failures, rows = [], []
    for block_size, head_dim, gqa, dtype in grid(args.quick, args.cpu_interpret):
        # "window": the mixed batch under a sliding window of 7 with soft-capping (Gemma-2).
        for name, seqs, extra in (("mixed", MIXED, {}), ("decode", DECODE, {}),
                                  ("window", MIXED, {"window": 7, "softcap": 30.0})):
            if args.cpu_interpret:  # keep the interpreter quick: shorter pasts
                seqs = tuple((min(new, 9), min(past, 40)) for new, past in seqs)
            inputs, host = make_batch(torch, rng, seqs, block_size, head_dim, gqa, dtype, device)
            start = time.perf_counter()
            got = paged_attention_triton(**inputs, **extra).float().cpu().numpy()
            seconds = time.perf_counter() - start
            want = paged_attention_reference(**host, **extra).astype(np.float64)
            err = float(np.abs(got - want).max())
            ok = err <= TOLERANCE[dtype] and np.isfinite(got).all()
            rows.append((block_size, head_dim, gqa, dtype, name, err, ok, seconds))
            if not ok:
                failures.append(f"block {block_size} head_dim {head_dim} gqa {gqa} {dtype} "
                                f"{name}: max abs error {err:.3g} > {TOLERANCE[dtype]}")
    print(f"{'block':>5} {'dim':>4} {'gqa':>3} {'dtype':>8} {'batch':>6} {'max_err':>9}  ok  "
          f"first-call s")
    for block_size, head_dim, gqa, dtype, name, err, ok, seconds in rows:
        print(f"{block_size:>5} {head_dim:>4} {gqa:>3} {dtype:>8} {name:>6} {err:>9.2e}  "
              f"{'ok' if ok else 'BAD'}  {seconds:.2f}")
    return failures


def bench(torch, fn, device, iters):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    else:
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    times.sort()
    return times[len(times) // 2]


def time_decode(torch, args, device) -> None:
    import numpy as np

    from llmc.plugins.paged_attention_triton import paged_attention_triton

    if args.cpu_interpret:
        seqs, heads, kv_heads, head_dim, contexts, iters = 2, 4, 2, 64, (16, 48), 2
    else:
        seqs, heads, kv_heads, head_dim = 32, 32, 8, 128
        contexts, iters = ((128, 1024, 4096) if args.quick else (128, 256, 512, 1024, 2048, 4096),
                           20 if args.quick else 50)
    block_size, dtype = 16, torch.float16 if device == "cuda" else torch.float32
    rng = np.random.default_rng(args.seed)
    print(f"\ndecode: {seqs} seqs, {heads}/{kv_heads} heads, head_dim {head_dim}, block "
          f"{block_size}, {str(dtype).split('.')[-1]}; median µs over {iters} runs")
    print(f"{'context':>7} {'paged µs':>9} {'sdpa µs':>9} {'paged/sdpa':>10} {'paged GB/s':>10}")
    for context in contexts:
        blocks_per_seq = -(-context // block_size)
        num_blocks = seqs * blocks_per_seq
        table = torch.from_numpy(rng.permutation(num_blocks).reshape(seqs, blocks_per_seq)
                                 .astype(np.int32)).to(device)
        pool = lambda: torch.randn(num_blocks, kv_heads, block_size, head_dim, dtype=dtype,
                                   device=device)
        key_cache, value_cache = pool(), pool()
        q = torch.randn(seqs, heads, head_dim, dtype=dtype, device=device)
        k = torch.randn(seqs, kv_heads, head_dim, dtype=dtype, device=device)
        v = torch.randn_like(k)
        lens = torch.full((seqs,), context, dtype=torch.int32, device=device)
        starts = torch.arange(seqs + 1, dtype=torch.int32, device=device)
        paged = bench(torch, lambda: paged_attention_triton(q, k, v, key_cache, value_cache,
                                                             table, lens, starts), device, iters)
        # Dense baseline: each sequence's past + new token contiguous, [B, kv_heads, L, D].
        dense_k = torch.randn(seqs, kv_heads, context + 1, head_dim, dtype=dtype, device=device)
        dense_v = torch.randn_like(dense_k)
        dense_q = q.unsqueeze(2)
        sdpa = bench(torch, lambda: torch.nn.functional.scaled_dot_product_attention(
            dense_q, dense_k, dense_v, enable_gqa=True), device, iters)
        kv_bytes = 2 * seqs * kv_heads * (context + 1) * head_dim * q.element_size()
        print(f"{context:>7} {paged:>9.1f} {sdpa:>9.1f} {paged / sdpa:>10.2f} "
              f"{kv_bytes / paged / 1e3:>10.0f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    import torch

    try:
        import triton
    except ImportError:
        print("gpu_check: triton is not installed (pip install -e '.[gpu]')", file=sys.stderr)
        return 2
    if args.cpu_interpret:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("gpu_check: no CUDA device; use --cpu-interpret", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(f"gpu_check: {name}, torch {torch.__version__}, triton {triton.__version__}")
    start = time.perf_counter()
    failures = check_accuracy(torch, args, device)
    if not args.no_timing:
        time_decode(torch, args, device)
    print(f"\n{time.perf_counter() - start:.0f} s")
    if failures:
        print(f"\nFAILED: {len(failures)} case(s)\n  " + "\n  ".join(failures))
        return 1
    print("all cases match the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
