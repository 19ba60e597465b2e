"""lpm with KV tiers: a prefix the host or disk tier holds counts as cached when ranking the queue (a resume
that only loads it goes before cold prompts), the wait bound still puts an overdue request first, ranking
reads no disk file, and a request waiting for room to load its tier prefix keeps first place (after an
overdue one) until it starts, loading only room not promised to others. Real CacheManager, radix trees and
tiers."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from runtime.managers.scheduler.cache_manager import CacheManager
from runtime.managers.scheduler.req import Req
from runtime.managers.scheduler.schedule_policy import (
    OVERDUE_AFTER_S,
    AddOutcome,
    admit,
    order_waiting,
)
from runtime.mem_cache.disk_tier import BLOCK, DiskTier
from runtime.mem_cache.host_tier import HostTier
from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool, SlotAllocator
from runtime.mem_cache.radix_cache import RadixCache
from runtime.sampling_params import SamplingParams


def host_cm(pool: int = 16, host: int = 32) -> CacheManager:
    kv = KVPool(pool, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    return CacheManager(RadixCache(), ReqToTokenPool(8, 64), SlotAllocator(pool), HostTier(kv, host))


def disk_cm(directory, pool: int = 4 * BLOCK) -> CacheManager:
    kv = KVPool(pool, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    disk = DiskTier(str(directory), 1 << 30, kv, "model-a")
    return CacheManager(RadixCache(), ReqToTokenPool(8, 4 * BLOCK), SlotAllocator(pool), disk=disk)


def make_req(rid: str, prompt: list[int], waited_s: float = 0.0, max_new: int = 1) -> Req:
    # arrival from the clock now, not at import: the suite may run this file minutes after collecting it,
    # and a request older than OVERDUE_AFTER_S goes first whatever it holds
    arrival = time.monotonic() - waited_s
    return Req(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new), arrival=arrival)


def cache_tokens(cm: CacheManager, key: list[int]) -> None:
    assert cm.cache.insert(key, cm.alloc_slots(len(key))) == 0


def rids(reqs: list[Req]) -> list[str]:
    return [r.rid for r in reqs]


def test_a_prefix_on_the_host_ranks_like_a_cached_one():
    cm = host_cm()
    history = list(range(100, 110))
    cache_tokens(cm, history)
    held = cm.alloc_slots(16)  # evicts the history to the host
    cm.allocator.free(held)
    hot = list(range(200, 206))
    cache_tokens(cm, hot)  # 6 tokens on the device
    cold = make_req("cold", [7, 8, 9, 10], waited_s=3.0)  # the oldest
    resume = make_req("resume", history + [1], waited_s=1.0)  # device match 0, the host holds 10
    device = make_req("device", hot + [2], waited_s=2.0)  # device match 6
    ordered, matched = order_waiting("lpm", [cold, device, resume], cm)
    assert matched and rids(ordered) == ["resume", "device", "cold"]
    assert (resume.match_len, resume.tier_match_len) == (0, 10)
    assert (device.match_len, device.tier_match_len, cold.tier_match_len) == (6, 0, 0)
    # ordering only looks: nothing was loaded, locked or evicted
    assert cm.host.counts["host_loaded_tokens"] == 0 and cm.cache.protected_size() == 0
    assert cm.cache.prefix_len(hot + [3]) == 6 and cm.cache.prefix_len(hot[:3] + [999]) == 3
    cm.check_accounting([])


def test_equal_uncomputed_prefixes_prefer_the_device_one():
    cm = host_cm(pool=32, host=32)
    history = list(range(100, 110))
    cache_tokens(cm, history)
    held = cm.alloc_slots(32)
    cm.allocator.free(held)
    hot = list(range(200, 210))
    cache_tokens(cm, hot)
    resume = make_req("resume", history + [1], waited_s=5.0)
    device = make_req("device", hot + [2], waited_s=1.0)
    ordered, _ = order_waiting("lpm", [resume, device], cm)
    assert rids(ordered) == ["device", "resume"]  # both skip 10 tokens; the device one needs no load


def test_the_wait_bound_still_puts_an_overdue_cold_request_before_a_tier_resume():
    cm = host_cm()
    history = list(range(100, 110))
    cache_tokens(cm, history)
    cm.allocator.free(cm.alloc_slots(16))
    resume = make_req("resume", history + [1], waited_s=1.0)
    cold = make_req("cold", [7, 8, 9], waited_s=OVERDUE_AFTER_S + 1)
    colder = make_req("colder", [4, 5, 6], waited_s=OVERDUE_AFTER_S + 0.5)
    ordered, _ = order_waiting("lpm", [resume, colder, cold], cm)
    assert rids(ordered) == ["cold", "resume", "colder"]  # one overdue request per round


def test_a_prefix_on_disk_ranks_like_a_cached_one_without_reading_a_file(tmp_path, monkeypatch):
    cm = disk_cm(tmp_path)
    history = list(range(1000, 1000 + 2 * BLOCK + 5))
    req = make_req("first", history)
    cm.match(req)
    assert cm.start(req)
    cm.append_slots(req, cm.alloc_slots(len(history)))
    cm.release(req)  # cached: its 2 full blocks go to disk
    assert cm.disk.flush()
    fresh = disk_cm(tmp_path)  # a restart: nothing on the device
    reads, hashed = [], []
    monkeypatch.setattr(fresh.disk, "_load", lambda *a: reads.append(a))
    real_names = fresh.disk.block_names
    monkeypatch.setattr(fresh.disk, "block_names", lambda key: hashed.append(len(key)) or real_names(key))
    cold = make_req("cold", [7] * 40, waited_s=2.0)
    resume = make_req("resume", history + [9], waited_s=1.0)
    for _ in range(3):  # three scheduling rounds
        ordered, _ = order_waiting("lpm", [cold, resume], fresh)
        assert rids(ordered) == ["resume", "cold"]
    assert (resume.match_len, resume.tier_match_len) == (0, 2 * BLOCK)
    assert reads == [] and hashed == [len(history)]  # no file touched; the resume's key hashed once
    monkeypatch.delattr(fresh.disk, "_load")  # the real reader again
    assert fresh.start(resume) and resume.disk_loaded_len == 2 * BLOCK  # the load reuses those names
    assert hashed == [len(history)]
    fresh.release(resume, cache_tokens=False)
    fresh.check_accounting([])


ARGS = SimpleNamespace(
    schedule_policy="lpm",
    max_prefill_tokens=100,
    chunked_prefill_size=0,
    new_token_ratio=0.0,
    max_running_requests=8,
)


def offer(adder, req: Req, matched: bool) -> AddOutcome | None:
    return adder.add_waiting(req, matched)


def on_host(cm: CacheManager, *keys: list[int]) -> torch.Tensor:
    """Cache each key, then push them all to the host tier; returns the slots held to keep the pool full
    (all but 4 free)."""
    for key in keys:
        cache_tokens(cm, key)
    return cm.alloc_slots(cm.allocator.size - 4)


def test_a_request_waiting_to_load_its_tier_prefix_keeps_first_place_until_it_starts():
    cm = host_cm(pool=16, host=32)
    h1, h2 = list(range(100, 110)), list(range(200, 212))
    held = on_host(cm, h1, h2)
    assert cm.cache.total_size() == 0 and cm.host.used() == 22
    running = [make_req("runner", [50, 51], max_new=8)]  # holds memory that will come free
    resume = make_req("resume", h1 + [1], waited_s=2.0)
    small = make_req("small", [7, 8], waited_s=1.0)
    waiting = [resume, small]

    admitted, started = admit(cm, running, [], waiting, ARGS, None, offer)
    # 4 free: the 10-token load does not fit; it waits, and the room that comes free is its own
    assert admitted == [] and started == [] and small.req_pool_idx is None
    assert resume.tier_waiting and resume.tier_unloaded_len == 10 and resume.host_loaded_len == 0

    # a longer resume arrives: lpm ranks it first (12 tokens on the host against 10), but the waiter keeps
    # its place, so the room that came free goes to the waiter and not to the newcomer's load
    longer = make_req("longer", h2 + [1], waited_s=0.5)
    waiting.append(longer)
    assert rids(order_waiting("lpm", waiting, cm)[0]) == ["longer", "resume", "small"]
    cm.allocator.free(held[:10])  # 14 free: room for one of the two loads
    admitted, started = admit(cm, running, [], waiting, ARGS, None, offer)
    assert started == [resume] and [(r.rid, n) for r, n in admitted] == [("resume", 1)]
    assert (resume.host_loaded_len, resume.tier_waiting) == (10, False)
    assert longer.tier_waiting and longer.host_loaded_len == 0 and small.req_pool_idx is None
    waiting.remove(resume)

    cm.release(resume)  # finished: its path stays cached (evictable)
    cm.allocator.free(held[10:])
    admitted, started = admit(cm, running, [], waiting, ARGS, None, offer)
    assert started == [longer, small] and (longer.host_loaded_len, longer.tier_waiting) == (12, False)
    cm.check_accounting([longer, small])


def test_an_overdue_request_still_goes_before_a_tier_waiter():
    cm = host_cm(pool=16, host=32)
    history = list(range(100, 110))
    held = on_host(cm, history)
    running = [make_req("runner", [50, 51], max_new=8)]
    resume = make_req("resume", history + [1], waited_s=1.0)
    waiting = [resume]
    admit(cm, running, [], waiting, ARGS, None, offer)
    assert resume.tier_waiting
    overdue = make_req("overdue", [7, 8], waited_s=OVERDUE_AFTER_S + 1)
    waiting.append(overdue)
    admitted, started = admit(cm, running, [], waiting, ARGS, None, offer)
    assert started == [overdue] and resume.tier_waiting and resume.req_pool_idx is None
    cm.allocator.free(held)
    cm.check_accounting([overdue])


def test_a_tier_load_takes_only_room_not_promised_to_requests_admitted_before_it():
    """Before, the load checked the pool alone: it took slots counted for a request admitted earlier in the
    round, then the adder refused it (the load wasted, the cache evicted for it)."""
    cm = host_cm(pool=16, host=32)
    history = list(range(100, 110))
    cache_tokens(cm, history)
    held = cm.alloc_slots(6)  # the pool is full
    cm.allocator.free(cm.alloc_slots(10))  # that evicted the history to the host; 10 free: the load fits
    first = make_req("first", [7, 8, 9, 10], waited_s=OVERDUE_AFTER_S + 1)  # offered first
    resume = make_req("resume", history + [1], waited_s=0.1)
    admitted, started = admit(cm, [], [], [resume, first], ARGS, None, offer)
    # first took 4 of the 10: the 10-token load no longer fits in what is left, so the resume waits
    assert started == [first] and resume.req_pool_idx is None and resume.tier_unloaded_len == 10
    assert resume.host_loaded_len == 0 and cm.host.counts["host_loaded_tokens"] == 0
    assert resume.tier_waiting
    cm.allocator.free(held)
    cm.check_accounting([first])
    cm.release(first, cache_tokens=False)
    cm.check_accounting([])
