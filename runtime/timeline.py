"""Where an engine's time goes: named spans on a few tracks, recorded while it runs.

An `Engine` made with a `Timeline` records, per step, the step and its phases (schedule, plan,
execute, postprocess, and inside them sampling and detokenizing) on the "engine" track; its
backend records what it hands to its libraries: each onnxruntime call on the "onnxruntime" track
(with onnxruntime's own per-operator events nested inside, from its profiler: `Timeline.session_
options` switches that on for the sessions it is given), each call of the paged-attention kernel
and each store into the pool on the "kernel" track, and on TensorRT each layer's time on the
"tensorrt" track. Reports (runtime/profile.py) and the Chrome trace are read from the spans.

Without a timeline the engine and its backends record into `OFF`, whose spans cost a call and
nothing else: the hot path is the same code either way.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

ENGINE, ONNXRUNTIME, KERNEL, TENSORRT, OPENVINO = "engine", "onnxruntime", "kernel", "tensorrt", "openvino"
OPERATOR = "operator"  # the `kind` of a span that onnxruntime's profiler reported


@dataclass
class Span:
    """One timed interval; times in nanoseconds of `time.perf_counter_ns`."""

    name: str
    track: str
    start_ns: int
    end_ns: int
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class Timeline:
    """Records spans; `span()` times a block, `add()` records one timed elsewhere."""

    enabled = True

    def __init__(self) -> None:
        self.spans: list[Span] = []
        # onnxruntime's profiler stamps events with the wall clock: this maps them onto ours.
        self._wall_minus_perf = time.time_ns() - time.perf_counter_ns()
        self._sessions: list[tuple[str, Any]] = []
        self._folder: str | None = None

    @staticmethod
    def now() -> int:
        return time.perf_counter_ns()

    @contextmanager
    def span(self, name: str, track: str = ENGINE, **args: Any) -> Iterator[dict[str, Any]]:
        """Time the block; the dict it yields becomes the span's args (add to it inside)."""
        start = time.perf_counter_ns()
        try:
            yield args
        finally:
            self.spans.append(Span(name, track, start, time.perf_counter_ns(), args))

    def add(self, name: str, track: str, start_ns: int, end_ns: int, **args: Any) -> None:
        self.spans.append(Span(name, track, start_ns, end_ns, args))

    def session_options(self, options, label: str):
        """`options` with onnxruntime's profiler on, its file in this timeline's scratch folder;
        give the session to `watch` once made."""
        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="llmc-profile-")
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(self._folder, label.replace("/", "_"))
        return options

    def watch(self, session, label: str) -> None:
        """A session whose profiler `collect_operators` reads at the end."""
        self._sessions.append((label, session))

    def collect_operators(self) -> None:
        """Stop the watched sessions' profilers and add their operators as spans on the
        onnxruntime track (each within the call that ran it); removes their files."""
        for label, session in self._sessions:
            path = session.end_profiling()
            if not path:
                continue
            events = json.loads(Path(path).read_text() or "[]")
            Path(path).unlink(missing_ok=True)
            for event in events:
                if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
                    continue
                start = session.get_profiling_start_time_ns() + int(event["ts"]) * 1000 - self._wall_minus_perf
                details = event.get("args", {})
                self.spans.append(Span(event["name"][:-len("_kernel_time")], ONNXRUNTIME, start,
                                       start + int(event["dur"]) * 1000,
                                       {"kind": OPERATOR, "op": details.get("op_name", "?"), "session": label,
                                        "input_shapes": details.get("input_type_shape", [])}))
        self._sessions.clear()
        if self._folder is not None:
            for leftover in Path(self._folder).iterdir():
                leftover.unlink()
            os.rmdir(self._folder)
            self._folder = None


class _Off:
    """Records nothing."""

    enabled = False
    _nothing = nullcontext({})

    def span(self, name: str, track: str = ENGINE, **args: Any):
        return self._nothing

    def add(self, name: str, track: str, start_ns: int, end_ns: int, **args: Any) -> None:
        pass

    @staticmethod
    def now() -> int:
        return 0


OFF = _Off()
