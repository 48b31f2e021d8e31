"""A multithreaded app: a pool of worker threads, each streaming its own answer while the others
run, all served by one engine that batches them into shared forward passes.

    python examples/threaded_app.py [--workers 8]
"""

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from runtime import Engine, GenerationConfig

QUESTIONS = [
    "What is a thread in computing?", "Name three planets.", "How do bees make honey?",
    "Give me a tip for learning Python.", "What is the boiling point of water?", "Why do cats purr?",
    "Write a haiku about rain.", "What does a compiler do?", "How far away is the Moon?",
    "Suggest a name for a bakery.", "What is photosynthesis?", "Explain a queue in one sentence.",
]
print_lock = threading.Lock()


def ask(engine, index, question):
    start = time.perf_counter()
    first = None
    pieces = []
    for piece in engine.stream_response([{"role": "user", "content": question}], GenerationConfig(max_new_tokens=64)):
        first = first or time.perf_counter()
        pieces.append(piece)
    total = time.perf_counter() - start
    answer = "".join(pieces).strip().replace("\n", " ")
    with print_lock:
        print(f"[{index:2d}] first token {1000 * (first - start):6.0f} ms, done {total:5.2f} s | {question}\n"
              f"     {answer[:150]}")
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8, help="worker threads (default: 8)")
    args = parser.parse_args()
    with Engine.from_pretrained() as engine:
        start = time.perf_counter()
        with ThreadPoolExecutor(args.workers) as pool:
            latencies = list(pool.map(ask, [engine] * len(QUESTIONS), range(len(QUESTIONS)), QUESTIONS))
        wall = time.perf_counter() - start
        stats = engine.stats()
    print(f"\n{len(QUESTIONS)} requests on {args.workers} threads in {wall:.2f} s; "
          f"{stats['tokens_generated']} tokens ({stats['tokens_generated'] / wall:.0f} tok/s), "
          f"{stats['steps']} batched steps, mean latency {sum(latencies) / len(latencies):.2f} s")


if __name__ == "__main__":
    main()
