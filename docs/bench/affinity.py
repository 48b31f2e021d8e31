"""What prefix affinity buys across Loom replicas (docs/scale-out.md): a shared-system-prompt
workload (16 system prompts of about 150 tokens, 4 questions each, 64 chats sent by 8 threads
in a shuffled order) through 2 replicas on a local Ray instance, once with Loom's prefix-affinity
routing and once with Ray's default (power of two choices). The prefix-cache hit rate is the
share of prompt tokens whose KV came from a replica's cache (OpenAI's usage.prompt_tokens_details).
The model is a tiny random-weight Llama with the default model's tokenizer: routing, not
arithmetic, decides the hit rate. Run from a checkout's root:

    pip install -e ".[ray]"
    python docs/bench/affinity.py
"""

import os
import random
import socket
import sys
import tempfile
import threading
import time
from collections import Counter

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import transformers  # noqa: E402

SYSTEMS = [f"You are assistant number {k}. " + "Answer in one short sentence, kindly and exactly. " * 12
           for k in range(16)]
QUESTIONS = 4


def checkpoint(path: str) -> str:
    from models.checkpoints.gguf import default_model_path, read_tokenizer
    tokenizer = read_tokenizer(default_model_path())
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def workload(url: str) -> tuple[float, Counter]:
    import openai
    client = openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=120)
    chats = [(s, q) for s in range(len(SYSTEMS)) for q in range(QUESTIONS)]
    random.Random(0).shuffle(chats)
    totals, lock, spread = Counter(), threading.Lock(), Counter()

    def worker(part):
        for s, q in part:
            raw = client.chat.completions.with_raw_response.create(model="tiny", max_tokens=2, messages=[
                {"role": "system", "content": SYSTEMS[s]}, {"role": "user", "content": f"What is {q} squared?"}])
            usage = raw.parse().usage
            with lock:
                totals["prompt"] += usage.prompt_tokens
                totals["cached"] += usage.prompt_tokens_details.cached_tokens
                spread[(s, raw.headers["x-loom-replica"])] += 1

    threads = [threading.Thread(target=worker, args=(chats[t::8],)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return totals["cached"] / totals["prompt"], spread


def main():
    import ray
    from ray import serve

    from runtime.serve.ray_app import loom_application, start_ray

    path = checkpoint(tempfile.mkdtemp())
    start_ray(num_cpus=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    print("| routing | prefix-cache hit rate | system prompts served on 1 / 2 replicas | seconds |\n| --- | --- | --- | --- |")
    for affinity in (True, False):
        serve.run(loom_application(path, replicas=2, num_cpus=0.5, model_name="tiny", prefix_affinity=affinity),
                  route_prefix="/", blocking=False)
        start = time.perf_counter()
        rate, spread = workload(f"http://127.0.0.1:{port}/v1")
        per_prompt = Counter(len({r for (s, r) in spread if s == k}) for k in range(len(SYSTEMS)))
        spread_text = ", ".join(f"{n} on {k}" for k, n in sorted(per_prompt.items()))
        print(f"| {'prefix affinity' if affinity else 'Ray default'} | {rate:.1%} | {spread_text} | "
              f"{time.perf_counter() - start:.1f} |", flush=True)
        serve.delete("default")  # fresh replicas, empty caches, for the next routing
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
