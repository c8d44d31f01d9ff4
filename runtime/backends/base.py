"""The contract between the engine and a backend, written down once.

A backend runs the steps of one kind of engine file (its manifest's `backend`) on one device.
The engine (runtime/engine.py) owns everything else: the KV cache (runtime/kv_cache.py: pool,
blocks, copy-on-write), the scheduler and the step plan (runtime/step_plan.py). A new backend is
a module with a class that satisfies `Backend`, and one entry in runtime/backends/registry.py;
nothing outside it asks which backend it is.

The engine calls, in order:

1. ``Backend(engine_file, options)``: load the payload (sessions, a TensorRT engine): the
   weights are in memory before the pool is sized.
2. ``placement``: where the KV pool lives (`PoolPlacement`); the engine builds its `KvCache`
   from it and hands it over with ``attach(kv)``: the backend binds the pool (and, on the CPU,
   asks the cache for the whole graph's rows).
   ``paths`` (`StepPaths`): the step forms the planner may choose, and the step size the
   scheduler's default token budget takes.
3. ``warm_up()``, once, before the first request; ``steps_round_alike()``, at most once.
4. per step: ``run(plan)`` after the engine applied the plan's block copies; it stores the step's
   keys and values in the pool at the slots the plan's batch names and returns the logits of
   ``plan.rows``, [rows, vocab] float32 NumPy on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from llmc.formats.engine_file import EngineFile
from llmc.runtime.kv_cache import KvCache, allocate_pool
from llmc.runtime.step_plan import StepPaths, StepPlan
from llmc.runtime.timeline import OFF


@dataclass(frozen=True)
class BackendOptions:
    """How to load an engine's backend.

    Args:
        threads: CPU threads; None uses every core.
        single_sequence: run the steps it can take on the engine's whole graph, where it has one.
        concurrent: requests are expected to overlap (a server, a throughput benchmark): build
            what a step of several sequences needs at load, not at its first such step.
        timeline: where the backend records its calls (runtime/timeline.py); `OFF` records none.
        decode_model: OpenVINO: decode steps on a second model where the CPU and memory allow it
            (faster decodes, for more memory and a slower load); False: one model for every step.
    """

    threads: int | None = None
    single_sequence: bool = True
    concurrent: bool = False
    timeline: Any = OFF
    decode_model: bool = True


@dataclass(frozen=True)
class PoolPlacement:
    """Where a backend's KV pool lives.

    Args:
        allocate: makes the zeroed pool, given its shape and dtype name.
        available: bytes of the device's memory free now, which the default pool takes a share
            of; None: the host's (read when the pool is sized).
        max_blocks: the most blocks the backend's step can address; None: no limit.
        dtype: the type the pool is stored in, where the backend keeps it in another than the
            manifest's kv_dtype (OpenVINO keeps a bf16-compute cache in bf16, as uint16); the
            pool's blocks are counted in it. None: the manifest's.
        block_shapes: the shapes of one layer's key block and value block where the backend
            keeps them in a layout of its own (OpenVINO's u8 cache holds each block's scales and
            zero points in it); None: both [kv heads, block size, head dim].
    """

    allocate: Callable[[tuple[int, ...], str], Any] = allocate_pool
    available: int | None = None
    max_blocks: int | None = None
    dtype: str | None = None
    block_shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None


@runtime_checkable
class Backend(Protocol):
    """What the engine needs of a backend (see the module's docstring for the order of calls)."""

    paths: StepPaths
    placement: PoolPlacement

    def __init__(self, engine: EngineFile, options: BackendOptions) -> None: ...

    def attach(self, kv: KvCache) -> None:
        """Bind the engine's KV cache: the pool this backend's steps read and write."""

    def warm_up(self) -> None:
        """Run throw-away steps so the first real ones don't pay for first calls; writes only
        into pool blocks no request owns."""

    def steps_round_alike(self) -> bool:
        """Whether a sequence's logits come out bit for bit the same however its tokens are cut
        into steps (with the padding row, where `paths.padding_row`): whether guesses leave a
        weight-only engine's greedy outputs as they were."""

    def run(self, plan: StepPlan) -> np.ndarray:
        """Run one step; store its keys and values; return the logits of `plan.rows`."""


def missing_members(backend: object) -> list[str]:
    """The members of `Backend` that `backend` lacks."""
    return [name for name in ("paths", "placement", "attach", "warm_up", "steps_round_alike", "run")
            if not hasattr(backend, name)]
