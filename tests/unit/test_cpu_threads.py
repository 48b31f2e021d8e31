"""The loop thread's OpenMP thread count. With short spins: the cores other threads leave free,
judged from the fewest other runnable threads over recent steps, and every thread for steps whose
rows the threads split. With long spins: fewer threads while its forwards wait for a core, one more
after a quiet spell (backing off when a try finds the cores still busy). Never more than the cap,
and never a change to the application's own threads."""

import os
from types import SimpleNamespace

import pytest
import torch

from runtime import Engine, cpu_threads, openmp
from runtime.cpu_threads import FIRST_BACKOFF, ONE_ROW_RETRY, ONE_ROW_SAMPLES, STEADY_WINDOW, CpuThreads


WIDE = SimpleNamespace(input_ids=[5] * 64)  # a step whose rows the fake models split among their threads


class Clock:
    """Fake run-queue wait and wall clock: each step lasts 10 ms and waits ``share`` of it."""

    def __init__(self, monkeypatch):
        self.wait = self.now = 0
        monkeypatch.setattr(cpu_threads, "run_queue_wait_ns", lambda: self.wait)
        monkeypatch.setattr(cpu_threads.time, "perf_counter_ns", lambda: self.now)

    def step(self, threads: CpuThreads, share: float) -> int:
        threads.before_forward()
        self.now += 10_000_000
        self.wait += int(share * 10_000_000)
        threads.after_sampling()
        return threads.count


@pytest.fixture
def adaptive(monkeypatch):
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 4)
    monkeypatch.setattr(openmp, "set_thread_count", lambda n: True)
    threads = CpuThreads(None)
    threads.adaptive, threads.sharing = True, False
    return threads


@pytest.fixture
def sharing(monkeypatch):
    """Four cores, short spins; ``sharing.load.others`` is what /proc/loadavg says now."""
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 4)
    monkeypatch.setattr(openmp, "set_thread_count", lambda n: True)
    load = SimpleNamespace(others=0)
    monkeypatch.setattr(cpu_threads, "other_runnable_threads", lambda: load.others)
    threads = CpuThreads(None, splits=lambda step, n: step is WIDE)
    threads.adaptive, threads.sharing = False, True
    threads.load = load
    return threads


def counts(threads: CpuThreads, others: list[int], step=None) -> list[int]:
    """The thread counts set for the steps after steps that ended with ``others`` runnable."""
    result = []
    for load in others:
        threads.load.others = load
        threads.after_sampling()
        threads.before_forward(step)
        result.append(threads.applied[1])
    return result


def test_threads_take_the_cores_other_threads_leave_free(sharing):
    assert counts(sharing, [0, 0]) == [4, 4]
    assert counts(sharing, [1] * (STEADY_WINDOW - 1)) == [4] * (STEADY_WINDOW - 1)  # a quiet sample still in the window
    assert counts(sharing, [1, 3]) == [3, 3]  # one busy thread all along; the 3 was a burst
    assert counts(sharing, [0]) == [4]  # a sample without them: they were not steady


def test_the_load_is_sampled_at_the_steps_end_where_the_woken_consumers_are_done(sharing):
    """Right after delivery the consumers it woke (a server's event loop, an HTTP client on the same
    machine) are runnable at every step's start; by its end they are done. They must not cost the
    forward its threads."""
    for _ in range(2 * STEADY_WINDOW):
        sharing.load.others = 3  # the woken consumers, as the forward starts
        sharing.before_forward()
        assert sharing.applied[1] == 4
        sharing.load.others = 0  # done by the step's end
        sharing.after_sampling()


def test_with_no_core_free_one_row_steps_take_the_count_their_forwards_were_faster_on(sharing, monkeypatch):
    """One thread read the weights nearly as fast as two on Zen 5 cores; on a Xeon's, half as fast."""
    now = [0]
    monkeypatch.setattr(cpu_threads.time, "perf_counter_ns", lambda: now[0])
    one_row, eight_rows = SimpleNamespace(input_ids=[5]), SimpleNamespace(input_ids=[5] * 8)

    def one_row_steps(forward_ms: dict, steps: int) -> list[int]:
        chosen = []
        sharing.load.others = 6  # every core busy all along
        sharing.after_sampling()  # as the step before ended
        for _ in range(steps):
            sharing.before_forward(one_row)
            chosen.append(sharing.applied[1])
            now[0] += forward_ms[chosen[-1]] * 1_000_000
            sharing.after_sampling()
        return chosen

    n = ONE_ROW_SAMPLES
    like_zen5 = one_row_steps({1: 24, 4: 35}, ONE_ROW_RETRY + n + 1)
    assert like_zen5[:2 * n] == [1] * n + [4] * n  # both measured first
    assert set(like_zen5[2 * n:ONE_ROW_RETRY]) == {1}
    assert like_zen5[ONE_ROW_RETRY:] == [4] * n + [1]  # the other count measured afresh, then the faster again
    like_xeon = one_row_steps({1: 74, 4: 56}, n)  # the load or the machine changed: one thread is slower now
    assert like_xeon[-1] == 4
    assert counts(sharing, [6], eight_rows) == [4]  # wider steps claim their share of the busy cores


def test_with_no_core_free_a_narrow_step_that_verifies_proposals_chooses_as_one_row_steps_do(sharing, monkeypatch):
    """Speculative decoding's steps of a few rows are bound by reading the weights, as one-row
    steps are: each row count times both counts and keeps the faster; a plain step of as many
    rows, and a verifying one wider than NARROW_ROWS, take every thread."""
    now = [0]
    monkeypatch.setattr(cpu_threads.time, "perf_counter_ns", lambda: now[0])
    verifying = SimpleNamespace(input_ids=[5] * 5, verifies=True)
    sharing.load.others = 6
    sharing.after_sampling()
    chosen = []
    for _ in range(2 * ONE_ROW_SAMPLES + 3):
        sharing.before_forward(verifying)
        chosen.append(sharing.applied[1])
        now[0] += {1: 28, 4: 56}[chosen[-1]] * 1_000_000
        sharing.after_sampling()
    assert chosen[:2 * ONE_ROW_SAMPLES] == [1] * ONE_ROW_SAMPLES + [4] * ONE_ROW_SAMPLES
    assert chosen[2 * ONE_ROW_SAMPLES:] == [1] * 3
    assert counts(sharing, [6], SimpleNamespace(input_ids=[5] * 5)) == [4]
    wide = SimpleNamespace(input_ids=[5] * (cpu_threads.NARROW_ROWS + 1), verifies=True)
    assert counts(sharing, [6], wide) == [4]


def test_a_step_whose_rows_the_threads_split_keeps_them_all(sharing):
    assert counts(sharing, [2] * STEADY_WINDOW)[-1] == 2
    assert counts(sharing, [2], WIDE) == [4]
    assert counts(sharing, [2]) == [2]


def test_a_process_pinned_to_some_cores_measures_its_own_wait(monkeypatch):
    """loadavg counts the whole machine's runnable threads; pinned to 2 of 8 CPUs, Loom cannot read
    its own cores' load there, and measures its forwards' wait for a core instead."""
    monkeypatch.setattr(openmp, "SHORT_SPIN", True)
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
    monkeypatch.setattr(cpu_threads.os, "cpu_count", lambda: 8)
    pinned = CpuThreads(None)
    assert not pinned.sharing and pinned.adaptive == (openmp.available() and os.path.exists(cpu_threads.SCHEDSTAT))
    monkeypatch.setattr(cpu_threads.os, "cpu_count", lambda: 2)
    assert CpuThreads(None).sharing == os.path.exists(cpu_threads.LOADAVG)


def test_a_split_step_keeps_every_thread_and_leaves_the_adaptive_count_alone(adaptive, monkeypatch):
    clock = Clock(monkeypatch)
    adaptive.splits = lambda step, n: step is WIDE
    assert clock.step(adaptive, 0.9) == 2
    adaptive.before_forward(WIDE)
    assert adaptive.applied[1] == 4 and adaptive.started is None  # not measured: its threads share no barrier
    adaptive.after_sampling()
    assert adaptive.count == 2


def test_the_sampled_count_excludes_the_caller():
    if not os.path.exists(cpu_threads.LOADAVG):
        pytest.skip("no /proc/loadavg")
    assert 0 <= cpu_threads.other_runnable_threads() < 10_000


def test_busy_cores_halve_the_count_and_quiet_ones_bring_threads_back(adaptive, monkeypatch):
    clock = Clock(monkeypatch)
    assert adaptive.count == 4
    assert clock.step(adaptive, 0.5) == 2
    assert clock.step(adaptive, 0.5) == 1
    assert clock.step(adaptive, 0.5) == 1  # busy at one thread: stays, no try
    counts = [clock.step(adaptive, 0.0) for _ in range(FIRST_BACKOFF)]
    assert counts[-1] == 2 and set(counts[:-1]) == {1}  # a try after FIRST_BACKOFF quiet steps
    assert clock.step(adaptive, 0.0) == 2  # the try held up


def test_a_failed_try_doubles_the_wait_before_the_next(adaptive, monkeypatch):
    clock = Clock(monkeypatch)
    clock.step(adaptive, 0.9)
    clock.step(adaptive, 0.9)
    assert adaptive.count == 1
    for _ in range(FIRST_BACKOFF):
        clock.step(adaptive, 0.0)
    assert adaptive.count == 2 and adaptive.trying
    assert clock.step(adaptive, 0.6) == 1  # the try found the cores busy
    counts = [clock.step(adaptive, 0.0) for _ in range(2 * FIRST_BACKOFF)]
    assert counts.index(2) == 2 * FIRST_BACKOFF - 1


def test_the_cap_bounds_the_count(monkeypatch):
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 8)
    assert CpuThreads(3).max == 3 and CpuThreads(3).count == 3
    assert CpuThreads(16).max == 8
    assert not CpuThreads(1).adaptive


@pytest.mark.skipif(not openmp.available(), reason="the per-thread count needs libgomp")
def test_the_engine_sets_only_its_loop_threads_count(llama):
    before = torch.get_num_threads()
    with Engine.from_pretrained(llama, cpu_threads=1) as engine:
        list(engine.stream_response_tokens(engine.launch_response_tokens([5, 6, 7], {"max_new_tokens": 3})))
        assert engine.stats()["cpu_threads"] == 1
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("env,loaded,short,loads_with", [
    ({}, False, True, ("2000", "ACTIVE")),                # nobody chose, libgomp not loaded yet: short spins
    ({}, True, False, None),                              # torch came first: too late, its long default stays
    ({"GOMP_SPINCOUNT": "5k"}, True, True, None),         # the application's choice, whatever the order
    ({"GOMP_SPINCOUNT": "infinite"}, False, False, None),
    ({"GOMP_SPINCOUNT": "3M"}, False, False, None),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, False, True, None),
    ({"OMP_WAIT_POLICY": "active"}, False, False, None),
])
def test_the_spin_count_is_chosen_only_where_nobody_did_and_libgomp_is_not_loaded(monkeypatch, env, loaded, short,
                                                                                  loads_with):
    """``loads_with``: the GOMP_SPINCOUNT and OMP_WAIT_POLICY Loom loads torch (and libgomp) with, None where it
    leaves the load alone."""
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(openmp, "_libgomp_loaded", lambda: loaded)
    seen_by_libgomp = []
    monkeypatch.setattr(openmp, "_load_torch", lambda: seen_by_libgomp.append(
        (openmp.os.environ.get("GOMP_SPINCOUNT"), openmp.os.environ.get("OMP_WAIT_POLICY"))))
    assert openmp._choose_spin() == short
    assert seen_by_libgomp == ([] if loads_with is None else [loads_with])
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):  # child processes inherit no choice of ours
        assert openmp.os.environ.get(name) == env.get(name)


def test_importing_loom_before_torch_chooses_short_spins(monkeypatch):
    import subprocess
    import sys

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    probe = ("import os, runtime, torch; from runtime import openmp; "
             "print(openmp.SHORT_SPIN, os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")
    first = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert first == ["True", "None", "None"]  # short spins chosen, and not left for child processes
    late = subprocess.run([sys.executable, "-c", "import torch; " + probe], capture_output=True, text=True,
                          check=True).stdout.split()
    assert late[:2] == ["False", "None"]
