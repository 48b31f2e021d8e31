"""The scheduler alone, against a KV manager over a tiny pool and no model: each step is planned,
then applied as if the model had sampled token 9 for every request that samples."""

import itertools

import torch

from models.step import KVCache
from runtime.config import EngineOptions, GenerationConfig
from runtime.context import ResponseContext, Status
from runtime.kv_manager import KVManager
from runtime.scheduler import Scheduler

TOKEN = 9
HANDLES = itertools.count()  # increasing, as launches number requests: FCFS is their order


def kv_manager(num_blocks=32, block_size=4, caching=True, recompute_past=None) -> KVManager:
    pool = KVCache(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=1, head_dim=1,
                   dtype=torch.float32, device="cpu")
    return KVManager(pool, caching, recompute_past)


def scheduler(kv=None, **options) -> Scheduler:
    return Scheduler(EngineOptions(**options), kv or kv_manager())


def request(s: Scheduler, prompt, max_new_tokens=8, leader=None, **config) -> ResponseContext:
    """A request, added to ``s``'s waiting queue."""
    ctx = ResponseContext(next(HANDLES), list(prompt), GenerationConfig(max_new_tokens=max_new_tokens, **config), 1 << 20,
                          frozenset(), torch.device("cpu"), leader=leader)
    s.add(ctx)
    return ctx


def step(s: Scheduler):
    """Plan a step and apply it; returns [(handle, tokens computed)] in the plan's order."""
    plan = s.schedule()
    sampling = plan.sampling()
    s.postprocess(plan, sampling, [TOKEN] * len(sampling), 0.0)
    return [(e.ctx.handle, e.num_tokens) for e in plan.entries]


def run_to_end(s: Scheduler, limit=200) -> int:
    """Steps until no request is left to run; returns how many it took."""
    for steps in range(limit):
        if not s.has_work():
            return steps
        step(s)
    raise AssertionError("the requests never finished")


def test_admission_stops_at_max_batch_size_and_at_the_first_request_that_does_not_fit():
    s = scheduler(kv_manager(num_blocks=10), max_batch_size=2)
    first, second, third = (request(s, range(10, 14)) for _ in range(3))
    assert step(s) == [(first.handle, 4), (second.handle, 4)]
    assert s.running == [first, second] and s.waiting == [third]

    s = scheduler(kv_manager(num_blocks=10))  # a watermark of 1 block kept for running requests to grow
    small = request(s, range(10, 14))
    assert step(s) == [(small.handle, 4)]     # 1 block; 9 free
    big = request(s, range(30, 63))           # needs 9 blocks: more than the 8 above the watermark
    later = request(s, range(70, 74))         # would fit, but does not overtake it
    assert step(s) == [(small.handle, 1)]
    assert s.waiting == [big, later] and big.num_computed == 0 and s.kv.num_free == 8


def test_the_token_budget_chunks_a_long_prefill_and_decodes_go_first():
    s = scheduler(max_batch_size=2, max_batch_tokens=8)
    short = request(s, [5, 6, 7], max_new_tokens=20)
    assert step(s) == [(short.handle, 3)]
    long = request(s, range(10, 30))  # 20 tokens: chunks of what the decode leaves of the budget
    assert step(s) == [(short.handle, 1), (long.handle, 7)]
    assert step(s) == [(short.handle, 1), (long.handle, 7)]
    assert long.num_generated == 0
    assert step(s) == [(short.handle, 1), (long.handle, 6)]
    assert long.num_generated == 1 and long.tokens[-1] == TOKEN  # it samples once its prompt is computed


def test_an_empty_pool_preempts_the_newest_request_which_recomputes_without_resampling():
    s = scheduler(kv_manager(num_blocks=6), max_batch_size=2)  # 24 tokens: too few for both to grow to 20
    older, newer = request(s, range(10, 17), max_new_tokens=13), request(s, range(20, 27), max_new_tokens=13)
    while s.num_preemptions == 0:
        step(s)
    assert s.running == [older] and s.waiting == [newer]
    assert newer.status is Status.WAITING and newer.num_computed == 0 and newer.num_generated > 0
    kept = list(newer.tokens)
    assert s.kv.num_free + len(s.kv.held[older.handle].table) == 6  # the victim holds nothing
    run_to_end(s)
    assert older.finish_reason == newer.finish_reason == "length"
    assert newer.tokens[:len(kept)] == kept and newer.num_generated == 13  # its sampled tokens kept, none twice
    assert not s.kv.held and s.kv.num_free == 6


def test_the_priority_policy_admits_and_keeps_the_higher_priority_first():
    s = scheduler(max_batch_size=1, policy="priority")
    low = request(s, [5, 6], priority=0)
    high = request(s, [7, 8], priority=5)
    assert step(s) == [(high.handle, 2)] and s.waiting == [low]

    s = scheduler(kv_manager(num_blocks=6), max_batch_size=2, policy="priority")
    older_low = request(s, range(10, 17), max_new_tokens=13, priority=-1)
    newer_high = request(s, range(20, 27), max_new_tokens=13, priority=1)
    while s.num_preemptions == 0:
        step(s)
    assert s.running == [newer_high] and s.waiting == [older_low]  # the lower priority gave way, though older


def test_a_shared_prefix_comes_from_the_cache_and_only_the_rest_is_computed():
    for caching in (True, False):
        s = scheduler(kv_manager(caching=caching))
        first = request(s, range(10, 20), max_new_tokens=1)  # 10 tokens: 2 full blocks of 4
        run_to_end(s)
        second = request(s, list(range(10, 18)) + [40, 41, 42], max_new_tokens=1)
        computed = step(s)
        if caching:
            assert second.num_cached == 8 and computed == [(second.handle, 3)]
        else:
            assert second.num_cached == 0 and computed == [(second.handle, 11)]
        assert first.finished and s.cached_tokens == second.num_cached


def test_a_later_choice_waits_for_the_first_to_compute_the_prompt_then_takes_its_blocks():
    s = scheduler(max_batch_tokens=4, max_batch_size=2)
    prompt = range(10, 22)  # 12 tokens: three chunks of 4
    first = request(s, prompt, max_new_tokens=2)
    second = request(s, prompt, max_new_tokens=2, leader=first)
    assert step(s) == [(first.handle, 4)] and second in s.waiting
    assert step(s) == [(first.handle, 4)]
    assert step(s) == [(first.handle, 4)]
    # two full blocks cached (never the last token's: its logits are sampled), the rest computed
    assert step(s) == [(first.handle, 1), (second.handle, 3)]
    assert second.num_cached == 8 and first.num_cached == 0


def test_a_consumer_that_lags_pauses_its_request_without_blocks_until_it_catches_up():
    s = scheduler(kv_manager(caching=False), max_unfetched_tokens=2)
    ctx = request(s, [5, 6, 7], max_new_tokens=6)
    step(s)
    step(s)
    assert ctx.num_unfetched == 2 and not s.has_work() and not s.kv.held and ctx in s.waiting
    ctx.num_fetched = 1  # the consumer took a token
    assert s.has_work() and step(s) == [(ctx.handle, 5)]  # recomputes the 5 tokens it holds, then samples
    assert ctx.num_generated == 3 and ctx in s.waiting  # 2 behind again: paused again
    assert s.num_preemptions == 2


def test_a_sequence_past_recompute_past_is_recomputed_and_hashed_under_its_own_root():
    kv = kv_manager(recompute_past=12)
    s = scheduler(kv)
    ctx = request(s, range(10, 20), max_new_tokens=6)  # 10 tokens; the 13th is past 12
    assert step(s) == [(ctx.handle, 10)]
    assert step(s) == [(ctx.handle, 1)]
    assert step(s) == [(ctx.handle, 1)] and ctx in s.waiting and ctx.num_computed == 0  # holds 13 now
    assert step(s) == [(ctx.handle, 13)] and ctx.num_cached == 0  # the short side's blocks do not serve it
    assert s.num_preemptions == 0
    run_to_end(s)
    long = request(s, ctx.tokens[:14], max_new_tokens=1)   # past 12: the long side's blocks
    short = request(s, ctx.tokens[:11], max_new_tokens=1)  # within: the short side's
    run_to_end(s)
    assert long.num_cached == 12 and short.num_cached == 8


def test_the_kv_manager_takes_nothing_where_a_request_does_not_fit():
    kv = kv_manager(num_blocks=4)
    s = scheduler(kv)
    ctx = request(s, range(10, 30))
    assert kv.take_cached_prefix(ctx) == 0
    assert kv.allocate(ctx, 20) is None and kv.num_free == 4 and kv.held[ctx.handle].table == []
    assert kv.allocate(ctx, 16) == [0, 1, 2, 3] and kv.num_free == 0
    kv.free(ctx)
    kv.free(ctx)  # a no-op the second time
    assert kv.num_free == 4 and not kv.held
