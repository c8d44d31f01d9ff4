"""bench/openvino_peer.py's request driver, on a stand-in for OpenVINO GenAI's ContinuousBatchingPipeline.

The stand-in makes one token per unfinished request per step (10 ms), as the real pipeline does
in decode; what is checked is the driver's part: a request is added only once its arrival time
has passed, each request's token times are its own, and a token count other than the one asked
for is an error, not a figure.
"""

from __future__ import annotations

import importlib.util
import time
import types
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_openvino_peer", REPO / "bench" / "openvino_peer.py")
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)

STEP_S = 0.01


class _Handle:
    def __init__(self, wanted: int):
        self.wanted, self.made, self.unread = wanted, 0, []

    def can_read(self) -> bool:
        return bool(self.unread)

    def read(self) -> dict:
        out, self.unread = types.SimpleNamespace(generated_ids=self.unread), []
        return {0: out}


class _Pipeline:
    def __init__(self, extra: int = 0):
        self.handles, self.added, self.extra = {}, {}, extra

    def add_request(self, request_id, input_ids, config):
        self.added[request_id] = time.perf_counter()
        self.handles[request_id] = _Handle(config.max_new_tokens + self.extra)
        return self.handles[request_id]

    def has_non_finished_requests(self) -> bool:
        return any(h.made < h.wanted for h in self.handles.values())

    def step(self) -> None:
        time.sleep(STEP_S)
        for handle in self.handles.values():
            if handle.made < handle.wanted:
                handle.made += 1
                handle.unread.append(7)


_og = types.SimpleNamespace(GenerationConfig=types.SimpleNamespace)
_ov = types.SimpleNamespace(Tensor=lambda array: array)


def test_requests_join_at_their_arrival_and_keep_their_own_times():
    pipe = _Pipeline()
    requests = [{"prompt": [5, 6], "output_len": 3}, {"prompt": [5], "output_len": 2, "arrival_s": 0.1}]
    start, times = peer._drive(_og, _ov, np, pipe, requests)
    assert [len(t) for t in times] == [3, 2]
    assert pipe.added[0] - start < STEP_S
    assert pipe.added[1] - start >= 0.1
    # the first request is done before the second arrives: the pipeline idled in between
    assert times[0][-1] < pipe.added[1] < times[1][0]
    assert all(a < b for t in times for a, b in zip(t, t[1:]))


def test_a_token_count_other_than_asked_is_an_error():
    with pytest.raises(RuntimeError, match=r"made \[4\] tokens, asked for \[3\]"):
        peer._drive(_og, _ov, np, _Pipeline(extra=1), [{"prompt": [5], "output_len": 3}])
