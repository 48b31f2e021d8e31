"""The command line as a user runs it: python -m runtime ..."""

import json
import signal
import subprocess
import sys

import pytest

from runtime.cli import main

from ..conftest import interruptible


@pytest.mark.parametrize("command", ["chat", "generate", "bench", "serve"])
def test_every_subcommand_explains_itself(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--device", "--dtype"):
        assert flag in text


def test_generate_answers_every_prompt_in_order_through_the_chat_template(tmp_path):
    prompts = tmp_path / "prompts.txt"
    # (France's capital is a near-tie at the first token for the default model in its Q4_1 blocks,
    # whose products round their input to 8 bits: "The capital..." or "L'Étoile..."; Japan's is not)
    prompts.write_text("What is 2 plus 2?\nName a colour.\n\nWhat is the capital of Japan?\n")
    out = tmp_path / "answers.jsonl"
    assert main(["generate", str(prompts), "--max-new-tokens", "12", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["What is 2 plus 2?", "Name a colour.", "What is the capital of Japan?"]
    assert all(r["response"].strip() for r in rows)
    assert "Tokyo" in rows[2]["response"]  # an instruct model answers its chat template, not raw text


def test_generate_with_speculative_tokens_gives_the_same_answers(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Repeat this text exactly: All that glitters is not gold.\n")
    answers = []
    # off, prompt lookup, and the embedded model's own 4-bit blocks drafting for its float32 self
    for extra in ([], ["--speculative-tokens", "4"],
                  ["--speculative-tokens", "4", "--draft", "default", "--draft-weights", "stored"]):
        out = tmp_path / "answers.jsonl"
        assert main(["generate", str(prompts), "--weights", "float32", "--max-new-tokens", "16", "--output", str(out),
                     *extra]) == 0
        answers.append(out.read_text())
    assert answers[0] == answers[1] == answers[2]


def test_generate_raw_sends_the_text_as_is(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n")
    out = tmp_path / "answers.jsonl"
    assert main(["generate", str(prompts), "--raw", "--max-new-tokens", "4", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["prompt"] == "The capital of France is"


def test_generate_answers_in_a_schema_or_a_choice(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Describe Paris as JSON.\nDescribe Rome as JSON.\n")
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps({"type": "object", "additionalProperties": False, "required": ["city"],
                                  "properties": {"city": {"type": "string", "maxLength": 20}}}))
    out = tmp_path / "answers.jsonl"
    assert main(["generate", str(prompts), "--json-schema", str(schema), "--max-new-tokens", "24",
                 "--output", str(out)]) == 0
    assert [json.loads(json.loads(line)["response"])["city"] for line in out.read_text().splitlines()] == ["Paris", "Rome"]
    assert main(["generate", str(prompts), "--choice", "yes", "--choice", "no", "--output", str(out)]) == 0
    assert all(json.loads(line)["response"] in ("yes", "no") for line in out.read_text().splitlines())


@pytest.mark.parametrize("argv,message", [
    (["generate", "no-such-file.txt"], "error: cannot read prompts from no-such-file.txt: No such file"),
    (["generate", "-", "--json-schema", "no-such.json"], "error: cannot read the JSON schema no-such.json"),
    (["generate", "-", "--regex", "a", "--choice", "b"], "error: at most one of json_schema, regex"),
    (["generate", "-", "--temperature", "-1"], "error: temperature must be in [0.0, inf], got -1.0"),
    (["chat", "--top-p", "2"], "error: top_p must be in (0.0, 1.0], got 2.0"),
    (["bench", "--peers", "vllm"], 2),
    (["chat", "--weights", "int2"], 2),
    (["serve", "--speculative-tokens", "17"], 2),
    (["serve", "--draft-weights", "int2"], 2),
])
def test_bad_arguments_fail_in_one_line_before_the_model_loads(argv, message, capsys, monkeypatch):
    import runtime.cli
    monkeypatch.setattr(runtime.cli, "load_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as done:
        main(argv)
    if isinstance(message, int):  # argparse's own refusal: exit status 2, the reason on stderr
        assert done.value.code == message and "error: argument --" in capsys.readouterr().err
    else:
        assert str(done.value.code).startswith(message)


@pytest.mark.parametrize("option,value,message", [
    ("--regex", "a(b", 'error: invalid regex: invalid regex "a(b" (in regex): regex parse error:\n    a(b\n     ^\n'
                       "error: unclosed group"),
    ("--json-schema", {"type": "object", "properties": {"a": {"type": "strin"}}},
     "error: invalid json_schema: Invalid type: strin"),
])
def test_a_constraint_that_cannot_compile_fails_before_the_model_loads(option, value, message, tmp_path,
                                                                       monkeypatch):
    import runtime.cli
    monkeypatch.setattr(runtime.cli, "load_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    if option == "--json-schema":
        (schema := tmp_path / "schema.json").write_text(json.dumps(value))
        value = str(schema)
    with pytest.raises(SystemExit) as done:
        main(["generate", "-", option, value])
    assert done.value.code == message


@pytest.mark.parametrize("replicas", ["1", "2"])
def test_serve_on_a_port_in_use_says_so_before_the_model_loads(replicas, monkeypatch):
    import socket

    import runtime.cli
    if replicas != "1":
        ray_app = pytest.importorskip("runtime.serve.ray_app", reason="replicas need the 'ray' extra")
        monkeypatch.setattr(ray_app, "run", lambda *a, **k: pytest.fail("Ray was started"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(runtime.cli, "load_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as done:
            main(["serve", "--port", str(port), "--replicas", replicas])
    assert done.value.code == (f"error: port {port} on 127.0.0.1 is already in use; stop what listens there or "
                               "choose another port with --port")


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_a_missing_extra_is_named_with_its_install_command(command, monkeypatch):
    import runtime.cli
    extra, _ = runtime.cli.EXTRAS[command]
    monkeypatch.setitem(runtime.cli.EXTRAS, command, (extra, ("no_such_module_for_loom",)))
    monkeypatch.setattr(runtime.cli, "load_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as done:
        main([command])
    assert f"pip install -e '.[{extra}]'" in str(done.value.code)


def test_chat_streams_answers_until_an_empty_line():
    """In float32: the default model's stored Q4_1 blocks answer this question by instruction set (its first token a
    near tie, "L" over "The" by 0.19 in log-probability with AVX2's kernels, "The" with AVX-512's), float32 "The
    capital of France is Paris." on either (2026-12-07, a Zen 3)."""
    done = subprocess.run([sys.executable, "-m", "runtime", "chat", "--max-new-tokens", "16", "--weights", "float32"],
                          input="What is the capital of France?\n\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "bot> " in done.stdout and "Paris" in done.stdout


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on():
    chat = subprocess.Popen([sys.executable, "-u", "-m", "runtime", "chat", "--max-new-tokens", "100000",
                             "--temperature", "1", "--seed", "1"], preexec_fn=interruptible,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        chat.stdin.write("Tell me a very long story.\n")
        chat.stdin.flush()
        seen = ""
        while len(seen) < 40:  # the answer is streaming
            seen += chat.stdout.read(1)
        chat.send_signal(signal.SIGINT)
        out, err = chat.communicate("What is the capital of France?\n\n", timeout=300)
    finally:
        chat.kill()
    assert chat.returncode == 0, err
    assert "[stopped]" in out and "Traceback" not in err
    assert out.count("bot> ") + seen.count("bot> ") == 2
def test_bench_smoke_run_writes_table_json_and_plot(tmp_path):
    assert main(["bench", "--smoke", "--repeat", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert sum(r["workload"] == "W1" and r["system"] == "loom" for r in report["runs"]) == 2
    loom_row = next(line for line in (tmp_path / "bench.md").read_text().splitlines() if line.startswith("| W1 | 0 | loom "))
    assert "median of 2 runs" in loom_row  # the table shows one row per system: its median run
    systems = {(r["workload"], r["system"]) for r in report["runs"]}
    assert ("W1", "loom") in systems and ("W1", "transformers static") in systems
    assert ("W4", "loom, prefix cache on") in systems
    floors = [r for r in report["runs"] if r["system"] == "queue floor"]
    assert floors and all(r["handoff_p99_ms"] > 0 for r in floors)
    assert all(r["tokens"] > 0 and r["throughput"] > 0 for r in report["runs"] if r not in floors)
    pure = next(r for r in report["runs"] if r["system"] == "pure forward")
    loom = next(r for r in report["runs"] if r["workload"] == pure["workload"] and r["system"] == "loom")
    assert pure["tokens"] == loom["tokens"] and pure["tpot_p50_ms"] > 0  # the runtime-overhead baseline
    if sys.platform == "linux":  # the share of CPU time a hypervisor took meanwhile, from /proc/stat
        steals = [r["steal_pct"] for r in report["runs"]]
        assert all(s is None or 0 <= s <= 100 for s in steals)  # None: a run shorter than one clock tick
        assert any(s is not None for s in steals)
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert all(r["competitors"] == 0 and r["cpu_ms_per_token"] > 0 for r in report["runs"] if r not in floors)


def test_bench_runs_beside_busy_competitor_processes(tmp_path):
    assert main(["bench", "--smoke", "--workloads", "w1", "--systems", "loom,pure",
                 "--competitors", "0,1", "--out", str(tmp_path)]) == 0
    runs = [r for r in json.loads((tmp_path / "bench.json").read_text())["runs"] if r["workload"] == "W1"]
    assert sorted((r["system"], r["competitors"]) for r in runs) == [
        ("loom", 0), ("loom", 1), ("pure forward", 0), ("pure forward", 1)]
    assert all(r["cpu_ms_per_token"] > 0 for r in runs)
    assert "| W1 | 1 | loom |" in (tmp_path / "bench.md").read_text()


def test_bench_w6_runs_loom_in_process_and_through_its_server(tmp_path, capsys):
    """W6 without the peers installed: they are skipped with how to install them; Loom's server
    (through the shared streaming client) gives the same greedy text as Loom in-process."""
    assert main(["bench", "--workloads", "w6", "--sweep", "", "--peer-streams", "1,2", "--peers", "llama.cpp",
                 "--llama-server", str(tmp_path / "no-llama-server"), "--out", str(tmp_path)]) == 0
    assert "W6: skipping llama.cpp: llama-server was not found" in capsys.readouterr().out
    runs = json.loads((tmp_path / "bench.json").read_text())["runs"]
    assert sorted((r["system"], r["concurrency"]) for r in runs) == [
        ("loom default", 1), ("loom default", 2), ("loom server default", 1), ("loom server default", 2)]
    assert all(r["tokens"] == 64 * r["concurrency"] and r["cpu_ms_per_token"] > 0 for r in runs)
    server = next(r for r in runs if r["system"] == "loom server default")  # (the default weights)
    agreement = server["note"].split("greedy text equal to Loom's for ")[1].removesuffix(" chars")
    assert all(a == b for a, b in (pair.split("/") for pair in agreement.split(", "))), agreement


def test_transformers_continuous_batching_that_cannot_start_says_why(monkeypatch):
    """Its manager's thread dies at start when its cache exceeds the memory it allows itself (as
    W2's did in pages of 256); the bench raises that error, not a timeout of results never coming."""
    from transformers.generation.continuous_batching import cache

    from runtime.bench import harness
    from runtime.bench.workloads import gpt2_small

    monkeypatch.setattr(cache.PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1024)
    hf = gpt2_small(smoke=True)
    requests = harness.random_requests(2, 4, 4, hf.config.vocab_size)
    with pytest.raises(RuntimeError, match="continuous batching stopped: Memory footprint .* more than available"):
        harness.run_hf_continuous(hf, requests, "W1")


def test_a_peer_server_that_dies_at_start_says_so_and_stops(tmp_path, monkeypatch):
    """W6 skips such a peer with this message (a llama-server built for another processor dies of
    an illegal instruction as it loads) and measures the others."""
    from runtime.bench import peers

    monkeypatch.setenv("LOOM_CACHE", str(tmp_path))  # where its log goes
    command = [sys.executable, "-c", "print('loading model'); raise SystemExit(132)"]
    server = peers.OpenAIServer("dying peer", command, peers.free_port(), "model")
    with pytest.raises(peers.ServerDidNotStart, match=r"exited at start with status 132 .*loading model"):
        server.start()
    assert server.process.returncode == 132


def test_the_command_lines_process_freezes_its_imported_modules_out_of_the_garbage_collector():
    # python -m runtime's own module run in a fresh interpreter; --help stops it before any model loads
    probe = ("import gc, runpy, sys\n"
             "sys.argv = ['runtime', '--help']\n"
             "try:\n    runpy.run_module('runtime', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print(gc.get_freeze_count())")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    frozen = int(done.stdout.strip().splitlines()[-1])
    assert frozen > 50_000  # torch's and Loom's modules, walked by no collection after this
