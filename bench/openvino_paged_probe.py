"""Can llmc run a paged engine as ONE OpenVINO compiled model whose attention is OpenVINO's own
paged-attention op (`_PagedAttentionExtension`, what OpenVINO GenAI's ContinuousBatchingPipeline
runs), driven by llmc's block tables, and how fast is it? A probe, run before any such backend.

    pip install openvino   # the runtime wheel alone (2026.4.1 here); no llmc extra installs it
    python bench/openvino_paged_probe.py ENGINE [--rounds 3] [--skip-check] [--skip-time]

ENGINE is a paged fp32 engine (`llmc export DIR -o m.onnx; llmc compile m.onnx -o m.plan`). The
probe reads the engine's segments with OpenVINO's ONNX front end, joins them into one ov.Model
(each segment's Parameters rewired to the Outputs that produce those names) and puts a
`_PagedAttentionExtension` where each `llmc::PagedAttention` call was (`paged_model`); it
compiles that for the CPU (INFERENCE_NUM_THREADS 2, NUM_STREAMS 1, LATENCY,
INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION f32 or bf16) and drives it with block tables
handed out from a free list as llmc's block manager does (`Sequences`, `OpenVinoPaged.feeds`).
The check runs the same requests on llmc's packed path (segments + its paged-attention kernel)
and compares logits and greedy tokens; the timing runs each system in a worker process of its
own, alternated round by round, each case's median: "llmc" is the path llmc's step planner picks
(its whole graph for all these steps), "llmc packed" its segments and kernel.

The op, openvino 2026.4.1 (`_PagedAttentionExtension(list of 28 Outputs)`; any other count:
"PagedAttensionExtension expects 28 inputs"). What GenAI's `paged_attention_transformation` feeds
it, read off the transformed SmolLM2 IR, and what this probe feeds it:
   0 query [T, heads·D]   1 key [T, kv heads·D]   2 value [T, kv heads·D]   (llmc's [T, H, D]
     reshaped; the output [T, heads·D] reshaped back)
   3 key_cache, 4 value_cache: per layer, Parameters `key_cache.i`/`value_cache.i`
   5 past_lens i32 [seqs]              = llmc's context_lens
   6 subsequence_begins i32 [seqs+1]   = query_start_loc
   7 block_indices i32 [n]             = each sequence's table row through the block of its last
                                         NEW token (ceil((past + new) / 32) entries), concatenated
   8 block_indices_begins i32 [seqs+1] = their prefix sums
   9 scale f32 scalar   10 sliding_window i32 scalar (0: none)   11 alibi_slopes f32 [0]
  12 max_context_len i32 scalar        = max(past + new)
  13 score_aggregation_window i32 [0]; 14-16 cache rotation (i32 [0], i32 [0], f32 [0]);
  17-19 xattention threshold f32 [0], block size i32 0, stride i32 0; 20 sinks f32 [0,0,0,0];
  21-24 adaptive R-KV (i32 0, i32 [0] x3); 25 token_type_ids i32 [0]; 26 qq_bias u8 [0];
  27 qq_bias_begins i32 [0]
Outputs: the attention ([T, heads·D], the query's type), then scores (f32, filled only when
score aggregation is asked for) and a third for adaptive R-KV; only the first is used. Attribute
write_kv_cache = true: the op itself stores the step's keys and values at slots past + i of the
blocks in block_indices before attending (llmc's op reads the pool and never writes it; its
runtime stores afterwards). No softcap input: llmc's softcap (Gemma-2) has no
counterpart (`paged_model` refuses it); sliding_window exists (llmc's window semantics against
it: unchecked, SmolLM2 has none).

What the CPU plugin wants (found by compiling; the stored sources are older than 2026.4):
- rt_info num_k_heads, k_head_size, num_v_heads, v_head_size on each node, or compile fails:
  "Runtime info k_head_size and num_k_heads are required for PagedAttention node" (GenAI's
  transformation writes them).
- It re-types and re-shapes the cache Parameters at compile time, whatever the model declares:
  block size 32 always (a [8, 3, 16, 64] tensor is refused at set_tensor: "the model input
  (shape=[?,3,32,64]) and the tensor (shape=(8.3.16.64)) are incompatible"); element type from
  KV_CACHE_PRECISION. Float caches are [num_blocks, kv heads, 32, head dim] per layer: llmc's
  pool layout ([2·layers, blocks, kv heads, block, head dim], a layer's keys one contiguous
  view). f32 caches only under f32 compute ("expect kvcache type f32, current: bf16"), bf16 only
  under bf16 ("expect kvcache type bf16, current: f32"); f16 asked under bf16 compute becomes
  bf16, under f32 compute stays f16; u8 (the default for a model that names none): key
  [blocks, kv heads, 32+8, D] (per-channel scale/zero rows), value [blocks, kv heads, 32, D+8]
  (per token); u4: [.., 48, D] and [.., 32, D+16]. optimum's IR carries runtime_options
  KV_CACHE_PRECISION f16, so the GenAI peer below ran bf16 compute over a bf16 cache.
- The caches can be llmc's memory: NumPy arrays (bf16 as uint16) wrapped as ov.Tensor(array,
  shape, type) and bound once with set_tensor; OpenVINO writes each step's keys and values into
  them in place (checked: every block the tables hand out holds keys afterwards).
- A token count the compiled model has not run before costs 4-10 ms more on its first call
  (decode steps of 1-8 sequences at ~100 positions: 22-39 ms first, 15-36 ms after).

Findings, SmolLM2-135M-Instruct fp32 engine, openvino 2026.4.1, onnxruntime 1.32, 2-core AMD EPYC
with AVX-512 + avx512_bf16 (no AMX), 24 GB, nothing else running (load ~1, this probe's own):
- It works with no ONNX conversion extension: 31 segments joined into one model of 3,920 ops,
  30 PagedAttention nodes and 121 FullyConnected, all in the asked precision; compiled in
  1.0-2.6 s (weights converted from ONNX at each load).
- Correctness against llmc's packed path (`--skip-time`): f32 max abs logit difference 1.0e-4
  (one 128-token prompt of python-source.txt and 16 greedy steps: all 17 tokens equal) and
  1.1e-4 (16 prompts of 97-247 tokens packed in one step, then 8 greedy steps of all 16: all 144
  tokens equal). bf16: max abs logit difference 0.49 and 0.84, prompt top-1 16 of 16 equal;
  greedy tokens all equal for the single prompt, and equal through 1-9 of 9 steps (median 9) for
  the 16: some sequences part after a step, as bf16 does; it would need llmc's accuracy gate.

Time per decode step (8 steps in a row, each case 3 rounds x 2 calls) or per whole prompt, ms;
two runs; llmc's onnxruntime figures from the brief's earlier measurement and GenAI's beside:

| case                    | llmc (planner) | llmc packed | OV paged f32 | OV paged bf16 | earlier: llmc / GenAI bf16 |
|-------------------------|----------------|-------------|--------------|---------------|----------------------------|
| decode b1 @150          | 28.4 / 23.3    | 29.3 / 26.9 | 23.5 / 24.8  | 17.0 / 16.3   | 20-22 / 15.5               |
| decode b16 @150-195     | 64.7 / 57.8    | 55.9 / 56.4 | 42.7 / 44.5  | 27.1 / 30.7   | ~44 (static) / 27.7        |
| prefill 128             | 172 / 166      | 178 / 188   | 164 / 157    | 87 / 109      | 155 / 96 (TTFT)            |
| prefill 2048, one call  | 3590 / 3788    | 5330 / 4872 | 3317 / 3291  | 1686 / 1871   | 3700 / 1670 (TTFT)         |
| prefill 2048, 4 x 512   | 3842 / 3857    | 4125 / 3796 | 3334 / 3243  | 1736 / 2056   |                            |
Ratio to llmc in the same run: OV f32 0.83-1.06 (b1), 0.66-0.77 (b16), 0.84-0.96 (prefill);
OV bf16 0.60-0.70 (b1), 0.42-0.53 (b16), 0.45-0.66 (prefill). (`python
bench/openvino_paged_probe.py smol.plan --rounds 3`; the machine moves ±15% between runs.)

What this says:
- One OpenVINO model with its own paged attention reaches OpenVINO GenAI's figures on this
  machine (bf16: 16-17 ms against GenAI's 15.5 for one sequence, 27-31 against 27.7 for 16,
  87-109 ms and 1.7-1.9 s for the 128- and 2,048-token prompts against 96 ms and 1.67 s): GenAI's
  lead is bf16 compute plus one call a step, not its scheduler, and llmc can have it with its own
  block tables and pool.
- At f32 the one-model form already beats llmc's onnxruntime paths on batches (b16 0.66-0.77) and
  slightly on prompts (0.84-0.96); batch 1 is level within the noise (0.83-1.06).
Recommendation: an OpenVINO backend can be built this way, one infer call a step, and is worth
building for bf16 (1.5-2.2x on prompts, 1.9-2.4x on 16-row steps, 1.4-1.7x on one sequence),
f32 as its accurate mode. What it needs from llmc: engines compiled with `--block-size 32` (the CPU
plugin's only size; the backend reads it off the compiled model's key_cache input and refuses
others); the pool in the compute precision: float32 for f32, a new bfloat16 kv_dtype (uint16
storage) for bf16 (or f16 with f32 compute, or the plugin's u8/u4 layouts with their extra
rows); KvCache keeps owning the pool, allocated as today, each layer's views bound to the infer
request at attach (so block manager, copy-on-write and prefix cache work unchanged); the step's
layout as above from PagedBatch; and no post-step store for this backend (the op writes the
step's keys and values itself, so a step is no longer free of side effects: a retried step
rewrites the same slots, harmless; the tables must already hold the new tokens' blocks, as
llmc's own store needs today). Engines with softcap cannot use it; windows need a parity check.
Load: compile from the joined model each time (1-2.6 s) or cache it (CACHE_DIR); warm the
token counts the scheduler uses (1..max batch) at load.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

THREADS = 2
TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime", "text", "python-source.txt")
SYSTEMS = ("llmc", "llmc packed", "openvino f32", "openvino bf16")
POOL_TOKENS = 12288  # the timing cases' sequences (250 blocks of 32), with room to spare
DECODE_STEPS = 8  # a decode case: this many steps in a row, timed per step


# ---- the model: runtime/backends/openvino.py's, over the probe's own pool ---------------------

class OpenVinoPaged:
    """The joined model compiled for the CPU, and the per-layer pools it reads and writes in
    place: llmc-owned NumPy arrays (bf16 as uint16) handed to OpenVINO as shared tensors."""

    def __init__(self, engine, precision: str, pool_tokens: int = POOL_TOKENS):
        import openvino as ov

        self.precision = precision
        from llmc.runtime.backends.openvino import POOL_STORAGE, paged_model

        # The engine's blocks of 16 are declared; the CPU plugin re-shapes the caches to its 32.
        model = paged_model(engine)  # the caches take KV_CACHE_PRECISION's type
        config = {"INFERENCE_NUM_THREADS": THREADS, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY",
                  "INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision}
        begin = time.perf_counter()
        self.compiled = ov.Core().compile_model(model, "CPU", config)
        self.compile_s = time.perf_counter() - begin
        cache = self.compiled.input("key_cache.0")
        shape = cache.get_partial_shape()
        self.cache_type = cache.get_element_type()
        self.block_size = shape[2].get_length()
        dims = [shape[i].get_length() for i in (1, 2, 3)]
        self.num_blocks = -(-pool_tokens // self.block_size)
        dtype = POOL_STORAGE[self.cache_type.get_type_name()]
        layers = engine.manifest.geometry.num_layers
        self.pool = np.zeros((2 * layers, self.num_blocks, *dims), dtype)
        self.request = self.compiled.create_infer_request()
        for layer in range(layers):
            for part, index in (("key", 2 * layer), ("value", 2 * layer + 1)):
                self.request.set_tensor(f"{part}_cache.{layer}",
                                        ov.Tensor(self.pool[index], list(self.pool[index].shape), self.cache_type))

    def describe(self) -> str:
        counts = {}
        for op in self.compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            kind = info["layerType"].astype(str)
            if kind in ("FullyConnected", "PagedAttention", "MatMul"):
                key = f"{kind} {info['runtimePrecision'].astype(str)}"
                counts[key] = counts.get(key, 0) + 1
        return (f"cache {self.cache_type.get_type_name()} [blocks, {', '.join(map(str, self.pool.shape[2:]))}], "
                f"compiled in {self.compile_s:.1f} s; " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))

    def feeds(self, tokens, positions, batch, rows) -> dict:
        """The step's inputs from llmc's (PagedBatch) layout: OpenVINO's block list holds each
        sequence's blocks through its new tokens' (it stores them), flattened."""
        starts = np.asarray(batch.query_start_loc, np.int64)
        past = np.asarray(batch.context_lens, np.int64)
        total = past + np.diff(starts)
        used = -(-total // self.block_size)
        blocks = np.concatenate([batch.block_tables[s, :used[s]] for s in range(batch.num_seqs)])
        return {"input_ids": np.asarray(tokens, np.int64)[None], "position_ids": np.asarray(positions, np.int64)[None],
                "logits_rows": np.asarray(rows, np.int64), "past_lens": past.astype(np.int32),
                "subsequence_begins": starts.astype(np.int32), "block_indices": blocks.astype(np.int32),
                "block_indices_begins": np.concatenate([[0], np.cumsum(used)]).astype(np.int32),
                "max_context_len": np.array(total.max(), np.int32)}

    def run(self, tokens, positions, batch, rows) -> np.ndarray:
        self.request.infer(self.feeds(tokens, positions, batch, rows), share_inputs=True)
        return self.request.get_tensor("logits").data[0]


class Llmc:
    """llmc's CPU backend over its own pool, each step on the path llmc's planner picks
    (`packed=True`: always the segments and the paged-attention kernel)."""

    def __init__(self, engine, packed: bool = False):
        from llmc.runtime.backends.base import BackendOptions
        from llmc.runtime.backends.cpu import CpuBackend
        from llmc.runtime.kv_cache import KvCache
        from llmc.runtime.step_plan import choose_path

        self.choose = choose_path
        self.backend = CpuBackend(engine, BackendOptions(threads=THREADS, single_sequence=not packed, concurrent=True))
        from llmc.formats.manifest import kv_block_bytes

        paged = engine.manifest.paged
        blocks = -(-max(POOL_TOKENS, paged.max_seq_len) // paged.block_size)  # its pool holds one max_seq_len
        block_bytes = kv_block_bytes(engine.manifest.geometry, paged.block_size, paged.kv_dtype)
        self.kv = KvCache(engine.manifest, kv_pool_mb=(blocks + 1) * block_bytes / 2**20)
        self.backend.attach(self.kv)
        self.backend.warm_up()
        self.block_size, self.num_blocks = self.kv.block_size, self.kv.num_blocks

    def describe(self) -> str:
        return f"onnxruntime, pool {self.kv.pool.dtype} block {self.block_size}"

    def run(self, tokens, positions, batch, rows) -> np.ndarray:
        from llmc.runtime.step_plan import StepPlan

        path = self.choose(self.backend.paths, batch.num_seqs, len(tokens))
        plan = StepPlan(path, np.asarray(tokens, np.int64), np.asarray(positions, np.int64), batch,
                        np.asarray(rows, np.int64))
        return np.array(self.backend.run(plan))


# ---- sequences and steps, in llmc's terms ------------------------------------------------------

class Sequences:
    """Block tables handed out from a free list, as llmc's block manager does (ids in order)."""

    def __init__(self, block_size: int, num_blocks: int):
        self.block_size, self.free = block_size, list(range(num_blocks))
        self.blocks: list[list[int]] = []
        self.lengths: list[int] = []

    def add(self) -> int:
        self.blocks.append([])
        self.lengths.append(0)
        return len(self.lengths) - 1

    def step(self, chunks: dict[int, np.ndarray]):
        """tokens, positions, PagedBatch and logits rows of a step running `chunks` (sequence ->
        its new token ids), with blocks for the new tokens taken; `commit` then advances them."""
        from llmc.plugins.paged_attention import PagedBatch

        order = list(chunks)
        for s in order:
            need = -(-(self.lengths[s] + len(chunks[s])) // self.block_size)
            while len(self.blocks[s]) < need:
                self.blocks[s].append(self.free.pop(0))
        width = max(len(self.blocks[s]) for s in order)
        tables = np.zeros((len(order), width), np.int64)
        for i, s in enumerate(order):
            tables[i, :len(self.blocks[s])] = self.blocks[s]
        counts = [len(chunks[s]) for s in order]
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        tokens = np.concatenate([chunks[s] for s in order]).astype(np.int64)
        positions = np.concatenate([self.lengths[s] + np.arange(len(chunks[s])) for s in order])
        batch = PagedBatch(tables, np.array([self.lengths[s] for s in order], np.int64), starts)
        return tokens, positions, batch, starts[1:] - 1

    def commit(self, chunks: dict[int, np.ndarray]) -> None:
        for s, ids in chunks.items():
            self.lengths[s] += len(ids)


def text_ids(engine) -> np.ndarray:
    from llmc.runtime.engine import load_tokenizer

    with open(TEXT) as f:
        return np.array(load_tokenizer(engine).encode(f.read()), np.int64)


# ---- correctness: the same requests on llmc and on OpenVINO ------------------------------------

def conversation(system, ids: np.ndarray, prompts: list[tuple[int, int]], decodes: int):
    """Prefill `prompts` (text offset, length) in one packed step, then `decodes` greedy steps of
    all of them; the logits of every step's last rows, and the tokens each picked."""
    seqs = Sequences(system.block_size, system.num_blocks)
    chunks = {seqs.add(): ids[start:start + length] for start, length in prompts}
    logits, tokens = [], []
    for _ in range(decodes + 1):
        step = seqs.step(chunks)
        out = np.array(system.run(*step), np.float32)
        seqs.commit(chunks)
        picked = out.argmax(-1)
        logits.append(out)
        tokens.append(picked)
        chunks = {s: picked[i:i + 1] for i, s in enumerate(chunks)}
    return logits, np.array(tokens)


# ---- timing cases --------------------------------------------------------------------------

def cases(system, ids: np.ndarray) -> dict:
    """Name -> (a call, the steps it runs), repeatable: each call re-runs the same steps at the
    same positions, rewriting the same slots. A decode case runs `DECODE_STEPS` in a row, as a
    generation does (llmc's whole graph keeps a sequence in its row between them). The pasts are
    filled once, by the system itself."""
    seqs = Sequences(system.block_size, system.num_blocks)
    made = {}

    def prefilled(length, offset):
        s = seqs.add()
        chunk = {s: ids[offset:offset + length]}
        system.run(*seqs.step(chunk))
        seqs.commit(chunk)
        return s

    def chain(chunks: list[dict], per_step: bool):
        steps = []
        for chunk in chunks:
            steps.append(seqs.step(chunk))
            seqs.commit(chunk)
        return (lambda: [system.run(*step) for step in steps][-1]), len(steps) if per_step else 1

    def decode(group):
        return chain([{s: ids[1000 + 10 * s + k:1001 + 10 * s + k] for s in group} for k in range(DECODE_STEPS)], True)

    made["decode b1 @150"] = decode([prefilled(150, 0)])
    made["decode b16 @150-195"] = decode([prefilled(150 + 3 * i, 50 * i) for i in range(16)])
    for length in (128, 2048):
        s = seqs.add()
        made[f"prefill {length}"] = chain([{s: ids[3000:3000 + length]}], False)
    s = seqs.add()  # chunks of 512, each over the chunks before it
    chunks = [{s: ids[3000 + start:3512 + start]} for start in range(0, 2048, 512)]
    made["prefill 2048 (4 x 512)"] = chain(chunks, False)
    return made


REPS = {"decode": 2, "prefill": 2}  # calls of a case per round


def worker(conn, system_name: str, engine_path: str, ids: np.ndarray) -> None:
    from llmc.formats.engine_file import read_engine

    engine = read_engine(engine_path, verify=False)
    try:
        if system_name.startswith("llmc"):
            system = Llmc(engine, packed=system_name == "llmc packed")
        else:
            system = OpenVinoPaged(engine, system_name.split()[1])
        made = cases(system, ids)
        for run, _ in made.values():
            run()
        conn.send(("ready", list(made), system.describe()))
    except Exception as error:
        conn.send(("failed", f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}", ""))
        return
    while True:
        command = conn.recv()
        if command[0] == "stop":
            return
        _, name, reps = command
        (run, steps), times = made[name], []
        for _ in range(reps):
            begin = time.perf_counter()
            run()
            times.append((time.perf_counter() - begin) / steps)
        conn.send(times)


def measure(engine_path: str, ids: np.ndarray, rounds: int) -> None:
    context = mp.get_context("spawn")
    workers = {}
    for name in SYSTEMS:  # built one at a time
        parent, child = context.Pipe()
        process = context.Process(target=worker, args=(child, name, engine_path, ids))
        process.start()
        status, detail, info = parent.recv()
        print(f"{name}: {status} {detail if status == 'failed' else info}", flush=True)
        if status == "ready":
            workers[name] = (process, parent, detail)
    names = list(workers)
    case_names = workers[names[0]][2]
    times = {(n, c): [] for n in names for c in case_names}
    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            for case in case_names:
                workers[name][1].send(("time", case, REPS[case.split()[0]]))
                times[name, case] += workers[name][1].recv()
    print(f"\n{'case':24}" + "".join(f"{n:>16}" for n in names)
          + "   (median ms a decode step, or a whole prompt; x llmc)")
    for case in case_names:
        base = statistics.median(times[names[0], case])
        cells = [f"{statistics.median(times[n, case]) * 1e3:9.1f} {statistics.median(times[n, case]) / base:5.2f}"
                 for n in names]
        print(f"{case:24}" + "".join(f"{c:>16}" for c in cells), flush=True)
    for process, conn, _ in workers.values():
        conn.send(("stop",))
        process.join()


def check(engine_path: str, ids: np.ndarray) -> None:
    """f32 logits and greedy tokens against llmc's packed path, then bf16's greedy tokens."""
    from llmc.formats.engine_file import read_engine

    engine = read_engine(engine_path, verify=False)
    runs = {"one 128-token prompt, 16 greedy steps": ([(0, 128)], 16),
            "16 prompts of 97-247 tokens packed, 8 greedy steps": ([(300 * i, 97 + 10 * i) for i in range(16)], 8)}
    systems = [("llmc packed", lambda: Llmc(engine, packed=True)),
               ("openvino f32", lambda: OpenVinoPaged(engine, "f32")),
               ("openvino bf16", lambda: OpenVinoPaged(engine, "bf16"))]
    results, stored = {}, {}
    for name, make in systems:
        system = make()
        print(f"{name}: {system.describe()}", flush=True)
        for run, (prompts, decodes) in runs.items():
            if isinstance(system, OpenVinoPaged):
                system.pool[...] = 0
            results[name, run] = conversation(system, ids, prompts, decodes)
            if isinstance(system, OpenVinoPaged):  # OpenVINO stored the keys and values, into llmc's arrays
                written = int(np.any(system.pool[0] != 0, axis=(1, 2, 3)).sum())
                stored[name, run] = (written, sum(-(-(length + decodes) // system.block_size) for _, length in prompts))
        del system
    for run, (prompts, decodes) in runs.items():
        ref_logits, ref_tokens = results["llmc packed", run]
        for name, _ in systems[1:]:
            logits, tokens = results[name, run]
            same = np.cumprod(tokens == ref_tokens, axis=0)  # [step, sequence]: all equal so far
            agreed = same.sum(axis=0)
            # logits compared only where every token before them agreed
            diff = max(float(np.abs(a - b)[same[i - 1] == 1 if i else slice(None)].max(initial=0))
                       for i, (a, b) in enumerate(zip(logits, ref_logits)))
            print(f"{run}: {name}: max abs logit diff {diff:.2e}; top-1 of the prompt "
                  f"{float(np.mean(tokens[0] == ref_tokens[0])):.2f}; greedy tokens equal through "
                  f"{int(agreed.min())}-{int(agreed.max())} of {len(tokens)} steps (median {np.median(agreed):g}); "
                  f"layer 0 key blocks written in place {stored[name, run][0]} of {stored[name, run][1]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", help="a paged fp32 engine file (llmc compile)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    args = parser.parse_args()
    from llmc.formats.engine_file import read_engine

    ids = text_ids(read_engine(args.engine, verify=False))
    if len(ids) < 6000:
        sys.exit(f"{TEXT}: {len(ids)} tokens, the cases need 6,000")
    if not args.skip_check:
        check(args.engine, ids)
    if not args.skip_time:
        measure(args.engine, ids, args.rounds)


if __name__ == "__main__":
    main()
