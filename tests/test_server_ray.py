"""`llmc serve --ray`: two Ray Serve replicas of the server on a local Ray cluster, answering through
Ray's HTTP proxy (tiny-llama with a chat template, as in tests/test_server.py)."""

from __future__ import annotations

import socket

import httpx
import pytest

from llmc import LLM, SamplingParams
from llmc.server import ServerOptions

serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from test_server import MODEL  # noqa: E402


@pytest.fixture(scope="module")
def ray_url(chat_engine):
    import ray

    from llmc.server_ray import application

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(str(chat_engine), ServerOptions(model_name=MODEL), {"max_num_seqs": 8}, replicas=2,
                              cpus_per_replica=0.5, threads=1), name="llmc", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_both_replicas_answer_through_the_proxy(ray_url):
    pids = {httpx.get(f"{ray_url}/health").json()["pid"] for _ in range(30)}
    assert len(pids) == 2, pids


def test_completions_and_streams_through_the_proxy_equal_the_request_alone(ray_url, chat_engine):
    api = openai.OpenAI(base_url=f"{ray_url}/v1", api_key="unused", max_retries=0)
    (alone,) = LLM(chat_engine).generate(["def fibonacci("], SamplingParams(max_new_tokens=12))
    for _ in range(4):  # over both replicas
        answer = api.completions.create(model=MODEL, prompt="def fibonacci(", max_tokens=12, temperature=0)
        assert answer.choices[0].text == alone.text
    chunks = list(api.completions.create(model=MODEL, prompt="def fibonacci(", max_tokens=12, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == alone.text
    bad = httpx.post(f"{ray_url}/v1/completions", json={"model": "other", "prompt": "x"})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "model"


def test_bad_replica_count_is_one_line(chat_engine):
    from click.testing import CliRunner

    from llmc.cli import main

    result = CliRunner().invoke(main, ["serve", str(chat_engine), "--ray", "--replicas", "0"])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == ["llmc: error: --replicas: must be ≥ 1, got 0"]
