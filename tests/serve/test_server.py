"""The OpenAI-compatible server, started for real on a loopback port, driven by the official
openai client."""

import asyncio
import json
import threading
import time

import httpx
import jsonschema
import pydantic
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from runtime import Engine, EngineBusy, GenerationConfig  # noqa: E402
from runtime.bench.peers import free_port  # noqa: E402
from runtime.serve import create_app  # noqa: E402

from ..conftest import interruptible  # noqa: E402

KEY = "test-key"
MODEL = "smollm2"


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


def test_ignore_eos_generates_past_the_end_of_the_answer(client):
    """The ignore_eos extension (as vLLM and llama.cpp's server take it), which the bench uses."""
    plain = client.chat.completions.create(model=MODEL, messages=ask(1), max_tokens=48, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 48
    forced = client.chat.completions.create(model=MODEL, messages=ask(1), max_tokens=48, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 48


def test_seeded_sampling_is_reproducible(client):
    make = lambda: client.chat.completions.create(model=MODEL, messages=ask(5), max_tokens=12, temperature=0.8,
                                                  top_p=0.9, seed=7).choices[0].message.content
    assert make() == make()


def test_logit_bias_keys_sent_as_json_strings_are_token_ids(server, client):
    """OpenAI's API sends logit_bias as a JSON object, its token ids as string keys ("123"): the
    server turns them into the ints GenerationConfig takes."""
    engine = server[0]
    token = engine.encode(" blue")[-1]
    reply = client.chat.completions.create(model=MODEL, messages=ask(3), max_tokens=4, temperature=0,
                                           logit_bias={str(token): 100})
    biased = GenerationConfig(max_new_tokens=4, ignore_eos=True, logit_bias={token: 100.0})
    expected = engine.complete(ask(3), biased)
    assert expected.token_ids == [token] * 4 and reply.choices[0].message.content == expected.text


@pytest.mark.parametrize("kwargs,status,code", [
    (dict(model="gpt-4", messages=ask(1)), 404, "model_not_found"),
    (dict(model=MODEL, messages=ask(1), n=0), 400, "invalid_value"),
    (dict(model=MODEL, messages=ask(1), logprobs=True, top_logprobs=30), 400, "invalid_value"),
    (dict(model=MODEL, messages=ask(1), top_logprobs=3), 400, "invalid_value"),
    (dict(model=MODEL, messages=ask(1), response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}), 400, "invalid_value"),
    (dict(model=MODEL, messages=ask(1), logit_bias={"99999999": 5}), 400, "invalid_value"),
    (dict(model=MODEL, messages=ask(1), logit_bias={"blue": 5}), 400, "invalid_value"),
    (dict(model=MODEL, messages=ask(1), tool_choice="required"), 400, "invalid_value"),
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


CHAT = json.dumps({"model": MODEL, "messages": ask(1), "max_tokens": 1})
WANTS_CHAT = 'send a JSON object with "model" and "messages"'


@pytest.mark.parametrize("method,path,body,status,code,param,message", [
    ("POST", "/v1/chat/completions", '{"model": "m", "messages": [}', 400, "invalid_json", None,
     f"the request body is not valid JSON: Expecting value (at character 28); {WANTS_CHAT}"),
    ("POST", "/v1/chat/completions", "", 400, "invalid_json", None, f"the request body is empty; {WANTS_CHAT}"),
    ("POST", "/v1/completions", "[1]", 400, "invalid_json", None,
     'the request body is an array, not an object; send a JSON object with "model" and "prompt"'),
    ("POST", "/v1/chat/completions", json.dumps({"model": MODEL}), 400, "invalid_value", "messages",
     f"messages is required; {WANTS_CHAT}"),
    ("POST", "/v1/chat/completions", CHAT[:-1] + ', "max_token": 5}', 400, "unknown_parameter", "max_token",
     "Unrecognized request argument supplied: max_token"),
    ("GET", "/v1/chat/complete", None, 404, "unknown_url", None,
     "unknown URL: GET /v1/chat/complete; the routes are GET /v1/models, POST /v1/chat/completions, "
     "POST /v1/completions, GET /health, GET /metrics"),
    ("GET", "/v1/chat/completions", None, 405, "method_not_allowed", None,
     "/v1/chat/completions does not take GET; use POST"),
])
def test_malformed_requests_get_openai_errors_that_say_what_to_send(server, method, path, body, status, code,
                                                                     param, message):
    response = httpx.request(method, server[1] + path, content=body, timeout=60,
                             headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == status
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                         "code": code}}


def test_openai_arguments_that_do_not_change_the_answer_are_accepted(client):
    reply = client.chat.completions.create(model=MODEL, messages=ask(1), max_tokens=1, user="u1", store=False,
                                           metadata={"k": "v"}, service_tier="auto", parallel_tool_calls=False)
    assert reply.choices[0].finish_reason in ("stop", "length")


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
        assert info.value.response.headers["Retry-After"] == "1"  # the openai client waits that long to retry
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


def test_speculative_tokens_field_gives_the_same_answer_and_counts_in_metrics(server, client):
    """Loom's speculative_tokens extension (GenerationConfig.speculative_tokens): greedy answers
    stay the same; the proposed and accepted tokens are counted in /metrics."""
    messages = [{"role": "user", "content": "Repeat this text exactly: All that glitters is not gold."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    fast = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                          extra_body={"speculative_tokens": 4})
    assert fast.choices[0].message.content == plain.choices[0].message.content
    text = httpx.get(server[1] + "/metrics").text
    counts = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("loom_speculative_")}
    assert counts["loom_speculative_proposed_tokens_total"] >= counts["loom_speculative_accepted_tokens_total"] > 0
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                       extra_body={"speculative_tokens": 99})


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


def start_serve_command(port, *options):
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--port", str(port), *options],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=interruptible)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)


def test_serve_command_stops_on_sigterm():
    import signal
    proc = start_serve_command(free_port())
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # a drain is a clean stop
        assert "loom: engine shut down" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def stream_until_signal(port: int, proc, sig) -> list[str]:
    """The data of every event of a long chat stream, ``sig`` sent to the server ``proc`` at its third."""
    body = {"model": "x", "messages": ask(9), "max_tokens": 5000, "ignore_eos": True, "stream": True}
    body["model"] = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
    events = []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:  # streaming: now the signal
                    proc.send_signal(sig)
    return events


@pytest.mark.parametrize("sig,status", [("SIGINT", 130), ("SIGTERM", 0)])  # 130: the shell's code for Ctrl-C
def test_ctrl_c_and_sigterm_past_the_drain_end_open_streams_with_an_error_event_and_done(sig, status):
    """Ctrl-C stops at once; SIGTERM lets open requests finish for --drain-timeout, then ends the
    ones still open the same way."""
    import signal
    proc = start_serve_command(port := free_port(), "--drain-timeout", "1")
    try:
        events = stream_until_signal(port, proc, getattr(signal, sig))
        assert events[-1] == "[DONE]" and '"engine_closed"' in events[-2], events[-3:]
        assert proc.wait(timeout=30) == status
        output = proc.stdout.read()
        assert "loom: engine shut down" in output and "CancelledError" not in output and "Traceback" not in output
    finally:
        if proc.poll() is None:
            proc.kill()


def test_list_of_parts_content_is_joined(server, client):
    engine = server[0]
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2 "}, {"type": "text", "text": "plus 2?"}]}]
    reply = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8)
    assert reply.choices[0].message.content == engine.response(ask(2), GenerationConfig(max_new_tokens=8))


class FailingModel:
    """The engine's model, failing every step that holds ``poison``."""

    def __init__(self, model, poison):
        self.model, self.poison = model, poison

    def __call__(self, step, kv_cache):
        if bool((step.input_ids == self.poison).any()):
            raise RuntimeError("injected fault")
        return self.model(step, kv_cache)


@pytest.fixture
def failing(server):
    engine = server[0]
    model = engine.model
    poison = engine.encode("zebra")[-1]
    engine.model = FailingModel(model, poison)
    yield [{"role": "user", "content": "zebra"}]
    engine.model = model


def test_a_request_that_fails_gets_an_openai_error_not_plain_text(server, failing):
    response = httpx.post(server[1] + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": MODEL, "messages": failing, "max_tokens": 4}, timeout=60)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "generation_failed" and "injected fault" in error["message"]


def test_a_stream_that_fails_ends_with_an_error_the_client_raises(client, failing):
    stream = client.chat.completions.create(model=MODEL, messages=failing, max_tokens=4, stream=True)
    with pytest.raises(openai.APIError, match="injected fault"):
        for _ in stream:
            pass


def test_fuzzed_request_bodies_get_json_answers_and_never_harm_a_batch_mate(server):
    """Random bodies, NaN and Infinity included (Python's JSON reads them): each answer is a
    completion or an OpenAI-shaped 4xx error; a greedy request running beside them is unchanged."""
    import random
    engine, url = server
    rng = random.Random(5)
    pools = {
        "temperature": [0, 1e-300, 0.7, 2, 3, -1, "x", None, float("nan"), float("inf")],
        "top_p": [1, 0.5, 1e-300, 0, 2, float("nan"), None],
        "max_tokens": [1, 2, 0, -5, "2", 2.5, True],
        "seed": [0, 7, 2**64, -1, 1.5, None],
        "n": [1, 2, 0, 200],
        "logprobs": [True, False, "x"],
        "top_logprobs": [0, 5, 21, -1],
        "presence_penalty": [0, 2, 3, float("nan")],
        "logit_bias": [{"5": 10}, {"x": 1}, {"99999999": 1}, {"5": 101}, []],
        "response_format": [{"type": "json_object"}, {"type": "json_schema"}, {"type": "xml"},
                            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}}}],
        "tool_choice": ["auto", "required", "none", {"type": "function", "function": {"name": "nope"}}],
        "stop": ["a", ["b", "c"], [], 5, None],
        "stream": [True, False, "yes"],
        "messages": [ask(1), [], [{"role": "robot", "content": "x"}], [{"role": "user"}],
                     [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "hello"],
        "model": [MODEL, "gpt-4", 5],
    }
    mate = threading.Thread(target=lambda: results.append(engine.response(ask(6), GenerationConfig(max_new_tokens=24))))
    results, statuses = [], {}
    mate.start()
    for _ in range(60):
        body = {"model": MODEL, "messages": ask(1), "max_tokens": 2}
        for name in rng.sample(sorted(pools), rng.randint(1, 3)):
            body[name] = rng.choice(pools[name])
        response = httpx.post(url + "/v1/chat/completions", content=json.dumps(body), timeout=120,
                              headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code in (200, 400, 404), (body, response.text)
        if response.status_code != 200:
            assert response.json()["error"]["message"], body
        elif response.headers["content-type"].startswith("text/event-stream"):
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), body
        else:
            assert response.json()["choices"][0]["finish_reason"] in ("stop", "length"), body
    mate.join(timeout=120)
    assert results == [engine.response(ask(6), GenerationConfig(max_new_tokens=24))]
    assert statuses.get(200) and statuses.get(400)


# -- structured output, logprobs, n and tools through the official client ---------------------

class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=100)


def test_parse_returns_the_pydantic_object(client):
    reply = client.chat.completions.parse(model=MODEL, max_tokens=60, response_format=City, messages=[
        {"role": "user", "content": "Describe Paris as JSON with its name, country and population in millions."}])
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and city.name == "Paris", reply.choices[0].message.content


def test_a_streamed_json_schema_answer_joins_into_valid_json(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["colors"],
              "properties": {"colors": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}}
    chunks = client.chat.completions.create(
        model=MODEL, max_tokens=60, stream=True, messages=[{"role": "user", "content": "Name three colors."}],
        response_format={"type": "json_schema", "json_schema": {"name": "colors", "schema": schema}})
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1
    jsonschema.validate(json.loads("".join(pieces)), schema)


def test_json_object_mode_gives_an_object(client):
    reply = client.chat.completions.create(model=MODEL, max_tokens=40, response_format={"type": "json_object"},
                                           messages=[{"role": "user", "content": "Give me a tiny JSON object."}])
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut at max_tokens: still the start of an object
        assert reply.choices[0].message.content.startswith("{")


def test_chat_logprobs_have_openais_shape(server, client):
    reply = client.chat.completions.create(model=MODEL, messages=ask(3), max_tokens=12, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert "".join(entry.token for entry in content) == choice.message.content
    assert len(content) == reply.usage.completion_tokens - (choice.finish_reason == "stop")
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
    streamed = client.chat.completions.create(model=MODEL, messages=ask(3), max_tokens=12, logprobs=True,
                                              top_logprobs=3, stream=True)
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_have_the_legacy_shape(client):
    reply = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, logprobs=2, temperature=0)
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text and len(logprobs.token_logprobs) == len(logprobs.tokens)
    assert all(len(top) <= 2 and max(top.values()) >= lp - 1e-6
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    assert logprobs.text_offset[0] == 0


def test_n_choices_in_one_response_and_in_a_stream(client):
    reply = client.chat.completions.create(model=MODEL, messages=ask(4), max_tokens=10, n=3, temperature=1.0, seed=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    assert reply.usage.completion_tokens >= 3
    again = client.chat.completions.create(model=MODEL, messages=ask(4), max_tokens=10, n=3, temperature=1.0, seed=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    chunks = client.chat.completions.create(model=MODEL, messages=ask(4), max_tokens=10, n=3, temperature=1.0,
                                            seed=3, stream=True)
    texts, finished = ["", "", ""], set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == [c.message.content for c in reply.choices] and finished == {0, 1, 2}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "string", "maxLength": 12}}}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_has_arguments_that_validate(client, choice):
    reply = client.chat.completions.create(model=MODEL, max_tokens=60, tools=[WEATHER, TIME], tool_choice=choice,
                                           messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"


OPEN_WEATHER = {"type": "function", "function": {  # as OpenAI's docs write tools: nothing closed or bounded
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                  "detail": {"type": "object"}, "hours": {"type": "array", "items": {"type": "number"}},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}


@pytest.mark.parametrize("max_tokens", [48, 80, 256])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_with_an_open_schema_always_ends_as_a_valid_call(client, choice, max_tokens):
    """Open objects, strings, arrays and numbers let a model run on until max_tokens cut the JSON;
    a forced call's schema is closed and bounded to fit max_tokens, so it always ends as a call."""
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, max_tokens=max_tokens, tools=[OPEN_WEATHER, TIME], tool_choice=choice, seed=seed,
            temperature=1.0 if seed else 0.0,
            messages=[{"role": "user", "content": "Describe the weather in Oslo in great detail, hour by hour."}])
        choice_ = reply.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_.message.content
        call = choice_.message.tool_calls[0]
        tool = {"get_weather": OPEN_WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert reply.usage.completion_tokens <= max_tokens


def test_a_max_tokens_too_small_for_any_forced_call_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens=8 cannot hold a forced call of 'get_weather'") as refused:
        client.chat.completions.create(model=MODEL, max_tokens=8, tools=[OPEN_WEATHER], tool_choice="required",
                                       messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert refused.value.body["param"] == "max_tokens"


def test_a_tool_conversation_goes_on_after_the_result(client):
    first = client.chat.completions.create(model=MODEL, max_tokens=60, tools=[WEATHER], tool_choice="required",
                                           messages=[{"role": "user", "content": "Weather in Rome?"}])
    call = first.choices[0].message.tool_calls[0]
    follow = client.chat.completions.create(model=MODEL, max_tokens=20, tools=[WEATHER], tool_choice="none", messages=[
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}])
    assert follow.choices[0].message.content and follow.choices[0].message.tool_calls is None
    streamed = client.chat.completions.create(model=MODEL, max_tokens=60, tools=[WEATHER], tool_choice="required",
                                              stream=True, messages=[{"role": "user", "content": "Weather in Rome?"}])
    calls = [c.choices[0].delta.tool_calls for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0][0].function.name == "get_weather"
    assert json.loads(calls[0][0].function.arguments) == json.loads(call.function.arguments)


def test_auto_tool_choice_returns_a_call_only_when_the_answer_is_one(client):
    from runtime.serve.schema import Tool, parse_call
    tools = [Tool.model_validate(WEATHER)]
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    assert parse_call(call, tools)["arguments"] == {"city": "Oslo", "unit": "celsius"}
    assert parse_call(f"<tool_call>{call}</tool_call>", tools)["name"] == "get_weather"
    assert parse_call('{"name": "unknown", "arguments": {}}', tools) is None
    assert parse_call("It is sunny.", tools) is None
    reply = client.chat.completions.create(model=MODEL, max_tokens=30, tools=[WEATHER], tool_choice="auto",
                                           messages=[{"role": "user", "content": "Say hello."}])
    message = reply.choices[0].message
    if message.tool_calls:  # the model chose to call: then it is a valid call
        assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "get_weather"
    else:
        assert message.content and reply.choices[0].finish_reason in ("stop", "length")


def test_usage_counts_prompt_tokens_served_from_the_prefix_cache(client):
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    first = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[system, *ask(7)])
    again = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[system, *ask(8)])
    assert first.usage.prompt_tokens_details.cached_tokens % 16 == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * (len("You are a careful assistant. " * 20) // 80)


@pytest.mark.parametrize("kind", ["chat.completion", "text_completion"])
def test_a_text_chunk_from_its_template_is_the_chunk_encoded_whole(server, kind):
    """A streamed text chunk without logprobs is its template around the piece's JSON string
    (Reply.text_chunk_template): the same bytes as the chunk built and encoded whole, whatever
    the piece holds."""
    from runtime.serve.metrics import Metrics
    from runtime.serve.reply import Choice, Reply

    engine = server[0]
    handle = engine.launch_response_tokens(engine.encode("Hi"), GenerationConfig(max_new_tokens=1))
    choice = Choice(1, handle, None)
    reply = Reply(kind, MODEL, 3, [choice], Metrics(engine), engine.token_bytes)
    before, after = reply.text_chunk_template(choice)
    for piece in ["plain", ' "quoted" \\ back', "naïve – 漢字 🙂", "line\nbreak\t", "\0piece\0", ""]:
        whole = reply.envelope([reply.chunk(choice, {"content": piece}, piece)], chunk=True)
        assert before + json.dumps(piece) + after == f"data: {json.dumps(whole)}\n\n"
    list(engine.stream_response_tokens(handle))
