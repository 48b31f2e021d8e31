"""The runtimes users would pick instead of Loom, as optional systems of the bench (``--peers``):
fastllm in-process (PyPI's ``ftllm``, whose launch/fetch API Loom's comes from) and llama.cpp's
``llama-server``, measured beside Loom's own server through one shared streaming client.

Every peer runs the default model: fastllm from a Hugging Face directory converted once from the
GGUF, llama.cpp from the GGUF as it is (Q4_1) and from an F32 GGUF made once with its own
``llama-quantize``. Converted files are kept in Loom's cache directory.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .harness import WARM_UP_TEXT, Request, Run, one_thread_each

PEERS = ("fastllm", "llama.cpp")
FASTLLM_HINT = "pip install --no-deps ftllm (its CPU library ships in the wheel)"
LLAMA_HINT = ("build llama.cpp's llama-server, e.g. from PyPI's sdist: pip download --no-deps --no-binary :all: "
              "llama-cpp-python; in its vendor/llama.cpp: cmake -B build && cmake --build build --target llama-server "
              "llama-quantize; then put build/bin on PATH or pass --llama-server")


def missing(peer: str, llama_server: str | None) -> str | None:
    """Why ``peer`` cannot run here (with how to install it), or None when it can."""
    if peer == "fastllm":
        import importlib.util
        return None if importlib.util.find_spec("ftllm") else f"fastllm is not installed: {FASTLLM_HINT}"
    if peer == "llama.cpp":
        return None if llama_binary("llama-server", llama_server) else f"llama-server was not found: {LLAMA_HINT}"
    raise ValueError(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}")


def llama_binary(name: str, llama_server: str | None) -> str | None:
    """``name`` (llama-server, llama-quantize) beside the given llama-server, else on PATH."""
    if llama_server:
        candidate = Path(llama_server).with_name(name)
        return str(candidate) if candidate.is_file() else None
    return shutil.which(name)


def peer_dir() -> Path:
    from models.cache import cache_dir
    path = cache_dir() / "peers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def hf_directory(gguf: Path) -> Path:
    """The GGUF as a float32 Hugging Face directory (through transformers' GGUF reader), for
    fastllm: the output layer written out (fastllm does not tie it) and no quantization note."""
    out = peer_dir() / f"{gguf.stem}-hf"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    tensors["lm_head.weight"] = tensors["lm_head.weight"].clone()  # tied: its own storage
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def f32_gguf(gguf: Path, llama_server: str | None) -> Path:
    """The GGUF requantized to F32 by llama.cpp's own tool (the same values as Loom's float32)."""
    out = peer_dir() / f"{gguf.stem}-F32.gguf"
    if not out.is_file():
        tool = llama_binary("llama-quantize", llama_server)
        if tool is None:
            raise FileNotFoundError(f"llama-quantize was not found beside llama-server: {LLAMA_HINT}")
        subprocess.run([tool, "--allow-requantize", str(gguf), str(out), "F32"], check=True, capture_output=True)
    return out


class FastLLM:
    """fastllm's own token API in this process: launch_response_llm_model, then one blocking
    fetch_response_llm_model per token from each request's thread (ctypes releases the GIL)."""

    def __init__(self, directory: Path, dtype: str, threads: int | None):
        from ftllm import llm

        if threads:
            llm.set_cpu_threads(threads)
        self.lib = llm.fastllm_lib
        self.model = llm.model(str(directory), dtype=dtype)
        self.dtype, self.threads = dtype, threads

    def generate(self, prompt: list[int], new_tokens: int, timestamps: list | None = None) -> list[int]:
        """Greedy, EOS held off until ``new_tokens`` (min_length), as Loom's ignore_eos."""
        tokens = (ctypes.c_int * len(prompt))(*prompt)
        handle = self.lib.launch_response_llm_model(self.model.model, len(prompt), tokens, new_tokens, new_tokens,
                                                    False, 1.0, 1, 1.0, 1.0, False, 0, None)
        out = []
        while (token := self.lib.fetch_response_llm_model(self.model.model, handle)) > -1:
            out.append(token)
            if timestamps is not None:
                timestamps.append(time.perf_counter())
        return out

    def run(self, requests: list[Request], workload: str) -> Run:
        self.generate(requests[0].prompt, 2)  # warm-up, untimed
        run = Run(f"fastllm {self.dtype}", workload, len(requests), note=f"ftllm, {self.threads or 'default'} threads")
        streams, start = [], time.perf_counter()

        def client(request: Request):
            launched, times = time.perf_counter(), []
            self.generate(request.prompt, request.new_tokens, times)
            streams.append((launched, times))

        one_thread_each(client, requests, run, start)
        for launched, times in streams:
            run.record(launched, times)
        return run


class ServerDidNotStart(RuntimeError):
    """A peer's server exited, or did not answer, at start: the bench goes on without it."""


class OpenAIServer:
    """A server process with OpenAI's /v1/completions, started for the ``with`` block. Requests are
    streamed, so that each token's arrival is timed, all from one client: one asyncio event loop
    (aiohttp), every stream a task of it. The client shares the cores with the server it measures;
    a thread per stream through httpx took 100-160 us of CPU a token, 3-4x this one, and slowed a
    fast server more than a slow one (docs/benchmarks-history.md, "The pool's pages, and a lighter bench
    client"). The token count is the server's own usage figure."""

    def __init__(self, system: str, command: list[str], port: int, model: str):
        self.system, self.command, self.port, self.model = system, command, port, model
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> "OpenAIServer":
        """Start the server and wait for its /health; ServerDidNotStart where it exits or stays silent."""
        # Its log goes to a file: a pipe nobody reads fills up and stalls a chatty server.
        self.log = peer_dir() / f"{self.system.replace(' ', '-')}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise ServerDidNotStart(f"{self.system} exited at start with status {self.process.returncode} "
                                        f"(its log: {self.log}): {self.log.read_text()[-500:]}")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise ServerDidNotStart(f"{self.system} did not answer /health within 300 s (its log: {self.log})")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return response.status == 200
        except OSError:  # not listening yet, or an error status (urllib's errors are OSErrors)
            return False

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def complete(self, prompt: str, new_tokens: int) -> tuple[str, int]:
        """Greedy text and its token count, EOS ignored."""
        text, count, _, _ = asyncio.run(self._streams([prompt], new_tokens))[0]
        return text, count

    def run(self, prompts: list[str], new_tokens: int, workload: str) -> Run:
        self.complete(WARM_UP_TEXT, 2)  # warm-up, untimed (not a measured prompt: llama-server would cache it)
        run = Run(self.system, workload, len(prompts), note="OpenAI /v1/completions, streamed, one shared client")
        cpu = self.server_cpu_seconds() + time.process_time()
        start = time.perf_counter()
        streams = asyncio.run(self._streams(prompts, new_tokens))
        run.seconds = time.perf_counter() - start
        for _, count, launched, times in streams:
            run.record(launched, times)
            run.tokens += count - len(times)  # a chunk may carry more than one token
        run.cpu_seconds = self.server_cpu_seconds() + time.process_time() - cpu  # the server's and the client's
        return run

    async def _streams(self, prompts: list[str], new_tokens: int) -> list[tuple[str, int, float, list[float]]]:
        """Every prompt streamed at once: each one's text, token count, launch time and token arrival times."""
        import aiohttp

        # A connection per request: llama-server may close a kept-alive one after a stream ends,
        # and a pool would then send the next request into a dead socket.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        # No limit on a whole cell (64 streams of a 7B file on a Zen 2 took over ten minutes), but a
        # stream that sends nothing for ten minutes has stalled: that fails the run.
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            return await asyncio.gather(*(self._stream(session, prompt, new_tokens) for prompt in prompts))

    async def _stream(self, session, prompt: str, new_tokens: int) -> tuple[str, int, float, list[float]]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        launched, text, times, count = time.perf_counter(), [], [], 0
        async with session.post(self.url + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:  # the stream's lines, as they arrive
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                if event.get("error"):
                    raise RuntimeError(f"{self.system}: {event['error']}")
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        text.append(choice["text"])
                        times.append(time.perf_counter())
                if event.get("usage"):
                    count = event["usage"]["completion_tokens"]
        return "".join(text), count, launched, times

    def server_cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server(gguf: Path, label: str, slots: int, args) -> OpenAIServer:
    """llama-server with a slot per concurrent stream (its continuous batching) on every core."""
    port = free_port()
    context = slots * 512  # each slot's share holds a prompt and 64 new tokens with room
    command = [llama_binary("llama-server", args.llama_server), "-m", str(gguf), "--port", str(port),
               "--host", "127.0.0.1", "-np", str(slots), "-c", str(context), "-t", str(os.cpu_count()),
               "-ctk", args.llama_kv_type, "-ctv", args.llama_kv_type]
    kv = "" if args.llama_kv_type == "f16" else f", KV {args.llama_kv_type}"  # f16: llama.cpp's default
    return OpenAIServer(f"llama.cpp server {label}{kv}", command, port, gguf.stem)


def loom_server(args, weights: str | None) -> OpenAIServer:
    """Loom's server on args.model in ``weights`` (None: the checkpoint's default)."""
    port = free_port()
    command = [sys.executable, "-m", "runtime", "serve", "--port", str(port), "--host", "127.0.0.1",
               "--model-name", "loom"] + ([] if weights is None else ["--weights", weights])
    if args.model:
        command += ["--model", args.model]
    if args.kv_dtype:
        command += ["--kv-dtype", args.kv_dtype]
    return OpenAIServer(f"loom server {weights or 'default'}{kv_label(args)}", command, port, "loom")


def kv_label(args) -> str:
    """How a Loom system's label names a KV cache other than the model's dtype."""
    return f", KV {args.kv_dtype}" if args.kv_dtype else ""
