"""Start-up: loading an engine pays for neither the KV pool's untouched pages nor a copy of the
weights, the attention kernel comes from Numba's disk cache in a second process, and the default
pool follows the memory budget (runtime/kv_cache.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from llmc.compiler.build import compile_model
from llmc.compiler.paged_engine import PagedOptions
from llmc.errors import LlmcError
from llmc.formats.engine_file import read_engine
from llmc.runtime.kv_cache import MEMORY_FRACTION, pool_blocks
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams

MiB = 2**20


def resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def block_bytes(manifest) -> int:
    g, paged = manifest.geometry, manifest.paged
    return 2 * g.num_layers * g.num_kv_heads * paged.block_size * g.head_dim * 4  # float32 pool


@pytest.fixture(scope="module")
def big_pool_engine(tiny_llama_onnx, tmp_path_factory):
    path = tmp_path_factory.mktemp("big-pool") / "engine.plan"
    compile_model(tiny_llama_onnx, path, paged=PagedOptions(kv_pool_mb=2048))
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
def test_loading_does_not_make_the_pool_resident(big_pool_engine):
    before = resident_mib()
    engine = Engine(big_pool_engine)
    grown = resident_mib() - before
    pool_mib = engine.kv.pool.nbytes / MiB
    assert pool_mib > 2000  # the pool the compile asked for, all of it
    assert grown < 256, f"loading grew resident memory by {grown:.0f} MiB for a {pool_mib:.0f} MiB pool"


def test_sessions_keep_no_copy_of_the_serialized_graphs(tiny_llama_engine):
    single = Engine(tiny_llama_engine).backend.whole.session
    sessions = [s for s in Engine(tiny_llama_engine, single_sequence=False).backend._sessions if s is not None]
    assert sessions and all(getattr(s, "_model_bytes", None) is None for s in [single, *sessions])


KERNEL_STATS = """
import json, sys
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams
engine = Engine(sys.argv[1], single_sequence=False)  # one sequence: the kernel, not the single-sequence graph
engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3))
while engine.has_unfinished():
    engine.step()  # its decodes run the kernel, and every step stores into the pool
from llmc.plugins.paged_attention_kernels import _attend, _attend_serial, store
print(json.dumps({name: {"hits": sum(kernel.stats.cache_hits.values()),
                         "misses": sum(kernel.stats.cache_misses.values()),
                         "overloads": len(kernel.overloads)} for name, kernel in
                  [("attend", _attend), ("attend_serial", _attend_serial), ("store", store)]}))
"""


def test_a_second_process_loads_the_kernels_from_numbas_cache(tiny_llama_engine):
    def run():
        done = subprocess.run([sys.executable, "-c", KERNEL_STATS, str(tiny_llama_engine)], capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    run()  # compiles and caches what is not cached yet
    second = run()
    for name in ("attend", "attend_serial", "store"):
        assert second[name]["misses"] == 0, second
        assert second[name]["hits"] >= 1, second
    # One overload: the literal block size's, loaded by signature. Calling the dispatcher with a
    # plain int first would type (and count) a non-literal attempt as well.
    assert second["attend"]["overloads"] == second["attend_serial"]["overloads"] == 1, second


def slow_kernel_load(monkeypatch, seconds: float = 0.5) -> None:
    """Kernels that take `seconds` longer to load than they do, as Numba's start does on a busy machine."""
    from llmc.plugins import paged_attention_kernels

    load = paged_attention_kernels.load_kernels

    def late(*args):
        time.sleep(seconds)
        load(*args)

    monkeypatch.setattr(paged_attention_kernels, "load_kernels", late)


def kernel_called(engine: Engine) -> bool:
    return any(entry is not None for entry in engine.backend._attention._kernels.values())


def test_an_engine_for_concurrent_requests_has_run_the_kernel_when_loaded(tiny_llama_engine, monkeypatch):
    """Else the first step that mixes a prompt with decodes waits for the kernels to load."""
    slow_kernel_load(monkeypatch)
    assert kernel_called(Engine(tiny_llama_engine, kv_pool_mb=4, concurrent=True))


def test_a_single_request_engine_does_not_wait_for_the_kernel(tiny_llama_engine, monkeypatch):
    """`llmc run` (segments only, as an engine without a single-sequence graph has): its first
    token comes from the dense form, so start-up leaves the kernel loading."""
    slow_kernel_load(monkeypatch)
    engine = Engine(tiny_llama_engine, kv_pool_mb=4, single_sequence=False)
    assert not kernel_called(engine) and not engine.backend._attention.loaded


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a thread count below the machine's")
def test_the_kernel_runs_with_the_engines_threads_on_the_thread_that_steps(tiny_llama_engine):
    """A server loads its engine on one thread and steps it on another; Numba's thread count is
    per thread."""
    import numba

    engine = Engine(tiny_llama_engine, kv_pool_mb=4, threads=1, concurrent=True)
    seen = []

    def serve():
        for prompt in ([5, 6, 7], list(range(10, 40))):  # the second's prompt arrives while the first decodes
            engine.add_request(prompt, SamplingParams(max_new_tokens=4))
            engine.step()
        while engine.has_unfinished():
            engine.step()
        seen.append(numba.get_num_threads())

    worker = threading.Thread(target=serve)
    worker.start()
    worker.join()
    assert seen == [1]


def test_the_default_pool_is_capped_by_the_memory_available(tiny_llama_engine):
    manifest = read_engine(tiny_llama_engine).manifest
    paged, geometry, size = manifest.paged, manifest.geometry, block_bytes(manifest)
    assert paged.kv_pool_mb is None  # compiled with the default pool
    assert pool_blocks(paged, geometry, available=10**15) == paged.num_blocks
    assert pool_blocks(paged, geometry, available=int(100 * size / MEMORY_FRACTION)) == 100
    per_sequence = -(-paged.max_seq_len // paged.block_size)
    assert pool_blocks(paged, geometry, available=0) == per_sequence  # never below one full sequence


def test_a_pool_sized_at_compile_time_is_kept_whatever_the_memory(tiny_llama_engine):
    manifest = read_engine(tiny_llama_engine).manifest
    asked = dataclasses.replace(manifest.paged, kv_pool_mb=64.0, num_blocks=1000)
    assert pool_blocks(asked, manifest.geometry, available=0) == 1000


def test_a_pool_sized_at_load_overrides_the_engines(tiny_llama_engine):
    manifest = read_engine(tiny_llama_engine).manifest
    size = block_bytes(manifest)
    engine = Engine(tiny_llama_engine, kv_pool_mb=40 * size / MiB)
    assert engine.blocks.num_blocks == 40
    assert engine.kv.pool.shape[1] == 40
    with pytest.raises(LlmcError, match="fewer than the 32 blocks one sequence of 512 tokens needs"):
        pool_blocks(manifest.paged, manifest.geometry, kv_pool_mb=31 * size / MiB)
    with pytest.raises(LlmcError, match="must be > 0"):
        pool_blocks(manifest.paged, manifest.geometry, kv_pool_mb=0)


def test_a_pool_of_its_own_block_shapes_counts_their_bytes_and_copies_both_parts(tiny_llama_engine):
    """A backend keeping keys and values in shapes of its own (OpenVINO's u8 cache: scales and zero
    points inside each block): the MiB asked hold blocks of those shapes' bytes, each layer's pool
    is a dense view of the right shape, and copy-on-write copies keys and values, nothing else."""
    import numpy as np

    from llmc.runtime.kv_cache import KvCache

    manifest = read_engine(tiny_llama_engine).manifest
    layers, heads = manifest.geometry.num_layers, manifest.geometry.num_kv_heads
    key, value = (heads, 40, 64), (heads, 32, 72)
    per_block = layers * (np.prod(key) + np.prod(value))  # uint8: a byte an element
    kv = KvCache(manifest, 64 * per_block / MiB, dtype="uint8", block_shapes=(key, value))
    assert kv.num_blocks == 64 and kv.pool is None
    pools = kv.layer_pools()
    assert len(pools) == 2 * layers
    for name, view in pools.items():
        assert view.shape == (64, *(key if name.startswith("key") else value)) and view.flags.c_contiguous
    rng = np.random.default_rng(0)
    for part in kv.parts:
        part[:, 3] = rng.integers(1, 255, part[:, 3].shape)
    before = [part.copy() for part in kv.parts]
    kv.copy_blocks([(3, 7)])
    for part, old in zip(kv.parts, before):
        np.testing.assert_array_equal(part[:, 7], old[:, 3])
        untouched = [b for b in range(64) if b != 7]
        np.testing.assert_array_equal(part[:, untouched], old[:, untouched])
