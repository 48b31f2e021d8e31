"""An engine's and a request's life: dropped engines are freed, forked children get a clear
error, and every way a request is released (its Handle dropped, the engine shut down) frees its
blocks and wakes whoever is blocked on it."""

import gc
import os
import threading
import time
import warnings
import weakref

import pytest

from runtime import ContextLimitWarning, Engine, EngineClosed, GenerationConfig, HandleReleased

from ..conftest import new_threads, wait_until
from .test_api import Hooked

LONG = GenerationConfig(max_new_tokens=200, ignore_eos=True)


def blocked_fetch(engine, handle_id):
    """Fetch ``handle_id`` in a thread until it ends; returns (thread, outcome list)."""
    outcome = []

    def fetch():
        try:
            while engine.fetch_response_tokens(handle_id) != -1:
                pass
            outcome.append(-1)
        except BaseException as error:  # noqa: BLE001 - the outcome under test
            outcome.append(error)

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    return thread, outcome


def collected(ref: weakref.ref, seconds: float = 10.0) -> bool:
    """Whether ``ref`` dies within ``seconds``: the loop thread lets go of its engine only when
    the step in flight (and its grace for consumers) is over."""
    deadline = time.monotonic() + seconds
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return ref() is None


def test_an_engine_dropped_without_shutdown_is_freed(llama):
    engine = Engine.from_pretrained(llama)
    before = set(threading.enumerate())
    list(engine.stream_response_tokens(engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 4})))
    [loop], pool = new_threads(before), weakref.ref(engine.kv_cache.data)
    owner = weakref.ref(engine)
    assert loop.is_alive()
    del engine
    assert collected(owner), "something still holds the engine"
    loop.join(timeout=10)
    assert not loop.is_alive(), "the loop thread outlived its engine"
    # The pool committer (runtime/pool_commit.py) holds the pool while it commits a chunk: on a busy
    # machine, at nice 19, it may finish that chunk after the engine is gone.
    assert collected(pool), "the KV pool was not released"


def test_an_engine_dropped_mid_request_is_freed(llama):
    engine = Engine.from_pretrained(llama)
    engine.model = Hooked(engine.model, delay=0.01)
    before = set(threading.enumerate())
    handle = engine.launch_response_tokens([5, 6, 7], LONG)
    engine.fetch_response_tokens(handle, timeout=10)
    [loop], owner = new_threads(before), weakref.ref(engine)
    del engine, handle
    assert collected(owner), "something still holds the engine"
    loop.join(timeout=10)
    assert not loop.is_alive()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_a_clear_error_not_a_hang(llama):
    with Engine.from_pretrained(llama) as engine:
        list(engine.stream_response_tokens(engine.launch_response_tokens([5, 6], {"max_new_tokens": 2})))
        read, write = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "fork() of a multi-threaded process"
            pid = os.fork()
        if pid == 0:  # the child: report what launch does, and leave without running pytest's teardown
            try:
                engine.launch_response_tokens([5, 6], {"max_new_tokens": 2})
                message = b"launched"
            except EngineClosed as error:
                message = str(error).encode()
            os.write(write, message)
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        message = os.read(read, 4096).decode()
        os.close(read)
        assert os.waitstatus_to_exitcode(status) == 0
        assert "cannot be used in the forked child" in message and "create a new Engine in the child" in message
        # The parent's engine is untouched.
        assert len(list(engine.stream_response_tokens(engine.launch_response_tokens([5, 6], {"max_new_tokens": 2})))) == 2


def test_an_ended_request_keeps_nothing_but_its_number(llama):
    """The engine remembers recent ended handles, to tell a late fetch why they are gone: their
    numbers, not the Handle objects, which would keep each request's context (its tokens, times,
    logprobs and queue) alive for the next 4,096 requests."""
    engine = Engine.from_pretrained(llama)
    try:
        handle = engine.launch_response_tokens([5, 6, 7], GenerationConfig(max_new_tokens=3, logprobs=2))
        assert len(list(engine.stream_response_tokens(handle))) == 3
        context = weakref.ref(handle.context)
        number = int(handle)
        del handle
        assert collected(context)
        with pytest.raises(HandleReleased, match="stream ended"):
            engine.fetch_response_tokens(number)
    finally:
        engine.shutdown()


def test_dropping_the_handle_wakes_a_thread_blocked_on_its_int_id(llama):
    with Engine.from_pretrained(llama) as engine:
        engine.model = Hooked(engine.model, delay=0.05)
        handle = engine.launch_response_tokens([5, 6, 7], LONG)
        thread, outcome = blocked_fetch(engine, int(handle))
        del handle
        gc.collect()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the fetcher stayed blocked after its Handle was dropped"
        assert isinstance(outcome[0], HandleReleased) and "its Handle object was dropped" in str(outcome[0])
        stats = engine.stats()
        assert stats["open_handles"] == 0 and stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_fetching_an_int_id_after_its_handle_was_dropped_says_so(llama):
    with Engine.from_pretrained(llama) as engine:
        handle_id = int(engine.launch_response_tokens([5, 6, 7], LONG))  # the Handle is dropped at once
        gc.collect()
        engine.launch_response_tokens([8], {"max_new_tokens": 1})  # the next launch releases it
        with pytest.raises(KeyError, match="keep the Handle, not int\\(handle\\), while you fetch"):
            engine.fetch_response_tokens(handle_id, timeout=10)
        engine.abort_response(handle_id)  # a no-op on a released request


def test_shutdown_wakes_a_thread_blocked_on_an_int_id(llama):
    engine = Engine.from_pretrained(llama)
    engine.model = Hooked(engine.model, delay=0.05)
    handle = engine.launch_response_tokens([5, 6, 7], LONG)
    thread, outcome = blocked_fetch(engine, int(handle))
    time.sleep(0.1)
    engine.shutdown()
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(outcome[0], EngineClosed)


def test_abort_wakes_a_blocked_fetcher_with_the_end_of_the_stream(llama):
    with Engine.from_pretrained(llama) as engine:
        engine.model = Hooked(engine.model, delay=0.05)
        handle = engine.launch_response_tokens([5, 6, 7], LONG)
        thread, outcome = blocked_fetch(engine, handle)
        engine.abort_response(handle)
        thread.join(timeout=30)
        assert outcome == [-1] and handle.finish_reason == "abort"


def test_abort_after_the_last_token_was_generated_discards_the_rest(llama):
    with Engine.from_pretrained(llama) as engine:
        handle = engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 3, "ignore_eos": True})
        while handle.num_generated < 3:
            time.sleep(0.01)
        engine.abort_response(handle)
        engine.abort_response(handle)
        assert engine.fetch_response_tokens(handle, timeout=10) == -1
        assert handle.finish_reason == "length"  # it had finished; the abort only dropped the tokens


def test_a_request_longer_than_the_context_warns(llama):
    with Engine.from_pretrained(llama) as engine:  # the tiny Llama's context is 256
        with pytest.warns(ContextLimitWarning, match="at most 6 tokens will be generated"):
            handle = engine.launch_response_tokens(list(range(4, 254)), {"max_new_tokens": 100})
        assert len(list(engine.stream_response_tokens(handle, timeout=30))) <= 6
        assert handle.finish_reason in ("length", "stop")
        with warnings.catch_warnings():
            warnings.simplefilter("error", ContextLimitWarning)  # strict: the warning becomes an error
            with pytest.raises(ContextLimitWarning):
                engine.launch_response_tokens(list(range(4, 254)), {"max_new_tokens": 100})


def test_dropped_handle_releases_its_request(llama):
    with Engine.from_pretrained(llama) as engine:
        engine.model = Hooked(engine.model, delay=0.01)
        handle = engine.launch_response_tokens(list(range(4, 40)), LONG)
        wait_until(lambda: engine.stats()["running"] == 1)
        del handle
        gc.collect()
        wait_until(lambda: engine.stats()["open_handles"] == 0)
        stats = engine.stats()
        assert stats["running"] == 0 and stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_shutdown_wakes_blocked_fetchers(llama):
    engine = Engine.from_pretrained(llama, max_batch_size=8)
    engine.model = Hooked(engine.model, delay=0.05)
    handles = [engine.launch_response_tokens([5 + i, 6], LONG) for i in range(4)]
    errors = []

    def consume(handle):
        try:
            for _ in engine.stream_response_tokens(handle):
                pass
        except EngineClosed as e:
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    time.sleep(0.2)
    engine.shutdown()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 4
    with pytest.raises(EngineClosed, match="shut down"):
        engine.launch_response_tokens([5, 6])
    engine.shutdown()  # idempotent
