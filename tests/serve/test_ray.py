"""Loom replicas on Ray Serve (a local Ray instance, a tiny random-weight model with the default
model's tokenizer): the same OpenAI routes as the single-process server, requests spread over the
replicas, each response naming its replica, greedy answers equal to one in-process engine's."""

import threading
import time
from pathlib import Path

import pytest
import torch
import transformers

serve = pytest.importorskip("ray.serve", reason="replicas need the 'ray' extra: pip install -e '.[ray]'")
openai = pytest.importorskip("openai")

from runtime import Engine, GenerationConfig  # noqa: E402
from runtime.bench.peers import free_port  # noqa: E402
from runtime.serve.ray_app import REPLICA_HEADER, loom_application, missing_room, start_ray  # noqa: E402

from ..conftest import interruptible  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from models.checkpoints.gguf import default_model_path, read_tokenizer
    tokenizer = read_tokenizer(default_model_path())
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("tiny")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def replicas(checkpoint):
    import ray
    start_ray(num_cpus=2)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(loom_application(checkpoint, replicas=2, num_cpus=0.5, dtype="float64", model_name=MODEL,
                               max_batch_size=16), route_prefix="/", blocking=False)
    yield f"http://127.0.0.1:{port}/v1"
    serve.shutdown()
    ray.shutdown()


@pytest.mark.parametrize("sig,status", [("SIGTERM", 0), ("SIGINT", 130)])  # the single server's statuses
def test_serve_command_runs_replicas_and_stops_on_a_signal(checkpoint, sig, status):
    """`python -m runtime serve --replicas 2` (its own local Ray instance), then SIGTERM or Ctrl-C:
    a stream still open past --drain-timeout ends with an error event and [DONE], and none of
    Ray's noise about the Serve it was told to start and stop is shown."""
    import signal
    import subprocess
    import sys

    import httpx
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "runtime", "serve", "--replicas", "2", "--replica-cpus", "0.5",
                               "--model", str(checkpoint), "--model-name", MODEL, "--port", str(port),
                               "--drain-timeout", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=interruptible)
    events = []
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the replicas did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json().get("status") == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
        assert reply.status_code == 200 and reply.headers[REPLICA_HEADER]
        body = {"model": MODEL, "messages": ask(1), "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:  # streaming: now the signal
                        server.send_signal(getattr(signal, sig))
    finally:
        if server.poll() is None and len(events) < 3:
            server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=120)[0]
    assert events[-1] == "[DONE]" and '"replica_failed"' in events[-2], events[-2:]
    assert server.returncode == status and "loom: replicas shut down" in output, output[-2000:]
    for noise in ("Connecting to existing Serve app", "(raylet)", "graceful_shutdown failed"):
        assert noise not in output, output[-2000:]


def test_serve_command_refuses_replicas_that_cannot_fit(checkpoint):
    """Ray Serve would wait forever for room it lacks, saying so only in its own logs."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "runtime", "serve", "--replicas", "2", "--replica-cpus", "1000",
                           "--model", str(checkpoint), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "error: 2 replicas reserving 1000 CPU each need 2000 CPUs, and this Ray instance has" in done.stderr


def ask(i):
    return [{"role": "user", "content": f"Tell me about the number {i}."}]


def test_two_replicas_serve_the_same_routes_and_answers(replicas, checkpoint):
    client = openai.OpenAI(base_url=replicas, api_key="-", max_retries=0, timeout=120)
    results, errors = {}, []

    def one(i):
        try:
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=ask(i), max_tokens=8,
                                                                   temperature=0)
            results[i] = (raw.headers[REPLICA_HEADER], raw.parse().choices[0].message.content)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    # one request first, alone: the SDK builds its response models on the first parse, and 32 threads racing
    # there raised pydantic's "BaseModel cannot be instantiated directly" in two of them (once in a full run)
    one(0)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(1, 32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == 32
    assert len({replica for replica, _ in results.values()}) == 2  # both replicas served some
    with Engine.from_pretrained(checkpoint, dtype=torch.float64) as engine:
        expected = {i: engine.response(ask(i), GenerationConfig(max_new_tokens=8)) for i in results}
    assert {i: text for i, (_, text) in results.items()} == expected


def test_health_reports_every_replica(replicas):
    import httpx
    assert httpx.get(replicas.removesuffix("/v1") + "/health").json() == {"status": "ok", "replicas": {"RUNNING": 2}}


def test_metrics_gather_every_replica(replicas):
    import httpx
    time.sleep(5)  # each replica publishes every 2 s
    text = httpx.get(replicas.removesuffix("/v1") + "/metrics").text
    samples = [line for line in text.splitlines() if line.startswith("loom_tokens_generated_total{")]
    assert len(samples) == 2 and sum(float(line.split()[-1]) for line in samples) > 0, text
    assert text.count("# TYPE loom_time_to_first_token_seconds histogram") == 1


def test_a_replica_streams_and_reports_errors_as_the_single_server_does(replicas):
    client = openai.OpenAI(base_url=replicas, api_key="-", max_retries=0, timeout=120)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=ask(1), max_tokens=8, stream=True) if c.choices]
    assert "".join(pieces)
    with pytest.raises(openai.BadRequestError, match="n: Input should be greater than or equal to 1"):
        client.chat.completions.create(model=MODEL, messages=ask(1), n=0)
    import httpx
    wrong = httpx.put(replicas + "/chat/completions", timeout=60)  # the ingress forwards every method
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def test_what_a_ray_instance_lacks_for_the_replicas_is_named(replicas):
    assert missing_room(4, 0.5, 0) is None  # the fixture's instance has 2 CPUs
    assert missing_room(5, 0.5, 0) == ("5 replicas reserving 0.5 CPU each need 2.5 CPUs, and this Ray instance "
                                       "has 2: lower --replicas or --replica-cpus")
    assert "need 1 GPUs, and this Ray instance has 0: lower --replicas or --replica-gpus" in missing_room(1, 0, 1)


def ray_processes() -> list[tuple[str, int]]:
    """(title, nice value) of every Ray worker process on this machine."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            title = (stat.parent / "cmdline").read_bytes().split(b"\0")[0].decode()
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        if title.startswith("ray::"):
            found.append((title, int(fields[16])))  # the 19th field of /proc/PID/stat: nice
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads nice values from /proc")
def test_replicas_and_serve_run_at_the_applications_priority(replicas):
    """Ray's default of nice 15 leaves a replica a few percent of a core beside busy processes.
    Loom's leave them at the application's own niceness: this test's, which `nice` may have raised."""
    import os
    workers = ray_processes()
    serving = [(title, nice) for title, nice in workers
               if any(name in title for name in ("LoomReplica", "LoomIngress", "ProxyActor", "ServeController"))]
    assert sum("LoomReplica" in title for title, _ in serving) == 2, workers
    assert any("LoomIngress" in title for title, _ in serving), workers
    assert {nice for _, nice in serving} == {os.nice(0)}, serving


def test_the_ingress_reserves_no_cpu():
    """Serve's default of one CPU left `serve --replicas 2` on two cores waiting forever for a third."""
    ingress = loom_application(None, replicas=2)._bound_deployment
    assert ingress.name == "LoomIngress" and ingress.ray_actor_options["num_cpus"] == 0


def test_bad_replica_options_fail_before_anything_starts():
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        loom_application(None, replicas=0)
    with pytest.raises(TypeError, match="unknown engine option"):
        loom_application(None, replicas=2, max_batch=3)


def shared_prefix_requests(client, system: str, count: int) -> list:
    """``count`` chats that share ``system`` and differ in their question, sent from threads;
    (replica, cached prompt tokens, prompt tokens) of each."""
    results = []

    def one(i):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=2, messages=[{"role": "system", "content": system}, *ask(i)])
        usage = raw.parse().usage
        results.append((raw.headers[REPLICA_HEADER], usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


def test_requests_sharing_a_prefix_land_on_one_replica(replicas):
    client = openai.OpenAI(base_url=replicas, api_key="-", max_retries=0, timeout=120)
    results = shared_prefix_requests(client, "You answer questions about numbers, briefly and exactly. " * 12, 16)
    assert len(results) == 16 and len({replica for replica, _, _ in results}) == 1
    assert sum(cached for _, cached, _ in results) > 0  # the shared blocks were reused


def test_a_killed_replica_fails_its_requests_cleanly_and_the_app_recovers(replicas):
    """Streams, so that each request knows its replica from its first bytes: the killed replica's
    requests end with an error event, every other request finishes, and Ray Serve brings the
    replica back. A request that has not started when its replica dies gets a 503 (not covered
    here: which requests are still waiting at the kill is down to timing)."""
    import ray
    client = openai.OpenAI(base_url=replicas, api_key="-", max_retries=0, timeout=120)
    count, started, lock = 16, threading.Barrier(16 + 1, timeout=120), threading.Lock()
    replica_of, outcome = {}, {}

    def one(i):
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=ask(i), max_tokens=1500, stream=True, extra_body={"ignore_eos": True})
            replica_of[i] = raw.headers[REPLICA_HEADER]
        finally:
            if i not in replica_of:
                started.abort()  # the test fails on the barrier at once rather than after its timeout
        started.wait()
        try:
            pieces = sum(1 for chunk in raw.parse() if chunk.choices and chunk.choices[0].delta.content)
            result = "ok" if pieces else "empty"
        except openai.APIError as error:  # the stream ended with an error event
            result = "error event" if "replica_failed" in str(error.body) + str(error) else repr(error)
        with lock:
            outcome[i] = result

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    started.wait()  # every request is streaming from its replica
    victim = max(set(replica_of.values()), key=list(replica_of.values()).count)
    actor = next(a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("#" + victim))
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    for t in threads:
        t.join(timeout=300)
    expected = {i: "error event" if replica_of[i] == victim else "ok" for i in range(count)}
    assert outcome == expected, (victim, replica_of)
    deadline = time.monotonic() + 120
    while running_replicas() != 2:  # Ray Serve replaces the dead replica
        assert time.monotonic() < deadline, serve.status()
        time.sleep(0.5)
    assert len(shared_prefix_requests(client, "Back to normal.", 8)) == 8


def running_replicas() -> int:
    deployment = serve.status().applications["default"].deployments["LoomReplica"]
    return deployment.replica_states.get("RUNNING", 0)
