"""`llmc serve --ray`: two Ray Serve replicas of the server on a local Ray cluster, answering through
Ray's HTTP proxy over HTTPS, with an API key and a request timeout (tiny-llama with a chat
template, as in tests/test_server.py)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import httpx
import pytest

from llmc import LLM, SamplingParams
from llmc.server import ServerOptions

serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from test_server import KEY, MODEL  # noqa: E402
from tls import self_signed, trusting  # noqa: E402

TIMEOUT_S = 4.0  # the servers' request timeout


def _proxy_port() -> int:
    """A free port between Ray's worker ports (10002-19999) and the kernel's ephemeral range: a port
    probed free inside that range can be taken before the proxy binds it by one of the outgoing
    connections Ray opens while it starts, which draw their local ports from there."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for port in random.sample(range(20000, max(low, 20001)), min(200, max(low - 20000, 1))):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between 20000 and {low}")


@pytest.fixture(scope="module")
def ray_url(chat_engine, tmp_path_factory):
    """(base URL, client TLS context) of the proxy."""
    import ray

    from llmc.server_ray import application, http_options

    port = _proxy_port()
    key_file, cert_file = self_signed(tmp_path_factory.mktemp("tls"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options=http_options("127.0.0.1", port, {"ssl_keyfile": str(key_file),
                                                                 "ssl_certfile": str(cert_file)}))
        # A limit a 12-token completion keeps well under on a busy machine (1 s was not), which
        # the timeout test's request still passes many times over.
        options = ServerOptions(model_name=MODEL, api_key=KEY, request_timeout_s=TIMEOUT_S)
        serve.run(application(str(chat_engine), options, {"max_num_seqs": 8}, replicas=2,
                              cpus_per_replica=0.5, threads=1), name="llmc", route_prefix="/")
        yield f"https://127.0.0.1:{port}", trusting(cert_file)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_both_replicas_answer_through_the_proxy(ray_url):
    url, tls = ray_url
    pids = {httpx.get(f"{url}/health", verify=tls).json()["pid"] for _ in range(30)}
    assert len(pids) == 2, pids


def test_the_key_and_the_timeout_hold_through_the_proxy(ray_url):
    url, tls = ray_url
    body = {"model": MODEL, "prompt": "def", "max_tokens": 4}
    assert httpx.post(f"{url}/v1/completions", json=body, verify=tls).status_code == 401
    keyed = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{url}/v1/completions", json=body, verify=tls, headers=keyed).status_code == 200
    # 4 prompts × 16 × 511 tokens, 8 sequences a step: over 4,000 steps, far more than a replica on
    # half a core runs in the limit
    long = {**body, "max_tokens": 511, "n": 16, "ignore_eos": True, "prompt": [[5], [6], [7], [8]]}
    answer = httpx.post(f"{url}/v1/completions", json=long, verify=tls, headers=keyed, timeout=60)
    assert answer.status_code == 504 and answer.json()["error"]["type"] == "timeout_error", answer.text


def test_completions_and_streams_through_the_proxy_equal_the_request_alone(ray_url, chat_engine):
    ray_url, tls = ray_url
    api = openai.OpenAI(base_url=f"{ray_url}/v1", api_key=KEY, max_retries=0, http_client=httpx.Client(verify=tls))
    (alone,) = LLM(chat_engine).generate(["def fibonacci("], SamplingParams(max_new_tokens=12))
    for _ in range(4):  # over both replicas
        answer = api.completions.create(model=MODEL, prompt="def fibonacci(", max_tokens=12, temperature=0)
        assert answer.choices[0].text == alone.text
    chunks = list(api.completions.create(model=MODEL, prompt="def fibonacci(", max_tokens=12, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == alone.text
    bad = httpx.post(f"{ray_url}/v1/completions", json={"model": "other", "prompt": "x"}, verify=tls,
                     headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "model"


def test_bad_replica_count_is_one_line(chat_engine):
    from click.testing import CliRunner

    from llmc.cli import main

    result = CliRunner().invoke(main, ["serve", str(chat_engine), "--ray", "--replicas", "0"])
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == ["llmc: error: --replicas: must be ≥ 1, got 0"]
