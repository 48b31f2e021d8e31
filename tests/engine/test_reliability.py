"""Faults (a forward, sampling, a consumer, the loop), backpressure, unfetched requests, shutdown
under load and at exit: nothing hangs, leaks or is lost. (Dropped handles and shutdown waking
fetchers: test_lifecycle.py.)"""

import gc
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from runtime import Engine, EngineBusy, EngineClosed, GenerationConfig, GenerationFailed, sampler

from ..conftest import VOCAB, reference, wait_until
from .test_api import Hooked

LONG = GenerationConfig(max_new_tokens=200, ignore_eos=True)


def test_launch_past_max_waiting_raises_engine_busy(llama):
    with Engine.from_pretrained(llama, max_batch_size=1, max_waiting=2) as engine:
        engine.model = Hooked(engine.model, delay=0.02)
        handles = [engine.launch_response_tokens([5, 6], LONG) for _ in range(3)]  # a burst: 1 runs, 2 wait
        with pytest.raises(EngineBusy, match="2 requests are already waiting"):
            engine.launch_response_tokens([5, 6], LONG)
        engine.abort_response(handles[0])
        wait_until(lambda: engine.stats()["waiting"] < 2)
        handles.append(engine.launch_response_tokens([5, 6], LONG))  # room again


def test_unfetched_finished_requests_do_not_accumulate(llama):
    with Engine.from_pretrained(llama) as engine:
        for _ in range(50):
            engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 4})  # never fetched, never kept
        gc.collect()
        keep = engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 4})
        list(engine.stream_response_tokens(keep))
        assert engine.stats()["open_handles"] <= 1


def test_consumer_that_stops_fetching_is_paused_without_holding_blocks(llama):
    with Engine.from_pretrained(llama, max_unfetched_tokens=8) as engine:
        handle = engine.launch_response_tokens([5, 6, 7], GenerationConfig(max_new_tokens=40, ignore_eos=True))
        # Nothing fetched yet: every token generated is waiting in the handle's queue.
        wait_until(lambda: handle.num_generated >= 8 and engine.stats()["running"] == 0)
        time.sleep(0.1)
        stats = engine.stats()
        assert stats["free_kv_blocks"] == stats["total_kv_blocks"] and handle.num_generated == 8
        tokens = list(engine.stream_response_tokens(handle, timeout=10))  # catching up resumes it
    assert tokens == reference(llama, [5, 6, 7], 40, eos_token_id=None)


def test_a_request_whose_sampling_fails_fails_alone(llama, monkeypatch):
    """If sampling the batch raises, each row is sampled alone: only the request whose own
    sampling raises fails; its batch-mates get their tokens from that same step."""
    real = sampler.sample

    def flaky(logits, contexts, generator, bitmask=None, proposals=None, draft_probs=None):
        if any(ctx.config.seed == 666 for ctx in contexts):
            raise ValueError("sampler exploded")
        return real(logits, contexts, generator, bitmask, proposals, draft_probs)

    monkeypatch.setattr(sampler, "sample", flaky)
    with Engine.from_pretrained(llama) as engine:
        engine.model = Hooked(engine.model, delay=0.01)
        mate = engine.launch_response_tokens([8, 9], {"max_new_tokens": 6, "ignore_eos": True})
        bad = engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 5, "seed": 666})
        with pytest.raises(GenerationFailed, match="sampler exploded"):
            engine.fetch_response_tokens(bad, timeout=10)
        assert list(engine.stream_response_tokens(mate, timeout=10)) == reference(llama, [8, 9], 6, eos_token_id=None)
        stats = engine.stats()
    assert stats["step_failures"] >= 1 and stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_fault_in_a_consumer_thread_leaks_nothing(llama, monkeypatch):
    died = []  # like the default hook, report and let go (pytest's would keep the frame alive)
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_type))
    with Engine.from_pretrained(llama) as engine:
        def consumer():
            handle = engine.launch_response_tokens([5, 6, 7], LONG)
            engine.fetch_response_tokens(handle, timeout=10)
            raise RuntimeError("consumer bug")

        thread = threading.Thread(target=consumer)
        thread.start()
        thread.join()
        assert died == [RuntimeError]
        gc.collect()
        wait_until(lambda: engine.stats()["open_handles"] == 0 and engine.stats()["running"] == 0)


def test_loop_that_cannot_go_on_fails_everyone_with_the_cause(llama, monkeypatch):
    with Engine.from_pretrained(llama) as engine:
        engine.model = Hooked(engine.model, delay=0.01)
        handle = engine.launch_response_tokens([5, 6, 7], LONG)
        engine.fetch_response_tokens(handle, timeout=10)
        monkeypatch.setattr(engine.scheduler, "schedule", lambda: (_ for _ in ()).throw(AssertionError("bug")))
        with pytest.raises(EngineClosed, match="engine loop died") as info:
            while True:
                engine.fetch_response_tokens(handle, timeout=10)
        assert isinstance(info.value.__cause__, AssertionError)
        with pytest.raises(EngineClosed):
            engine.launch_response_tokens([5, 6])


def test_shutdown_under_load_does_not_hang(llama):
    engine = Engine.from_pretrained(llama, max_batch_size=4)
    handles = [engine.launch_response_tokens([5 + i, 6], LONG) for i in range(12)]
    threads = [threading.Thread(target=lambda h=h: [None for _ in _drain(engine, h)]) for h in handles]
    for t in threads:
        t.start()
    time.sleep(0.1)
    start = time.monotonic()
    engine.shutdown()
    for t in threads:
        t.join(timeout=10)
    assert time.monotonic() - start < 10 and not any(t.is_alive() for t in threads)


def _drain(engine, handle):
    try:
        yield from engine.stream_response_tokens(handle)
    except EngineClosed:
        return


def test_interpreter_exit_with_requests_running_does_not_hang(tmp_path):
    script = textwrap.dedent("""
        import threading, torch, transformers
        from runtime import Engine, GenerationConfig
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, max_position_embeddings=4096)
        engine = Engine.from_pretrained(transformers.LlamaForCausalLM(cfg))
        handles = [engine.launch_response_tokens([1, 2, 3], GenerationConfig(max_new_tokens=4000, ignore_eos=True))
                   for _ in range(8)]
        threading.Thread(target=lambda: list(engine.stream_response_tokens(handles[0])), daemon=True).start()
        print("exiting", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "exiting" in done.stdout


def test_fault_in_forward_fails_only_that_steps_requests(llama):
    with Engine.from_pretrained(llama) as engine:
        engine.model = Hooked(engine.model, poison=VOCAB - 1)
        bad = engine.launch_response_tokens([5, VOCAB - 1, 7], {"max_new_tokens": 4})
        with pytest.raises(GenerationFailed, match="injected fault") as info:
            engine.fetch_response_tokens(bad, timeout=10)
        assert isinstance(info.value.__cause__, RuntimeError)
        good = [9, 10, 11]
        out = list(engine.stream_response_tokens(engine.launch_response_tokens(good, {"max_new_tokens": 6})))
        assert out == reference(llama, good, 6)
        stats = engine.stats()
        assert stats["step_failures"] == 1 and stats["free_kv_blocks"] == stats["total_kv_blocks"]
