"""PrefillAdder budgets with exact numbers: KV (free + evictable minus reservations), prefill tokens per
batch, chunking, and the running-request limit."""

from __future__ import annotations

from runtime.managers.scheduler.cache_manager import CacheManager
from runtime.managers.scheduler.req import Req
from runtime.managers.scheduler.schedule_policy import AddOutcome, AddResult, PrefillAdder
from runtime.mem_cache.memory_pool import ReqToTokenPool, SlotAllocator
from runtime.mem_cache.radix_cache import RadixCache
from runtime.sampling_params import SamplingParams

CONTINUE, FULL, NO_TOKEN = AddResult.CONTINUE, AddResult.FULL, AddResult.NO_TOKEN


def req(rid: str, max_new: int, output: int = 0) -> Req:
    r = Req(rid=rid, prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=max_new))
    r.output_ids = [5] * output
    return r


def cache_manager(pool: int = 100, cached: int = 0) -> CacheManager:
    """A pool of `pool` slots; `cached` of them held (evictable) by the radix cache."""
    cm = CacheManager(RadixCache(), ReqToTokenPool(8, 64), SlotAllocator(pool))
    if cached:
        cm.cache.insert(list(range(1000, 1000 + cached)), cm.allocator.alloc(cached))
    return cm


def adder(cm=None, running=(), *, prefill=1000, chunk=0, ratio=0.5, max_running=8) -> PrefillAdder:
    return PrefillAdder(
        cm or cache_manager(),
        list(running),
        max_prefill_tokens=prefill,
        chunk_size=chunk,
        new_token_ratio=ratio,
        max_running=max_running,
    )


def test_kv_budget_counts_prompt_plus_reserved_output():
    a = adder()
    assert a.add(req("a", max_new=20), 30) == AddOutcome(CONTINUE, 30)  # 30 + int(20 * 0.5) = 40
    assert a.rem_total == 60
    assert a.add(req("b", max_new=10), 50) == AddOutcome(CONTINUE, 50)  # 55
    assert a.rem_total == 5
    assert a.add(req("c", max_new=2), 5) == AddOutcome(NO_TOKEN, 0)  # needs 6 > 5
    assert a.rem_total == 5 and [(r.rid, t) for r, t in a.admitted] == [("a", 30), ("b", 50)]


def test_evictable_cache_slots_count_as_available():
    cm = cache_manager(pool=100, cached=40)
    assert cm.allocator.available() == 60 and cm.available() == 100
    assert adder(cm).rem_total == 100


def test_first_request_may_overdraw_the_reservation_but_not_the_pool():
    a = adder()
    # 90 + int(40 * 0.5) = 110 > 100, but its prompt fits: admitted so nothing starves.
    assert a.add(req("a", max_new=40), 90) == AddOutcome(CONTINUE, 90)
    assert a.rem_total == -10
    assert a.add(req("b", max_new=0), 1) == AddOutcome(NO_TOKEN, 0)
    assert adder().add(req("big", max_new=0), 101) == AddOutcome(NO_TOKEN, 0)


def test_running_requests_reserve_their_remaining_output():
    running = [req("r1", max_new=40, output=10), req("r2", max_new=7, output=0)]  # 30*0.5 + int(3.5)
    a = adder(running=running, max_running=3)
    assert a.rem_total == 100 - 15 - 3
    assert a.rem_requests == 1
    assert a.add(req("a", max_new=4), 10) == AddOutcome(CONTINUE, 10)
    assert a.rem_total == 70
    assert a.add(req("b", max_new=4), 1) == AddOutcome(FULL, 0)  # running limit reached


def test_running_limit_already_reached():
    a = adder(running=[req("r", max_new=4)], max_running=1)
    assert a.add(req("a", max_new=4), 1) == AddOutcome(FULL, 0)
    assert a.admitted == []


def test_prefill_token_budget_lets_the_first_request_exceed_it():
    a = adder(prefill=40, ratio=0.0)
    assert a.add(req("a", max_new=1), 50) == AddOutcome(CONTINUE, 50)
    assert a.add(req("b", max_new=1), 1) == AddOutcome(FULL, 0)
    a = adder(prefill=40, ratio=0.0)
    assert a.add(req("a", max_new=1), 30) == AddOutcome(CONTINUE, 30)
    assert a.add(req("b", max_new=1), 11) == AddOutcome(FULL, 0)
    assert a.add(req("c", max_new=1), 10) == AddOutcome(CONTINUE, 10)
    assert a.rem_prefill == 0


def test_chunking_cuts_the_request_that_crosses_the_chunk_budget():
    a = adder(chunk=16)
    assert a.add(req("a", max_new=8), 10) == AddOutcome(CONTINUE, 10)  # 10 + 4 reserved
    assert a.add(req("b", max_new=8), 20) == AddOutcome(FULL, 6)  # cut to the 6 left
    # A chunk reserves no output (the request cannot decode yet) and keeps its running-request place.
    assert a.rem_total == 100 - 14 - 6
    assert a.rem_requests == 7
    assert a.rem_chunk == 0
    assert [(r.rid, t) for r, t in a.admitted] == [("a", 10), ("b", 6)]


def test_long_first_request_is_chunked_to_the_chunk_size():
    a = adder(chunk=16)
    assert a.add(req("a", max_new=8), 40) == AddOutcome(FULL, 16)
    assert a.rem_total == 84


def test_zero_tokens_to_extend_is_not_admitted():
    assert adder().add(req("a", max_new=8), 0) == AddOutcome(FULL, 0)


def test_add_waiting_counts_the_prefix_it_locks():
    """The cached prefix a waiting request locks stops being evictable: the budget sees that at once, so
    everything admitted can be allocated (the scheduler never has to back out of a failed allocation)."""
    cm = cache_manager(pool=100, cached=40)
    a = adder(cm, ratio=0.0)
    r = Req(rid="a", prompt_ids=list(range(1000, 1040)) + [7] * 20, params=SamplingParams(max_new_tokens=1))
    assert a.add_waiting(r, matched=False) == AddOutcome(CONTINUE, 20)  # 40 cached, locked: not evictable
    assert r.match_len == 40 and a.rem_total == 100 - 40 - 20
    big = Req(rid="b", prompt_ids=[9] * 50, params=SamplingParams(max_new_tokens=1))
    assert a.add_waiting(big, matched=False) == AddOutcome(NO_TOKEN, 0)  # 50 > 40 left
    assert big.req_pool_idx is None and cm.cache.protected_size() == 40  # its row and lock given back
    for _, take in a.admitted:
        assert cm.alloc_slots(take) is not None


def test_add_waiting_without_a_free_row_is_none():
    cm = CacheManager(RadixCache(), ReqToTokenPool(1, 64), SlotAllocator(100))
    a = adder(cm)
    first = Req(rid="a", prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=1))
    assert a.add_waiting(first, matched=False).tokens == 2
    assert a.add_waiting(req("b", max_new=1), matched=False) is None


def test_reservation_is_truncated_per_request():
    # int() per request: three requests with 3 tokens left at ratio 0.5 reserve 1 each, not int(4.5).
    running = [req(f"r{i}", max_new=3) for i in range(3)]
    assert adder(running=running).rem_total == 97


def test_lpm_puts_the_oldest_request_first_once_it_waited_too_long():
    """lpm orders by cached prefix; a request whose prefix is not cached must not wait behind cache hits for
    ever: past OVERDUE_AFTER_S the oldest one goes first (one per round), the rest keep the lpm order."""
    import time

    from runtime.managers.scheduler.schedule_policy import OVERDUE_AFTER_S, order_waiting

    cm = cache_manager()
    hot = list(range(1000, 1040))
    cm.cache.insert(hot, cm.allocator.alloc(len(hot)))
    now = time.monotonic()

    def waiting(rid: str, prompt: list[int], waited_s: float) -> Req:
        return Req(
            rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=4), arrival=now - waited_s
        )

    cold_new = waiting("cold-new", [7, 8, 9], 1.0)
    cold_old = waiting("cold-old", [4, 5, 6], OVERDUE_AFTER_S + 5)
    cold_older = waiting("cold-older", [1, 2, 3], OVERDUE_AFTER_S + 9)
    hit = waiting("hit", hot + [1], 2.0)
    ordered, matched = order_waiting("lpm", [cold_new, cold_old, hit, cold_older], cm)
    assert matched and [r.rid for r in ordered] == ["cold-older", "hit", "cold-old", "cold-new"]
    ordered, _ = order_waiting("lpm", [cold_new, hit], cm)  # nobody overdue: the cache hit first
    assert [r.rid for r in ordered] == ["hit", "cold-new"]
