"""Check the paged-attention kernel on an NVIDIA GPU as TensorRT will run it, without TensorRT.

Needs torch with CUDA and triton; no TensorRT and no network (scripts/gpu_check.sh runs it, then
the TensorRT checks where TensorRT is installed):

    python scripts/gpu_check.py              # full grid + timing, a few minutes
    python scripts/gpu_check.py --quick      # smaller grid, ~2 minutes

On CPU, with Triton's interpreter (no GPU): ``--cpu-interpret --quick`` (JIT and made-up metadata
only: the AOT part loads PTX through the CUDA driver).

1. JIT: the kernel launched by Triton (``paged_attention_triton``) against the NumPy reference:
   block sizes 1..256 and head_dim 64/128, each paired with GQA ratios 1/2/4/8 and fp16/bf16/fp32
   in rotation (each pairing is one compile, so the grid covers each value rather than the
   product), on a mix of prefill chunks and decodes, decodes only, and the mix under a sliding
   window with soft-capping.
2. AOT: the PTX the plugin's aot_impl hands TensorRT (`tensorrt_plugin.aot_kernel`, for this GPU
   and for sm_80 as a ``--hardware-compatible`` engine holds it), loaded through the CUDA driver
   (libcuda through ctypes: cuModuleLoadData, cuModuleGetFunction, cuLaunchKernel) and launched
   as TensorRT launches it: input pointers, the int32 scalars, the output pointer, with the grid,
   block and shared memory of `tensorrt_plugin.launch_params` and no cuFuncSetAttribute; fp16,
   bf16, fp32, a pool of another type, int32 and int64 metadata. Prints each PTX's ``.version``
   and ``.target`` and the driver's CUDA version. These are the functions aot_impl calls; that
   aot_impl hands TensorRT exactly their kernel, grid and scalars is checked without a GPU, through
   TensorRT 11.4's own tensorrt.plugin package (tests/plugins/test_tensorrt_plugin_package.py).
3. Made-up metadata, as TensorRT times plugins on: query_start_loc, context lengths and block
   tables out of the contract (extremes and near misses), every tensor surrounded by NaN and the
   output by a sentinel; the kernel must finish, write only finite values and touch nothing
   outside. Each seed runs in a subprocess: an illegal address ends the CUDA context, not the check.
4. Timing: decode of 32 sequences (32 query heads, 8 kv heads, head_dim 128, fp16, block 16) at
   contexts 128..4096 against dense torch SDPA over contiguous K/V.

Tolerances (max abs error against the float64 reference of the same rounded inputs): fp32 1e-4,
fp16 5e-3, bf16 3e-2. Exits 1 on any failure, 2 when there is nothing to run on.

What this cannot check: TensorRT itself (its parser, builder, tactic timing, the engine's own
launch of the stored PTX); scripts/gpu_check_tensorrt.py does, where TensorRT is installed.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-interpret", action="store_true",
                        help="run on CPU tensors with TRITON_INTERPRET=1 (no GPU needed)")
    parser.add_argument("--quick", action="store_true", help="a small grid and short timing")
    parser.add_argument("--no-timing", action="store_true", help="accuracy only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--made-up-metadata", type=int, metavar="CASES", default=0,
                        help="only run CASES made-up-metadata launches in this process (the check "
                             "runs this in subprocesses)")
    return parser.parse_args(argv)


TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIXED = ((37, 0), (1, 300), (17, 130), (1, 1), (64, 64))   # (new tokens, past tokens) per sequence
DECODE = ((1, 515), (1, 0), (1, 77), (1, 256))
# (query type, pool type, metadata type): every float type, a pool of another one, both index types.
AOT_CASES = (("float16", "float16", "int32"), ("bfloat16", "bfloat16", "int64"),
             ("float32", "float32", "int32"), ("float16", "float32", "int64"))
MADE_UP_SEEDS = 2


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


def make_batch(torch, rng, seqs, block_size, head_dim, gqa, dtype, device, kv_heads=2,
               pool_dtype=None, index_dtype="int32"):
    """Random inputs on `device` and their float32 NumPy copies for the reference."""
    import numpy as np

    heads = kv_heads * gqa
    max_blocks = max(1, max(-(-past // block_size) for _, past in seqs))
    num_blocks = len(seqs) * max_blocks + 5
    tokens = sum(new for new, _ in seqs)

    def rand(kind, *shape):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(getattr(torch, kind))

    pool = pool_dtype or dtype
    index = getattr(torch, index_dtype)
    tensors = dict(
        query=rand(dtype, tokens, heads, head_dim), key=rand(dtype, tokens, kv_heads, head_dim),
        value=rand(dtype, tokens, kv_heads, head_dim),
        key_cache=rand(pool, num_blocks, kv_heads, block_size, head_dim),
        value_cache=rand(pool, num_blocks, kv_heads, block_size, head_dim),
        block_tables=torch.from_numpy(rng.permutation(num_blocks)[:len(seqs) * max_blocks]
                                      .reshape(len(seqs), max_blocks)).to(index),
        context_lens=torch.tensor([past for _, past in seqs], dtype=index),
        query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum([n for n, _ in seqs])]), dtype=index),
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


class CudaDriver:
    """The CUDA driver API through ctypes: what TensorRT does with a plugin's PTX. Uses the
    context torch made current on this thread."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]

    def check(self, result: int, call: str) -> None:
        if result:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"{call}: {name.value.decode() if name.value else result}")

    def version(self) -> str:
        """The newest CUDA this driver supports, "13.0"."""
        version = ctypes.c_int()
        self.check(self.lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        return f"{version.value // 1000}.{version.value % 1000 // 10}"

    def load(self, ptx: str, name: str) -> ctypes.c_void_p:
        """The kernel `name` of PTX text, compiled by the driver for this GPU."""
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), ptx.encode()), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
                   "cuModuleGetFunction")
        return function

    def launch(self, function, launch, stream: int, args: list) -> None:
        """One launch with `tensorrt_plugin.Launch`'s grid, block and shared memory."""
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        self.check(self.lib.cuLaunchKernel(function, launch.grid[0], launch.grid[1], 1, launch.block_x, 1, 1,
                                           launch.shared_mem, stream, params, None), "cuLaunchKernel")


def kernel_args(inputs: list[int], scalars, outputs: list[int]) -> list:
    """The kernel's parameters in TensorRT's AOT launch order: input pointers, int32 scalars,
    output pointers (as ctypes values for cuLaunchKernel)."""
    for value in scalars:
        if not -2**31 <= value < 2**31:
            raise ValueError(f"extra argument {value} does not fit int32")
    return ([ctypes.c_uint64(p) for p in inputs] + [ctypes.c_int32(int(v)) for v in scalars]
            + [ctypes.c_uint64(p) for p in outputs])


def aot_launch(torch, driver, inputs: dict, kernel: dict, cfg, out) -> None:
    """Launch the AOT kernel on CUDA tensors as TensorRT would, and wait for it."""
    from llmc.plugins.tensorrt_plugin import INPUT_NAMES, launch_params

    tensors = [inputs[name] for name in INPUT_NAMES]
    launch = launch_params(cfg, kernel, [tuple(t.shape) for t in tensors])
    function = driver.load(kernel["ptx"], kernel["name"])
    driver.launch(function, launch, torch.cuda.current_stream().cuda_stream,
                  kernel_args([t.data_ptr() for t in tensors], launch.extra_args, [out.data_ptr()]))
    torch.cuda.synchronize()


def ptx_line(ptx: str, directive: str) -> str:
    return next((line.split()[1] for line in ptx.splitlines() if line.startswith(f".{directive} ")), "?")


def compile_aot(query: str, pool: str, index: str, head_dim: int, gqa: int, block_size: int,
                capability: int, window: int = 0, softcap: float = 0.0, kv_heads: int = 2):
    from llmc.plugins import tensorrt_plugin as tp

    index_types = dict.fromkeys(tp.INPUT_NAMES[5:], tp.INDEX_TYPES[index])
    return tp.aot_kernel(tp.FLOAT_TYPES[query], tp.FLOAT_TYPES[pool], index_types,
                         num_heads=kv_heads * gqa, num_kv_heads=kv_heads, head_dim=head_dim,
                         block_size=block_size, scale=head_dim ** -0.5, capability=capability,
                         window=window, softcap=softcap)


def check_aot(torch, args) -> list[str]:
    import numpy as np

    from llmc.plugins import tensorrt_plugin as tp
    from llmc.plugins.cuda_device import current_gpu
    from llmc.plugins.paged_attention import paged_attention_reference

    driver = CudaDriver()
    gpu = tp.ptx_capability()
    print(f"\nAOT: PTX as TensorRT stores it, through the CUDA driver {driver.version()} ({current_gpu()['name']})")
    print(f"{'case':<44} {'target':>8} {'.version':>8} {'max_err':>9}  ok")
    rng = np.random.default_rng(args.seed)
    cases = [(*case, gpu, {}) for case in AOT_CASES]
    cases += [("float16", "float16", "int32", tp.HARDWARE_COMPATIBLE_CAPABILITY, {}),  # --hardware-compatible
              ("bfloat16", "bfloat16", "int32", gpu, {"window": 7, "softcap": 30.0})]
    failures = []
    for query, pool, index, capability, extra in cases:
        inputs, host = make_batch(torch, rng, MIXED, 16, 128, 4, query, "cuda", pool_dtype=pool, index_dtype=index)
        label = f"{query} {pool} pool, {index}, sm_{capability}" + "".join(f", {k} {v}" for k, v in extra.items())
        try:
            cfg, kernel = compile_aot(query, pool, index, 128, 4, 16, capability, **extra)
            out = torch.full_like(inputs["query"], float("nan"))
            aot_launch(torch, driver, inputs, kernel, cfg, out)
        except Exception as exc:  # a refused PTX or launch fails this case, not the whole check
            failures.append(f"AOT {label}: {type(exc).__name__}: {exc}")
            print(f"{label:<44} BAD: {type(exc).__name__}: {exc}")
            continue
        want = paged_attention_reference(**host, **extra)
        got = out.float().cpu().numpy()
        err = float(np.abs(got - want).max())
        ok = err <= TOLERANCE[query] and np.isfinite(got).all()
        if not ok:
            failures.append(f"AOT {label}: max abs error {err:.3g} > {TOLERANCE[query]}")
        print(f"{label:<44} {ptx_line(kernel['ptx'], 'target'):>8} {ptx_line(kernel['ptx'], 'version'):>8} "
              f"{err:>9.2e}  {'ok' if ok else 'BAD'}")
    return failures


def made_up_metadata(rng, seqs: int, max_blocks: int, tokens: int, blocks: int, block_size: int, index_dtype):
    """block_tables, context_lens, query_start_loc outside the op's contract: type extremes and
    near misses (one past the pool, the table, the tokens; decreasing offsets)."""
    import numpy as np

    info = np.iinfo(index_dtype)
    extremes = np.array([info.min, -2**31, -1, 0, 1, 2**31 - 1, info.max], index_dtype)

    def draw(n, near):
        values = np.where(rng.random(n) < 0.5, rng.integers(-3, near + 4, n), rng.choice(extremes, n))
        return values.astype(index_dtype)

    return (draw(seqs * max_blocks, blocks).reshape(seqs, max_blocks),
            draw(seqs, max_blocks * block_size), draw(seqs + 1, tokens))


def run_made_up_metadata(torch, args, device) -> int:
    """--made-up-metadata CASES: fp16 launches on made-up metadata in this process (JIT; on CUDA
    also the AOT PTX); 0 when each stays inside its tensors and writes finite values."""
    import numpy as np

    from llmc.plugins.paged_attention_triton import paged_attention_triton

    rng = np.random.default_rng(args.seed)
    heads, kv_heads, head_dim, block_size, sentinel = 4, 2, 64, 16, 1000.0
    margin = 2 * kv_heads * block_size * head_dim
    compiled = {}
    if device == "cuda":
        from llmc.plugins.tensorrt_plugin import ptx_capability
        driver = CudaDriver()

    def guarded(shape, fill):
        """A view into a buffer with `margin` elements of `fill` on each side."""
        size = int(np.prod(shape))
        flat = torch.full((size + 2 * margin,), fill, dtype=torch.float16, device=device)
        return flat, flat[margin:margin + size].view(shape)

    for case in range(args.made_up_metadata):
        seqs, max_blocks = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        tokens, blocks = int(rng.integers(0, 41)), int(rng.integers(0, 6))
        index_dtype = (np.int32, np.int64)[case % 2]
        inputs = {}
        for name, shape in (("query", (tokens, heads, head_dim)), ("key", (tokens, kv_heads, head_dim)),
                            ("value", (tokens, kv_heads, head_dim)),
                            ("key_cache", (blocks, kv_heads, block_size, head_dim)),
                            ("value_cache", (blocks, kv_heads, block_size, head_dim))):
            inputs[name] = guarded(shape, float("nan"))[1]
            inputs[name].copy_(torch.randn(shape))
        metadata = made_up_metadata(rng, seqs, max_blocks, tokens, blocks, block_size, index_dtype)
        for name, array in zip(("block_tables", "context_lens", "query_start_loc"), metadata):
            inputs[name] = torch.from_numpy(array).to(device)
        runs = [("jit", lambda out: paged_attention_triton(**inputs, out=out))]
        if device == "cuda":
            index = np.dtype(index_dtype).name
            if index not in compiled:
                compiled[index] = compile_aot("float16", "float16", index, head_dim, heads // kv_heads, block_size,
                                              ptx_capability(), kv_heads=kv_heads)
            cfg, kernel = compiled[index]
            runs.append(("aot", lambda out: aot_launch(torch, driver, inputs, kernel, cfg, out)))
        for path, run in runs:
            buffer, out = guarded((tokens, heads, head_dim), sentinel)
            out.zero_()
            run(out)
            if device == "cuda":
                torch.cuda.synchronize()
            outside = torch.cat([buffer[:margin], buffer[margin + out.numel():]])
            problem = ("a read outside a tensor" if not torch.isfinite(out).all()
                       else "a write outside the output" if not (outside == sentinel).all() else None)
            if problem:
                print(f"made-up metadata case {case} ({path}): {problem}; metadata {[a.tolist() for a in metadata]}")
                return 1
    print(f"made-up metadata: {args.made_up_metadata} cases inside every tensor")
    return 0


def check_made_up_metadata(args, cases: int) -> list[str]:
    """Each seed in a subprocess: a crash or an illegal address fails that seed only."""
    failures = []
    for seed in range(args.seed, args.seed + MADE_UP_SEEDS):
        command = [sys.executable, __file__, "--made-up-metadata", str(cases), "--seed", str(seed)]
        if args.cpu_interpret:
            command.append("--cpu-interpret")
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
            detail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            status = done.returncode
        except subprocess.TimeoutExpired:
            status, detail = "timeout", ["did not finish in 300 s (a loop over made-up lengths?)"]
        print(f"made-up metadata, seed {seed}: {'ok' if status == 0 else f'BAD ({status})'} {detail[0]}")
        if status != 0:
            failures.append(f"made-up metadata seed {seed}: {status} {detail[0]}")
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
        torch.zeros(1, device=device)  # the primary context, current on this thread for the driver calls
    else:
        print("gpu_check: no CUDA device; use --cpu-interpret", file=sys.stderr)
        return 2
    if args.made_up_metadata:
        return run_made_up_metadata(torch, args, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(f"gpu_check: {name}, torch {torch.__version__}, triton {triton.__version__}")
    start = time.perf_counter()
    failures = check_accuracy(torch, args, device)
    if device == "cuda":
        failures += check_aot(torch, args)
    else:
        print("\nSKIP AOT: the PTX is loaded by the CUDA driver (no CUDA device)")
    failures += check_made_up_metadata(args, cases=10 if args.cpu_interpret else 40)
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
