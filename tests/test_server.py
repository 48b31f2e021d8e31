"""The OpenAI-compatible server, started for real on a loopback port, driven by the official
openai client."""

import asyncio
import socket
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from runtime import Engine, EngineBusy, GenerationConfig  # noqa: E402
from runtime.serve import create_app  # noqa: E402

KEY = "test-key"
MODEL = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    engine = Engine.from_pretrained(max_batch_size=16, max_waiting=4)
    port = free_port()
    config = uvicorn.Config(create_app(engine, MODEL, KEY), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield engine, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=30)
    engine.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)


def ask(number):
    return [{"role": "user", "content": f"What is {number} plus {number}?"}]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[1] + "/health").json()["status"] == "ok"


def test_chat_completion_matches_the_engine(server, client):
    engine = server[0]
    reply = client.chat.completions.create(model=MODEL, messages=ask(2), max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == engine.response(ask(2), GenerationConfig(max_new_tokens=24))
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == len(engine.encode(ask(2)))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens > 0


def test_concurrent_streaming_chats(server, client):
    engine = server[0]
    results = {}

    def stream(n):
        chunks = client.chat.completions.create(model=MODEL, messages=ask(n), max_tokens=20, stream=True,
                                                stream_options={"include_usage": True})
        pieces, finish, usage = [], None, None
        for chunk in chunks:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        results[n] = ("".join(pieces), finish, usage)

    threads = [threading.Thread(target=stream, args=(n,)) for n in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 6
    for n, (text, finish, usage) in results.items():
        assert text == engine.response(ask(n), GenerationConfig(max_new_tokens=20))
        assert finish in ("stop", "length") and usage.completion_tokens > 0


def test_completion_with_stop(server, client):
    prompt = "Count: one, two, three, four,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    assert " six" in full, full
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[" six"])
    assert cut.choices[0].text == full[:full.index(" six")]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    make = lambda: client.chat.completions.create(model=MODEL, messages=ask(5), max_tokens=12, temperature=0.8,
                                                  top_p=0.9, seed=7).choices[0].message.content
    assert make() == make()


@pytest.mark.parametrize("kwargs,status,code", [
    (dict(model="gpt-4", messages=ask(1)), 404, "model_not_found"),
    (dict(model=MODEL, messages=ask(1), n=2), 400, "unsupported_value"),
    (dict(model=MODEL, messages=ask(1), temperature=5), 400, "invalid_value"),
    (dict(model=MODEL, messages=ask(1), max_tokens=0), 400, "invalid_value"),
    (dict(model=MODEL, messages=[]), 400, "invalid_value"),
    (dict(model=MODEL, messages=[{"role": "robot", "content": "hi"}]), 400, "invalid_value"),
])
def test_bad_requests_get_openai_errors(client, kwargs, status, code):
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**kwargs)
    assert info.value.status_code == status
    assert info.value.body["code"] == code and info.value.body["message"]


def test_wrong_key_is_401(server):
    bad = openai.OpenAI(base_url=server[1] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401


def test_waiting_bound_is_429(server, client):
    engine = server[0]
    blockers = []
    deadline = time.monotonic() + 30
    try:
        while engine.stats()["running"] < 16 or engine.stats()["waiting"] < 4:  # fill batch, then queue
            assert time.monotonic() < deadline
            try:
                blockers.append(engine.launch_response_tokens(
                    [1, 2, 3], GenerationConfig(max_new_tokens=400, ignore_eos=True)))
            except EngineBusy:
                time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL, messages=ask(1), max_tokens=4)
        assert info.value.body["code"] == "engine_busy"
    finally:
        for h in blockers:
            engine.abort_response(h)


def test_disconnect_mid_stream_aborts_the_request(server):
    engine, url = server
    body = {"model": MODEL, "messages": ask(9), "max_tokens": 400, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and '"content"' in line and '""' not in line:
                break  # got a real token: now hang up
    deadline = time.monotonic() + 10
    while engine.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats()["running"] == 0
    assert engine.stats()["tokens_generated"] < 10_000


def test_metrics(server, client):
    client.chat.completions.create(model=MODEL, messages=ask(3), max_tokens=8)
    text = httpx.get(server[1] + "/metrics").text
    for name in ("loom_requests_running", "loom_requests_waiting", "loom_kv_blocks_used", "loom_kv_blocks_free",
                 "loom_tokens_generated_total", "loom_time_to_first_token_seconds_bucket",
                 "loom_time_per_output_token_seconds_count"):
        assert name in text
    count = next(line for line in text.splitlines() if line.startswith("loom_time_to_first_token_seconds_count"))
    assert int(count.split()[1]) >= 1


def test_async_api(server):
    engine = server[0]

    async def main():
        streamed = [piece async for piece in engine.astream_response(ask(4), GenerationConfig(max_new_tokens=12))]
        handle = engine.launch_response_tokens([1, 2, 3], GenerationConfig(max_new_tokens=5, ignore_eos=True))
        tokens = []
        while (token := await engine.fetch_async(handle, timeout=30)) != -1:
            tokens.append(token)
        return "".join(streamed), tokens

    text, tokens = asyncio.run(main())
    assert text == engine.response(ask(4), GenerationConfig(max_new_tokens=12))
    assert len(tokens) == 5


def test_serve_command_stops_on_sigterm():
    import signal
    import subprocess
    import sys
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        # uvicorn drains, runs the app's shutdown, then re-raises SIGTERM: -15 is the expected code.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "loom: engine shut down" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
