"""The public contract of the token API: what blocks, what returns -1, what raises."""

import dataclasses
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

from runtime import Engine, GenerationConfig
from runtime import loop
from runtime.context import ResponseContext

from ..conftest import new_threads, reference


class Hooked:
    """Wraps the engine's model to slow each step down or to fail steps on demand."""

    def __init__(self, model, delay=0.0, poison=None):
        self.model, self.delay, self.poison, self.calls = model, delay, poison, 0

    def __call__(self, step, kv_cache):
        self.calls += 1
        time.sleep(self.delay)
        if self.poison is not None and bool((step.input_ids == self.poison).any()):
            raise RuntimeError("injected fault")
        return self.model(step, kv_cache)


@pytest.fixture
def engine(llama):
    with Engine.from_pretrained(llama, max_batch_size=8) as engine:
        yield engine


def slow(engine, delay=0.02):
    engine.model = Hooked(engine.model, delay=delay)
    return engine


LONG = GenerationConfig(max_new_tokens=200, ignore_eos=True)


def test_loop_thread_starts_lazily_on_first_launch(llama):
    before = set(threading.enumerate())
    with Engine.from_pretrained(llama) as engine:
        assert not new_threads(before)
        handle = engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 2})
        [loop_thread] = new_threads(before)
        assert loop_thread.is_alive()
        list(engine.stream_response_tokens(handle))
    assert not loop_thread.is_alive()  # shutdown joined it


def test_end_of_stream_then_handle_is_released(engine):
    handle = engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 3, "ignore_eos": True})
    tokens = [engine.fetch_response_tokens(handle) for _ in range(3)]
    assert all(t >= 0 for t in tokens)
    assert engine.fetch_response_tokens(handle) == -1
    with pytest.raises(KeyError, match="handle 0 was released: its stream ended and -1 was fetched"):
        engine.fetch_response_tokens(handle)
    engine.abort_response(handle)  # a no-op once the stream has ended


def test_unknown_handle(engine):
    for call in (engine.fetch_response_tokens, engine.abort_response):
        with pytest.raises(KeyError, match="unknown handle 12345: this engine never launched it"):
            call(12345)


def test_timeout_then_fetch_again(engine):
    slow(engine, delay=0.3)
    handle = engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 2, "ignore_eos": True})
    with pytest.raises(TimeoutError, match="within 0.01 s"):
        engine.fetch_response_tokens(handle, timeout=0.01)
    assert len(list(engine.stream_response_tokens(handle, timeout=10))) == 2


def test_abort_frees_blocks_and_ends_stream(engine):
    slow(engine)
    handle = engine.launch_response_tokens(list(range(4, 60)), LONG)
    other = engine.launch_response_tokens([9, 10, 11], {"max_new_tokens": 5, "ignore_eos": True})
    engine.fetch_response_tokens(handle, timeout=10)
    engine.abort_response(handle)
    engine.abort_response(handle)  # idempotent
    assert engine.fetch_response_tokens(handle, timeout=1) == -1
    with pytest.raises(KeyError):
        engine.fetch_response_tokens(handle)
    engine.abort_response(handle)  # a no-op on a released request
    assert len(list(engine.stream_response_tokens(other, timeout=10))) == 5  # others go on
    stats = engine.stats()
    assert stats["running"] == 0 and stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_abort_a_waiting_request(llama):
    with Engine.from_pretrained(llama, max_batch_size=1) as engine:
        slow(engine)
        first = engine.launch_response_tokens([5, 6], LONG)
        queued = engine.launch_response_tokens([7, 8], LONG)
        assert engine.stats()["waiting"] >= 1
        engine.abort_response(queued)
        assert engine.fetch_response_tokens(queued, timeout=1) == -1
        engine.abort_response(first)
        assert engine.stats()["waiting"] == 0


def test_nothing_runs_while_paused_and_what_was_launched_then_runs_in_launch_order(llama):
    config = GenerationConfig(max_new_tokens=3, ignore_eos=True)
    with Engine.from_pretrained(llama, max_batch_size=2) as engine:
        with engine.paused():
            handles = [engine.launch_response_tokens([5 + i, 6], config) for i in range(3)]
            with pytest.raises(TimeoutError):
                engine.fetch_response_tokens(handles[0], timeout=0.2)
            stats = engine.stats()
            assert stats["steps"] == 0 and stats["waiting"] == 3
        assert [len(list(engine.stream_response_tokens(h, timeout=30))) for h in handles] == [3, 3, 3]
    # two fit in the batch: the first two launched, and the third once they had finished
    assert handles[2].token_times[0] > max(handles[0].token_times[-1], handles[1].token_times[-1])


def thread_cpu_seconds(thread: threading.Thread) -> float:
    """CPU time (user + system) of one thread of this process, from /proc."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads per-thread CPU time from /proc")
def test_idle_loop_thread_sleeps(engine):
    threads = set(threading.enumerate())
    list(engine.stream_response_tokens(engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 4})))
    [loop_thread] = new_threads(threads)
    before = thread_cpu_seconds(loop_thread)
    time.sleep(1.0)
    assert thread_cpu_seconds(loop_thread) - before <= 0.02  # a clock tick or two, not a poll


@pytest.mark.timing
def test_blocked_consumers_take_their_tokens_before_the_next_forward(engine):
    """On the CPU the loop leaves the cores to consumers blocked in fetch before the next forward
    starts; a consumer woken during a forward waits milliseconds for a core and the GIL. A race
    outcome, so opt-in (--timing): on a busy machine a consumer may miss the 3 ms grace."""
    untaken, model, streams = [], engine.model, {}  # streams: {handle: tokens its consumer took}

    def forward(step, kv_cache):
        untaken.append(sum(handle.num_generated - taken for handle, taken in list(streams.items())))
        return model(step, kv_cache)

    engine.model = forward
    config = GenerationConfig(max_new_tokens=60, ignore_eos=True)

    def consume(i):
        handle = engine.launch_response_tokens([1 + i, 2, 3], config)
        streams[handle] = 0
        while engine.fetch_response_tokens(handle, timeout=60) != -1:
            streams[handle] += 1

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    late = sum(1 for n in untaken if n)  # without the grace: 5-17 of ~62 steps on 2 cores
    assert len(untaken) >= 60 and late <= 2, f"{late} of {len(untaken)} forwards began with tokens untaken"


def test_a_consumer_that_never_takes_its_token_delays_a_step_only_until_the_deadline():
    ctx = ResponseContext(1, [1, 2], GenerationConfig(), 64, frozenset(), torch.device("cpu"))
    handoff = loop.Handoff()
    handoff.expect([ctx])
    ctx.put(7)
    start = time.perf_counter()
    handoff.wait(start + 0.02)                    # returns (the token is never taken) ...
    assert time.perf_counter() - start >= 0.02   # ... once the deadline has passed


def test_the_last_consumer_to_take_its_token_ends_the_wait():
    contexts = [ResponseContext(i, [1, 2], GenerationConfig(), 64, frozenset(), torch.device("cpu")) for i in range(3)]
    handoff = loop.Handoff()
    handoff.expect(contexts[:2])  # the third's consumer was not waiting
    handoff.took(contexts[2])     # ... so its take is not awaited
    takers = [threading.Timer(0.05 * (i + 1), handoff.took, args=(ctx,)) for i, ctx in enumerate(contexts[:2])]
    start = time.perf_counter()
    for taker in takers:
        taker.start()
    handoff.wait(start + 10)
    assert 0.1 <= time.perf_counter() - start < 5  # after the second take, long before the deadline
    handoff.took(contexts[0])  # a late take of a finished wait changes nothing
    handoff.wait(time.perf_counter() + 10)  # nothing expected: returns at once


def test_woken_from_idleness_the_loop_gathers_a_burst_of_launches(monkeypatch):
    """gather waits while launches keep notifying less than GATHER_GAP apart, GATHER_MAX at most
    (the constants scaled up so that a busy machine's thread delays do not decide the outcome)."""
    monkeypatch.setattr(loop, "GATHER_GAP", 0.2)
    monkeypatch.setattr(loop, "GATHER_MAX", 1.5)
    wakeup = threading.Condition()

    def gathered_for(launch_times) -> float:
        launches = [threading.Timer(t, loop.notify, args=(wakeup,)) for t in launch_times]
        with wakeup:
            start = time.perf_counter()
            for launch in launches:
                launch.start()
            loop.gather(wakeup)
            waited = time.perf_counter() - start
        for launch in launches:
            launch.cancel()
        return waited

    assert 0.2 <= gathered_for([]) < 1.0                                 # nothing more: one gap
    assert 0.5 <= gathered_for([0.05 * (i + 1) for i in range(10)]) < 1.4  # past the burst's last
    assert 1.5 <= gathered_for([0.05 * (i + 1) for i in range(80)]) < 3.0  # an endless one: the cap


@pytest.mark.timing
def test_a_burst_of_threads_launching_on_an_idle_engine_prefills_in_one_step(llama):
    """Eight threads released together: their prompts take one step, not one and then seven. A
    race outcome, so opt-in (--timing): on a busy machine a launch may come a gap late."""
    with Engine.from_pretrained(llama) as engine:
        list(engine.stream_response_tokens(engine.launch_response_tokens([5, 6], {"max_new_tokens": 1})))
        steps = engine.stats()["steps"]
        release = threading.Barrier(8)

        def launch(i):
            release.wait()
            handle = engine.launch_response_tokens([1 + i, 2, 3], {"max_new_tokens": 1})
            assert len(list(engine.stream_response_tokens(handle, timeout=60))) == 1

        threads = [threading.Thread(target=launch, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.stats()["steps"] - steps == 1


def test_priority_policy_runs_higher_priority_first(llama):
    with Engine.from_pretrained(llama, max_batch_size=1, policy="priority") as engine:
        slow(engine, delay=0.01)
        blocker = engine.launch_response_tokens([5, 6], {"max_new_tokens": 20, "ignore_eos": True})
        low = engine.launch_response_tokens([7, 8], {"max_new_tokens": 5, "ignore_eos": True, "priority": 0})
        high = engine.launch_response_tokens([9, 10], {"max_new_tokens": 5, "ignore_eos": True, "priority": 5})
        for h in (blocker, low, high):
            list(engine.stream_response_tokens(h, timeout=60))
    # One request runs at a time: the high-priority one ran entirely before the low one began.
    assert high.token_times[-1] < low.token_times[0]


def test_seeded_sampling_is_reproducible_across_batches(engine):
    config = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=50, top_p=0.9,
                              seed=1234, ignore_eos=True)
    alone = list(engine.stream_response_tokens(engine.launch_response_tokens([5, 6, 7], config)))
    crowd = [engine.launch_response_tokens([i + 4, 8], GenerationConfig(max_new_tokens=12, do_sample=True))
             for i in range(5)]
    again = engine.launch_response_tokens([5, 6, 7], config)
    assert list(engine.stream_response_tokens(again)) == alone
    for h in crowd:
        list(engine.stream_response_tokens(h))


def test_numpy_and_tensor_prompts(engine, llama):
    for prompt in (np.array([5, 6, 7]), torch.tensor([5, 6, 7])):
        h = engine.launch_response_tokens(prompt, {"max_new_tokens": 3})
        assert list(engine.stream_response_tokens(h)) == reference(llama, [5, 6, 7], 3)


def test_a_config_cannot_change_and_its_copies_are_checked_again():
    """A launched request's settings cannot change under the loop thread; a changed copy is made
    with dataclasses.replace, which checks the fields as the constructor does."""
    config = GenerationConfig(max_new_tokens=8, stop=["\n"], logit_bias={5: 1.0})
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'max_new_tokens'"):
        config.max_new_tokens = 0
    assert config.stop == ("\n",) and dataclasses.replace(config, seed=7).seed == 7
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        dataclasses.replace(config, max_new_tokens=0)
    bias = {5: 1.0}
    config = GenerationConfig(logit_bias=bias)
    bias[6] = 2.0  # the caller's dict: the config keeps its own copy
    assert config.logit_bias == {5: 1.0}


def test_one_rule_for_greedy_or_sampled():
    assert not GenerationConfig().sampled
    assert GenerationConfig(temperature=0.7).sampled  # a sampling knob samples, as OpenAI's API does
    assert GenerationConfig(top_p=0.9).sampled and GenerationConfig(top_k=5).sampled
    assert not GenerationConfig(temperature=0).sampled  # temperature 0 is greedy
    assert not GenerationConfig(temperature=1e-300).sampled  # too small to sample: greedy in effect
    assert GenerationConfig(do_sample=True).sampled
    with pytest.warns(UserWarning, match="do_sample=False, so temperature is ignored"):
        assert not GenerationConfig(do_sample=False, temperature=0.7).sampled  # transformers' rule, said aloud
