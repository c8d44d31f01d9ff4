"""`llmc serve` through the official `openai` client and plain httpx, against a server each test
module starts on 127.0.0.1 with a free port (tiny-llama, whose tokenizer is given a chat template).

Every completed answer is compared with the same request run alone through `LLM` (greedy), and
after each test every KV block is back in the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import socket
import threading
import time

import httpx
import pytest

from llmc import LLM, SamplingParams
from llmc.runtime.engine import Engine
from llmc.server import ServerOptions, create_app

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny"


@contextlib.contextmanager
def running(app):
    """The app served by uvicorn in a thread; yields its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(chat_engine):
    engine = Engine(chat_engine)
    app = create_app(engine, ServerOptions(model_name=MODEL, max_waiting=64))
    with running(app) as url:
        yield url, engine, app


@pytest.fixture(scope="module")
def alone(chat_engine):
    """Greedy completion of one prompt (text or ids) run alone: (text, token count)."""
    llm = LLM(chat_engine)

    def run(prompt, max_tokens):
        (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=max_tokens))
        return out.text, len(out.token_ids)
    return run


@pytest.fixture(autouse=True)
def blocks_come_back(request):
    yield
    if "server" in request.fixturenames:
        _, engine, _ = request.getfixturevalue("server")
        deadline = time.monotonic() + 10
        while engine.has_unfinished() or engine.blocks.stats.blocks_in_use:
            assert time.monotonic() < deadline, f"blocks still in use: {engine.blocks.stats}"
            time.sleep(0.05)


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_models_and_health(server):
    url, _, _ = server
    assert [m.id for m in client(url).models.list().data] == [MODEL]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_completion_equals_the_request_run_alone(server, alone):
    url, _, _ = server
    answer = client(url).completions.create(model=MODEL, prompt="def fibonacci(", max_tokens=12, temperature=0)
    text, count = alone("def fibonacci(", 12)
    assert answer.choices[0].text == text and answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage.completion_tokens == count and answer.usage.prompt_tokens == len("def fibonacci(") + 1  # BOS


def test_chat_uses_the_template(server, alone, chat_engine):
    url, _, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os"}]
    answer = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    ids = Engine(chat_engine).tokenizer.inner.encode(
        "<|system|>Be brief.\n<|user|>import os\n<|assistant|>", add_special_tokens=False).ids
    text, _ = alone(ids, 10)
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content == text


def test_streams_match_the_whole_answers(server):
    url, _, _ = server
    api = client(url)
    whole = api.completions.create(model=MODEL, prompt="class Stack:", max_tokens=16, temperature=0)
    chunks = list(api.completions.create(model=MODEL, prompt="class Stack:", max_tokens=16, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    messages = [{"role": "user", "content": "hi"}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_seed_and_stop(server):
    url, _, _ = server
    api = client(url)
    first = api.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=1.0, seed=7, n=3)
    again = api.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    whole = api.completions.create(model=MODEL, prompt="def f(", max_tokens=16, temperature=0).choices[0].text
    stop = whole[3:5]
    cut = api.completions.create(model=MODEL, prompt="def f(", max_tokens=16, temperature=0, stop=[stop]).choices[0]
    assert cut.text == whole[:whole.index(stop)] and cut.finish_reason == "stop"


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "n": 100}, 400, "n"),
    ({"model": MODEL, "prompt": "x" * 5000}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "echo": "yes"}, 400, "echo"),
    ({"model": MODEL, "prompt": "x", "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0, "logprobs": 1}, 400, "max_tokens"),  # 0 needs echo
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": [[1, 2], "x", [True]]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["x"] * 65}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["x"] * 64, "n": 16}, 400, "n"),  # more than the server ever admits
])
def test_bad_requests_get_openai_error_objects(server, body, status, param):
    url, _, _ = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param
    # and the server keeps serving
    assert httpx.get(f"{url}/health").status_code == 200


def test_chat_errors(server, tiny_llama_engine):
    url, _, _ = server
    answer = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    hello = [{"role": "user", "content": "hi"}]
    for extra, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"echo": True}, "echo")):
        answer = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": hello, **extra})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (extra, answer.text)
    app = create_app(Engine(tiny_llama_engine), ServerOptions(model_name="plain"))
    with running(app) as plain:
        answer = httpx.post(f"{plain}/v1/chat/completions",
                            json={"model": "plain", "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 400 and "no chat template" in answer.json()["error"]["message"]
        assert httpx.get(f"{plain}/nowhere").status_code == 404


def test_an_oversized_body_gets_413(tiny_llama_engine):
    app = create_app(Engine(tiny_llama_engine), ServerOptions(model_name="m", max_body_bytes=1000))
    with running(app) as url:
        answer = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x" * 2000})
        assert answer.status_code == 413 and answer.json()["error"]["message"]


def test_a_full_queue_answers_429_with_retry_after(chat_engine):
    from llmc.runtime.scheduler import SchedulerConfig

    engine = Engine(chat_engine, SchedulerConfig(max_num_seqs=1))
    step = engine.step
    engine.step = lambda: (time.sleep(0.1), step())[1]  # slow steps: the first request stays in flight
    app = create_app(engine, ServerOptions(model_name=MODEL, max_waiting=0))  # room for one request
    body = {"model": MODEL, "prompt": "def", "max_tokens": 100, "temperature": 0}
    with running(app) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}):
            deadline = time.monotonic() + 10
            while not app.state.llmc.active:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            rejected = httpx.post(f"{url}/v1/completions", json=body)
        assert rejected.status_code == 429, rejected.text
        assert rejected.headers["retry-after"] == "1" and rejected.json()["error"]["type"] == "rate_limit_error"
        deadline = time.monotonic() + 10
        while app.state.llmc.active:  # the first, abandoned by its client, is cancelled
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
    assert engine.blocks.stats.blocks_in_use == 0


def test_a_client_leaving_mid_stream_frees_its_blocks(server):
    url, engine, _ = server
    with httpx.stream("POST", f"{url}/v1/completions", json={
            "model": MODEL, "prompt": "def", "max_tokens": 400, "temperature": 0, "stream": True}) as answer:
        lines = answer.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert engine.has_unfinished()
    # blocks_come_back checks every block is freed well before the 400 tokens would be done


def test_draining_refuses_new_requests(server):
    url, _, app = server
    state = app.state.llmc
    state.draining = True
    try:
        assert httpx.get(f"{url}/health").status_code == 503
        answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "service_unavailable"
    finally:
        state.draining = False


def test_metrics(server):
    url, _, _ = server
    client(url).completions.create(model=MODEL, prompt="a", max_tokens=4, temperature=0)
    text = httpx.get(f"{url}/metrics").text
    for name in ("llmc_queue_length", "llmc_running_sequences", "llmc_kv_utilization", "llmc_prefix_hit_rate",
                 "llmc_generated_tokens_total", "llmc_time_to_first_token_seconds_bucket",
                 "llmc_time_per_output_token_seconds_count"):
        assert name in text, name
    generated = next(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("llmc_generated_tokens_total"))
    assert generated >= 4


def test_load_every_completed_answer_equals_its_request_alone(server, alone):
    """200 requests, 32 at a time, mixed lengths, every 10th cancelled by its client."""
    url, _, _ = server
    rng = random.Random(0)
    words = ["def", "class", "import", "return", "self", "for", "in", "if", "(", ")", ":", "x", "print"]
    jobs = [(" ".join(rng.choices(words, k=rng.randint(1, 20))), rng.randint(1, 24), i % 10 == 9) for i in range(200)]

    async def one(http, semaphore, prompt, max_tokens, cancel):
        async with semaphore:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            if cancel:
                with contextlib.suppress(asyncio.TimeoutError, httpx.TimeoutException):
                    await asyncio.wait_for(http.post(f"{url}/v1/completions", json=body), timeout=0.01)
                return None
            answer = await http.post(f"{url}/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["text"]

    async def run():
        semaphore = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, semaphore, *job) for job in jobs))

    texts = asyncio.run(run())
    for (prompt, max_tokens, cancel), text in zip(jobs, texts):
        if not cancel:
            assert text == alone(prompt, max_tokens)[0], prompt


def test_llmc_serve_drains_on_sigterm(chat_engine):
    """`llmc serve` as a user runs it: SIGTERM while a request runs lets it finish, then exits 0."""
    import signal
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "llmc.cli", "serve", str(chat_engine), "--port", str(port),
                                "--model-name", MODEL], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.1)
        result = {}
        body = {"model": MODEL, "prompt": "def", "max_tokens": 400, "temperature": 0}
        worker = threading.Thread(target=lambda: result.update(
            answer=httpx.post(f"{url}/v1/completions", json=body, timeout=60)))
        worker.start()
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        worker.join(timeout=60)
        assert result["answer"].status_code == 200
        assert result["answer"].json()["usage"]["completion_tokens"] == 400  # finished, not cut
        assert process.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health")
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("mode", [[], ["--batch", "2"], ["--rate", "50"]])
def test_bench_over_http_serves_the_same_workload(server, chat_engine, mode):
    from click.testing import CliRunner

    from llmc.cli import main

    url, _, _ = server
    args = ["bench", str(chat_engine), "--requests", "6", "--prompt-len", "8", "--output-len", "5",
            "--output-len-max", "9", "--json", *mode]
    over_http = CliRunner().invoke(main, [*args, "--url", url])
    here = CliRunner().invoke(main, args)
    assert over_http.exit_code == 0 and here.exit_code == 0, over_http.output + here.output
    remote, local = json.loads(over_http.stdout), json.loads(here.stdout)
    assert remote["requests"] == local["requests"] == 6 and remote["errors"] == 0
    assert remote["output_tokens"] == local["output_tokens"]  # exact lengths: ignore_eos reaches the server
    assert remote["input_tokens"] == local["input_tokens"]
    assert remote["ttft_ms_p50"] > 0 and remote["throughput_tok_s"] > 0


def test_bench_url_errors_are_one_line(chat_engine, tmp_path):
    from click.testing import CliRunner

    from llmc.cli import main

    result = CliRunner().invoke(main, ["bench", str(chat_engine), "--url", "http://127.0.0.1:9", "--requests", "1"])
    assert result.exit_code == 2 and "no OpenAI-compatible server answers there" in result.stderr
    result = CliRunner().invoke(main, ["bench", str(chat_engine), "--model", "x"])
    assert result.exit_code == 2 and "--model: only with --url" in result.stderr
    result = CliRunner().invoke(main, ["bench", str(chat_engine), "--url", "http://127.0.0.1:9",
                                       "--speculative-tokens", "2"])
    assert result.exit_code == 2 and "--speculative-tokens: not with --url" in result.stderr


KEY = "s3cret-key"


@pytest.mark.parametrize("public_metrics", [False, True])
def test_an_api_key_guards_every_route_but_health(chat_engine, public_metrics):
    app = create_app(Engine(chat_engine), ServerOptions(model_name=MODEL, api_key=KEY, public_metrics=public_metrics))
    body = {"model": MODEL, "prompt": "def", "max_tokens": 2}
    with running(app) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
            for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("GET", "/v1/models"), ("GET", "/nowhere")):
                answer = httpx.request(method, f"{url}{path}", json=body, headers=headers)
                assert answer.status_code == 401, (headers, path, answer.text)
                assert answer.json()["error"]["code"] == "invalid_api_key"
                assert answer.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == (200 if public_metrics else 401)
        key = {"Authorization": f"bearer {KEY}"}  # the scheme in any case
        assert httpx.get(f"{url}/metrics", headers=key).status_code == 200
        api = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert api.completions.create(**body).choices[0].text is not None
        assert len(list(api.completions.create(**body, stream=True))) >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        if not public_metrics:  # llmc bench --url sends the key, taken from the environment too
            from click.testing import CliRunner

            from llmc.cli import main

            args = ["bench", str(chat_engine), "--url", url, "--requests", "2", "--output-len", "3", "--json"]
            keyed = CliRunner().invoke(main, args, env={"LLMC_API_KEY": KEY})
            assert keyed.exit_code == 0 and json.loads(keyed.stdout)["errors"] == 0, keyed.output
            for extra, message in (([], "the server wants an API key: --api-key or LLMC_API_KEY"),
                                   (["--api-key", "wrong"], "the server refused the API key (401)")):
                refused = CliRunner().invoke(main, [*args, *extra], env={"LLMC_API_KEY": None})
                assert refused.exit_code == 2 and message in refused.stderr, refused.output


def test_a_request_past_the_timeout_is_aborted_and_told(chat_engine):
    engine = Engine(chat_engine)
    step = engine.step

    def slow_step():  # a step of a large model: the limit falls mid-generation
        time.sleep(0.02)
        return step()
    engine.step = slow_step
    app = create_app(engine, ServerOptions(model_name=MODEL, request_timeout_s=0.5))
    long = {"model": MODEL, "prompt": "def", "max_tokens": 200, "ignore_eos": True}
    with running(app) as url:
        assert httpx.post(f"{url}/v1/completions", json={**long, "max_tokens": 3}).status_code == 200
        for body in (long, {**long, "n": 2}):
            start = time.monotonic()
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert answer.status_code == 504 and time.monotonic() - start < 5, answer.text
            error = answer.json()["error"]
            assert error["type"] == "timeout_error" and "--request-timeout" in error["message"]
        with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=30) as answer:
            events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "timeout_error"
        assert any("choices" in json.loads(e) for e in events[:-2])  # it had begun streaming
        deadline = time.monotonic() + 10
        while engine.has_unfinished() or engine.blocks.stats.blocks_in_use:
            assert time.monotonic() < deadline, f"the aborted requests' blocks stayed: {engine.blocks.stats}"
            time.sleep(0.05)
        counted = re.search(r'llmc_requests_total\{outcome="timeout"\} (\S+)', httpx.get(f"{url}/metrics").text)
        # 4 generations timed out; n=2's second may be cancelled by its first's answer instead
        assert counted and float(counted.group(1)) >= 3


def test_llmc_serve_over_https_with_a_key_from_the_environment(chat_engine, tmp_path):
    """`llmc serve` as a user runs it with TLS, LLMC_API_KEY and a request timeout."""
    import os
    import subprocess
    import sys

    from tls import self_signed, trusting

    key_file, cert_file = self_signed(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "llmc.cli", "serve", str(chat_engine), "--port", str(port),
                                "--model-name", MODEL, "--ssl-keyfile", str(key_file), "--ssl-certfile", str(cert_file),
                                "--request-timeout", "60"],
                               env={**os.environ, "LLMC_API_KEY": KEY}, stderr=subprocess.PIPE, text=True)
    url, tls = f"https://127.0.0.1:{port}", trusting(cert_file)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", verify=tls).status_code == 200:
                    break
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.1)
        body = {"model": MODEL, "prompt": "def", "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body, verify=tls).status_code == 401
        answer = httpx.post(f"{url}/v1/completions", json=body, verify=tls, headers={"Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/health")
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.parametrize("args, message", [
    (["--ssl-keyfile", "{key}"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "{key}", "--ssl-certfile", "{key}"], "not a certificate and its private key"),
    (["--ssl-keyfile", "{key}", "--ssl-certfile", "{missing}"], "missing.pem"),
    (["--public-metrics"], "--public-metrics: only with --api-key"),
    (["--request-timeout", "0"], "--request-timeout: must be > 0"),
    (["--api-key", " "], "--api-key: must not be empty"),
])
def test_bad_serve_options_are_one_line(chat_engine, tmp_path, args, message):
    from click.testing import CliRunner

    from llmc.cli import main

    key = tmp_path / "key.pem"
    key.write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    args = [a.format(key=key, missing=tmp_path / "missing.pem") for a in args]
    result = CliRunner().invoke(main, ["serve", str(chat_engine), *args])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.stderr


def test_streamed_logprobs_equal_the_whole_answers(server):
    """Chat and completions (n=2, several prompts): the log-probabilities a stream carries chunk by
    chunk are the whole answer's, and the whole answer's chat entries spell its text."""
    url, _, _ = server
    api = client(url)
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                        top_logprobs=2).choices[0]
    content = whole.logprobs.content
    assert len(content) >= 1 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-9 for c in content)  # greedy: the token is the top one
    streamed = [e for chunk in api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                           logprobs=True, top_logprobs=2, stream=True)
                for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
    # the same tokens; their figures to fp32 rounding (a step's rows round with its company)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    body = {"model": MODEL, "prompt": ["def f(", "import"], "n": 2, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    answer = httpx.post(f"{url}/v1/completions", json=body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    by_index: dict[int, list] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as chunks:
        for line in chunks.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    by_index.setdefault(choice["index"], []).extend(choice["logprobs"]["token_logprobs"])
    for choice in answer["choices"]:
        assert by_index[choice["index"]] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-4)
    assert sum(len(c["logprobs"]["tokens"]) for c in answer["choices"]) == answer["usage"]["completion_tokens"]


def engines_serve_loads(chat_engine, monkeypatch, *option_sets):
    """(config, keyword arguments) of the Engine `llmc serve chat_engine` loads with each option set,
    the load stopped there."""
    from click.testing import CliRunner

    from llmc.cli import main
    from llmc.errors import LlmcError

    seen = []

    def engine(path, config, **kwargs):
        seen.append((config, kwargs))
        raise LlmcError("loaded no further")
    monkeypatch.setattr("llmc.runtime.engine.Engine", engine)
    for options in option_sets:
        result = CliRunner().invoke(main, ["serve", str(chat_engine), *options])
        assert result.exit_code == 2 and "loaded no further" in result.stderr, result.stderr
    return seen


def test_serve_hands_the_decode_model_switch_to_the_engine(chat_engine, monkeypatch):
    loads = engines_serve_loads(chat_engine, monkeypatch, [], ["--no-decode-model"], ["--decode-model"])
    assert [kwargs["decode_model"] for _, kwargs in loads] == [True, False, True]


def test_serve_schedules_as_a_server_whatever_the_engines_own_budget(chat_engine, monkeypatch):
    # An engine's own budget is 2,048 tokens on OpenVINO; a server keeps its steps to 512 unless told.
    from llmc.formats.engine_file import read_manifest

    loads = engines_serve_loads(chat_engine, monkeypatch, [], ["--max-num-batched-tokens", "64", "--max-num-seqs", "3"])
    seats = read_manifest(chat_engine)["paged"]["max_batch"]
    assert [(c.max_num_seqs, c.max_num_batched_tokens, c.lone_prompt_uses_budget) for c, _ in loads] == [
        (seats, 512, False), (3, 64, False)]
