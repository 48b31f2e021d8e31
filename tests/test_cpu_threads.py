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
from runtime.cpu_threads import CHOICE_RETRY, CHOICE_SAMPLES, FEW_ROWS, FIRST_BACKOFF, STEADY_WINDOW, CpuThreads


WIDE = SimpleNamespace(input_ids=[5] * 64, prefills=[], own_rows=None)  # the fake models split its rows


def decode(rows: int) -> SimpleNamespace:
    return SimpleNamespace(input_ids=[5] * rows, prefills=[], own_rows=None)


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
        threads.after_forward()
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
    """Four cores, short spins; ``sharing.others`` is what /proc/loadavg will say, sample by sample."""
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 4)
    monkeypatch.setattr(openmp, "set_thread_count", lambda n: True)
    others = []
    monkeypatch.setattr(cpu_threads, "other_runnable_threads", lambda: others.pop(0))
    threads = CpuThreads(None, splits=lambda step, n: step is WIDE)
    threads.adaptive, threads.sharing = False, True
    threads.next_others = others
    return threads


def counts(threads: CpuThreads, others: list[int], step=None) -> list[int]:
    """The thread counts set for one step per sample of ``others``."""
    threads.next_others.extend(others)
    result = []
    for _ in others:
        threads.before_forward(step)
        result.append(threads.applied[1])
    return result


def test_threads_take_the_cores_other_threads_leave_free(sharing):
    assert counts(sharing, [0, 0]) == [4, 4]
    assert counts(sharing, [1] * (STEADY_WINDOW - 1)) == [4] * (STEADY_WINDOW - 1)  # a quiet sample still in the window
    assert counts(sharing, [1, 3]) == [3, 3]  # one busy thread all along; the 3 was a burst
    assert counts(sharing, [0]) == [4]  # a sample without them: they were not steady


def chosen_on_full_cores(threads: CpuThreads, now: list, forward_ms: dict, steps: int, rows: int) -> list[tuple]:
    """The (count, own rows) of ``steps`` steps of ``rows`` rows with every core busy, each forward
    taking forward_ms[that choice]."""
    chosen = []
    threads.next_others.extend([6] * steps)
    for _ in range(steps):
        step = decode(rows)
        threads.before_forward(step)
        chosen.append((threads.applied[1], bool(step.own_rows)))
        now[0] += forward_ms[chosen[-1]] * 1_000_000
        threads.after_forward()
    return chosen


def test_with_no_core_free_one_row_steps_take_the_count_their_forwards_were_faster_on(sharing, monkeypatch):
    """One thread read the weights nearly as fast as two on Zen 5 cores; on a Xeon's, half as fast."""
    now = [0]
    monkeypatch.setattr(cpu_threads.time, "perf_counter_ns", lambda: now[0])
    n, one, every = CHOICE_SAMPLES, (1, False), (4, False)
    like_zen5 = chosen_on_full_cores(sharing, now, {one: 24, every: 35}, CHOICE_RETRY + n + 1, rows=1)
    assert like_zen5[:2 * n] == [one] * n + [every] * n  # both measured first
    assert set(like_zen5[2 * n:CHOICE_RETRY]) == {one}
    assert like_zen5[CHOICE_RETRY:] == [every] * n + [one]  # the other measured afresh, then the faster again
    like_xeon = chosen_on_full_cores(sharing, now, {one: 74, every: 56}, n, rows=1)  # one thread is slower now
    assert like_xeon[-1] == every
    assert counts(sharing, [6], decode(FEW_ROWS + 1)) == [4]  # wide steps claim their share of the busy cores


def test_with_no_core_free_a_few_rows_may_split_among_the_threads(monkeypatch):
    """Where the model's layers can give each thread its own rows, that is an option too, measured
    per row count: beside two busy processes on two Zen 5 cores, 8 rows took 43 ms so against 55."""
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
    monkeypatch.setattr(openmp, "set_thread_count", lambda n: True)
    others, now = [], [0]
    monkeypatch.setattr(cpu_threads, "other_runnable_threads", lambda: others.pop(0))
    monkeypatch.setattr(cpu_threads.time, "perf_counter_ns", lambda: now[0])
    # the model's rule: own rows as the step says, given a row per thread; else from 24 rows
    threads = CpuThreads(None, splits=lambda step, n: bool(step.own_rows) and len(step.input_ids) >= n
                         if step.own_rows is not None else len(step.input_ids) >= 24)
    threads.adaptive, threads.sharing, threads.next_others = False, True, others
    n, one, shared, own = CHOICE_SAMPLES, (1, False), (2, False), (2, True)
    eight = chosen_on_full_cores(threads, now, {one: 52, shared: 55, own: 43}, 4 * n, rows=8)
    assert eight[:3 * n] == [one] * n + [shared] * n + [own] * n and set(eight[3 * n:]) == {own}
    single = chosen_on_full_cores(threads, now, {one: 19, shared: 35}, 3 * n, rows=1)  # no row for a second thread
    assert single[:2 * n] == [one] * n + [shared] * n and set(single[2 * n:]) == {one}
    others.extend([0] * STEADY_WINDOW)
    quiet = [decode(8) for _ in range(STEADY_WINDOW)]
    for step in quiet:
        threads.before_forward(step)
    assert threads.applied[1] == 2 and quiet[-1].own_rows is None  # quiet cores: the model's own rule


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
    adaptive.after_forward()
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
