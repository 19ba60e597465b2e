"""Host KV tier under the radix cache: evictions are copied to host memory and loaded back on a hit, the
accounting of both pools holds under heavy eviction and aborts, session pins past the limit move there, and
a demote/promote round trip gives bit-identical logits (fp32, the default model)."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.managers.scheduler.cache_manager import CacheManager
from runtime.managers.scheduler.req import Req
from runtime.managers.scheduler.sessions import SessionPins
from runtime.mem_cache.host_tier import HostTier, host_tier_tokens
from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool, SlotAllocator
from runtime.mem_cache.radix_cache import RadixCache
from runtime.messages import AbortReq, GenerateReq
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs
from tests.scheduler_utils import make_scheduler


def make_cm(pool: int = 16, host: int = 32, rows: int = 4) -> CacheManager:
    kv = KVPool(pool, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    return CacheManager(RadixCache(), ReqToTokenPool(rows, 64), SlotAllocator(pool), HostTier(kv, host))


def write_kv(cm: CacheManager, slots: torch.Tensor, tokens: list[int]) -> None:
    """KV contents that name their token: every element of token t's rows equals t (+0.5 for V)."""
    kv = cm.host.device_pool
    vals = torch.tensor(tokens, dtype=torch.float32)[:, None, None].expand(-1, kv.num_kv_heads, kv.head_dim)
    for layer in range(kv.num_layers):
        kv.write(layer, slots, vals + layer, vals + layer + 0.5)


def cache_tokens(cm: CacheManager, key: list[int]) -> torch.Tensor:
    slots = cm.alloc_slots(len(key))
    write_kv(cm, slots, key)
    assert cm.cache.insert(key, slots) == 0
    return slots


def assert_kv_names(cm: CacheManager, slots: torch.Tensor, tokens: list[int]) -> None:
    kv = cm.host.device_pool
    want = torch.tensor(tokens, dtype=torch.float32)
    for layer in range(kv.num_layers):
        assert torch.equal(kv.k[layer][slots][:, 0, 0], want + layer)
        assert torch.equal(kv.v[layer][slots][:, 1, 3], want + layer + 0.5)


def make_req(prompt: list[int], max_new: int = 4) -> Req:
    return Req(rid="r", prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new))


def test_eviction_copies_to_host_and_a_hit_loads_it_back():
    cm = make_cm(pool=16, host=32)
    cache_tokens(cm, list(range(100, 110)))
    cache_tokens(cm, list(range(200, 206)))  # pool full: 0 free, 16 cached
    assert cm.allocator.available() == 0 and cm.host.used() == 0
    held = cm.alloc_slots(8)  # evicts the older 10-token leaf: it goes to the host tier
    assert cm.cache.match_prefix(list(range(100, 110))).indices.numel() == 0
    assert cm.host.used() == 10 and cm.host.counts["host_saved_tokens"] == 10
    assert cm.host.match(list(range(100, 110))).indices.numel() == 10
    cm.allocator.free(held)
    cm.check_accounting([])


def test_start_loads_the_host_part_of_a_prefix():
    cm = make_cm(pool=16, host=32)
    key = list(range(100, 110))
    cache_tokens(cm, key)
    cache_tokens(cm, list(range(200, 206)))
    # wipe the evicted tokens' device rows: a load must bring their KV back from the host
    taken = cm.alloc_slots(10)
    write_kv(cm, taken, [0] * 10)
    cm.allocator.free(taken)
    req = make_req(key + [7])
    assert cm.match(req) == 0  # the device tree no longer has it
    assert cm.start(req)
    assert (req.match_len, req.host_loaded_len, req.kv_len, req.cache_owned_len) == (10, 10, 10, 10)
    slots = cm.req_pool.read(req.req_pool_idx, 10)
    assert_kv_names(cm, slots, key)
    assert cm.cache.protected_size() == 10  # the loaded path is locked for the request
    cm.check_accounting([req])
    cm.release(req, cache_tokens=False)
    cm.check_accounting([])
    assert cm.flush() and cm.host.used() == 0 and cm.allocator.available() == 16


def test_a_partial_device_match_is_extended_from_the_host():
    cm = make_cm(pool=16, host=32)
    base, tail = list(range(100, 106)), list(range(300, 306))
    cache_tokens(cm, base)
    req0 = make_req(base + tail + [1])
    cm.match(req0), cm.start(req0)
    own = cm.alloc_slots(6)
    write_kv(cm, own, tail)
    cm.append_slots(req0, own)
    cm.release(req0)  # base + tail cached: base | tail
    cm.check_accounting([])
    lock = cm.cache.match_prefix(base)
    cm.cache.lock(lock.last_node)  # keep base on the device
    held = cm.alloc_slots(10)  # evicts tail only
    cm.cache.unlock(lock.last_node)
    write_kv(cm, held, [0] * 10)
    cm.allocator.free(held)
    req = make_req(base + tail + [9])
    assert cm.match(req) == 6
    assert cm.start(req) and (req.match_len, req.host_loaded_len) == (12, 6)
    assert_kv_names(cm, cm.req_pool.read(req.req_pool_idx, 12), base + tail)
    cm.check_accounting([req])
    cm.release(req, cache_tokens=False)


def test_no_device_room_is_a_miss_not_an_error():
    cm = make_cm(pool=16, host=32)
    key = list(range(100, 110))
    cache_tokens(cm, key)
    held = cm.alloc_slots(16)  # evicts everything into the host, then holds the whole pool
    assert cm.host.used() == 10
    req = make_req(key + [1])
    cm.match(req)
    assert cm.start(req) and (req.match_len, req.host_loaded_len) == (0, 0)
    assert req.tier_unloaded_len == 10  # what the host held that did not fit: the adder decides
    cm.release(req, cache_tokens=False)
    cm.allocator.free(held)
    cm.check_accounting([])


def test_a_prefix_on_the_host_without_device_room_waits_while_room_may_come():
    from runtime.managers.scheduler.schedule_policy import AddOutcome, AddResult, PrefillAdder

    def adder(cm, running):
        return PrefillAdder(
            cm, running, max_prefill_tokens=100, chunk_size=4, new_token_ratio=0.0, max_running=4
        )

    cm = make_cm(pool=16, host=32)
    key = list(range(100, 110))
    cache_tokens(cm, key)
    held = cm.alloc_slots(10)  # evicts the key into the host; 6 slots stay free: a 4-token chunk fits
    runner = make_req([5, 6, 7])  # something that will give its memory back
    req = make_req(key + [1])
    cm.match(req)
    out = adder(cm, [runner]).add_waiting(req, matched=True)
    assert out == AddOutcome(AddResult.NO_TOKEN, 0)  # not a chunk that recomputes what the host holds
    assert req.req_pool_idx is None and cm.cache.protected_size() == 0  # its row and lock given back
    assert cm.allocator.available() == 6
    # no running request, nothing locked: no room would come, so it runs and recomputes (as before)
    cm.match(req)
    a = adder(cm, [])
    assert a.add_waiting(req, matched=True) == AddOutcome(AddResult.FULL, 4)
    assert req.tier_unloaded_len == 10 and req.host_loaded_len == 0
    cm.release(req, cache_tokens=False)
    cm.allocator.free(held)  # room came: the whole prefix is loaded from the host
    cm.match(req)
    assert adder(cm, [runner]).add_waiting(req, matched=True) == AddOutcome(AddResult.CONTINUE, 1)
    assert (req.host_loaded_len, req.tier_unloaded_len) == (10, 0)
    cm.release(req, cache_tokens=False)
    cm.check_accounting([])


def test_a_load_that_cannot_fit_evicts_nothing():
    cm = make_cm(pool=16, host=32)
    key = list(range(100, 110))
    cache_tokens(cm, key)
    held = cm.alloc_slots(14)  # the key goes to the host; 2 slots free
    cm.allocator.free(held[:4])
    other = [200, 201, 202]
    cache_tokens(cm, other)  # 3 evictable + 3 free < 10
    req = make_req(key + [1])
    cm.match(req)
    assert cm.start(req) and req.tier_unloaded_len == 10
    assert cm.cache.match_prefix(other).indices.numel() == 3  # not flushed for a load that could not fit
    cm.release(req, cache_tokens=False)
    cm.allocator.free(held[4:])
    cm.check_accounting([])


def test_a_match_evicted_by_an_earlier_requests_load_is_taken_again():
    """lpm matches the whole queue, then starts requests in turn: a host load of the first may evict what
    the second matched. The second then matches again instead of locking a detached node."""
    from runtime.managers.scheduler.schedule_policy import PrefillAdder, order_waiting

    cm = make_cm(pool=16, host=32)
    a = list(range(100, 110))
    cache_tokens(cm, a)
    first3 = cm.cache.exact_node(cm.cache.match_prefix(a[:3]).last_node, 3)
    cm.cache.lock(first3)
    held = cm.alloc_slots(13)  # a's last 7 tokens go to the host; its first 3 stay on the device
    cm.cache.unlock(first3)
    cm.allocator.free(held)
    b = [200, 201]
    cache_tokens(cm, b)
    held = cm.alloc_slots(cm.allocator.available() - 5)  # 5 free: a's 7-token load must evict b
    ra, rb = make_req(a + [1], max_new=1), make_req(b + [2], max_new=1)
    ra.arrival, rb.arrival = 0.0, 1.0
    ordered, matched = order_waiting("lpm", [ra, rb], cm)
    assert ordered == [ra, rb] and (ra.match_len, rb.match_len) == (3, 2)
    adder = PrefillAdder(cm, [], max_prefill_tokens=100, chunk_size=0, new_token_ratio=0.0, max_running=4)
    adder.add_waiting(ra, matched)
    assert ra.host_loaded_len == 7 and cm.cache.match_prefix(b).indices.numel() == 0  # b was evicted
    adder.add_waiting(rb, matched)  # before: ValueError, a node not attached to the cache
    assert (rb.match_len, rb.host_loaded_len) == (2, 2)  # matched again: b came back from the host
    for r, _ in adder.admitted:
        cm.release(r, cache_tokens=False)
    for r in (ra, rb):
        cm.release(r, cache_tokens=False)
    cm.allocator.free(held)
    cm.check_accounting([])


def test_integrity_of_both_pools_under_heavy_random_eviction():
    rng = random.Random(0)
    cm = make_cm(pool=64, host=96, rows=6)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(6)]
    live: list[Req] = []
    for _ in range(400):
        if live and (len(live) >= 5 or rng.random() < 0.4):
            req = live.pop(rng.randrange(len(live)))
            cm.release(req, cache_tokens=rng.random() < 0.8)
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 24))]
            req = make_req(prompt)
            cm.match(req)
            if cm.start(req):
                slots = cm.alloc_slots(len(prompt) - req.kv_len)
                if slots is None:
                    cm.release(req, cache_tokens=False)
                else:
                    write_kv(cm, slots, prompt[req.kv_len :])
                    cm.append_slots(req, slots)
                    # every slot of the row holds its token's KV, whichever tier it came from
                    assert_kv_names(cm, cm.req_pool.read(req.req_pool_idx, req.kv_len), prompt)
                    live.append(req)
        cm.check_accounting(live)
    assert cm.host.counts["host_saved_tokens"] > 0 and cm.host.counts["host_loaded_tokens"] > 0
    assert cm.host.counts["host_dropped_tokens"] > 0  # the host's own LRU ran too
    for req in live:
        cm.release(req)
    assert cm.flush()
    assert cm.allocator.available() == 64 and cm.host.allocator.available() == 96


def test_a_pin_past_the_limit_moves_to_the_host_and_comes_back():
    cm = make_cm(pool=16, host=32)
    pins = SessionPins(cm.cache, max_pinned_tokens=8, host=cm.host)
    a, b = list(range(100, 106)), list(range(200, 206))
    cache_tokens(cm, a)
    assert pins.pin((None, None, "A"), a, 60.0)
    cache_tokens(cm, b)
    assert pins.pin((None, None, "B"), b, 60.0)  # over the limit: A is demoted, not dropped
    assert pins.counts["demoted_to_host"] == 1 and pins.counts["evicted_for_limit"] == 0
    assert (pins.pinned_tokens, pins.host_pinned_tokens) == (6, 6)
    assert cm.cache.protected_size() == 6 and cm.host.tree.protected_size() == 6
    held = cm.alloc_slots(10)  # A's device copy is evicted; its host copy is pinned there
    assert cm.cache.match_prefix(a).indices.numel() == 0
    cm.allocator.free(held)
    req = make_req(a + [1])
    cm.match(req)
    assert cm.start(req) and req.host_loaded_len == 6
    assert_kv_names(cm, cm.req_pool.read(req.req_pool_idx, 6), a)
    cm.release(req, cache_tokens=False)
    assert pins.release((None, None, "A")) == 6 and pins.host_pinned_tokens == 0
    assert not cm.flush()  # B still pinned
    pins.release_all()
    cm.check_accounting([])
    assert cm.flush()


def test_host_pins_are_bounded_by_the_pin_limit_too():
    """Demoted pins do not pile up on the host for their TTL: past --max-pinned-tokens the oldest goes."""
    cm = make_cm(pool=32, host=64)
    pins = SessionPins(cm.cache, max_pinned_tokens=8, host=cm.host)
    paths = [list(range(100 * k, 100 * k + 6)) for k in range(1, 5)]
    for k, path in enumerate(paths):
        cache_tokens(cm, path)
        assert pins.pin((None, None, f"S{k}"), path, 60.0)
    assert pins.pinned_tokens == 6 and pins.host_pinned_tokens == 6  # S3 on the device, S2 on the host
    assert pins.counts["demoted_to_host"] == 3 and pins.counts["evicted_for_limit"] == 2
    assert pins.release((None, None, "S2")) == 6 and pins.release((None, None, "S1")) == 0
    pins.release_all()
    cm.check_accounting([])


def test_a_pin_is_dropped_when_the_host_has_no_room():
    cm = make_cm(pool=16, host=4)
    pins = SessionPins(cm.cache, max_pinned_tokens=8, host=cm.host)
    cache_tokens(cm, list(range(100, 106)))
    pins.pin((None, None, "A"), list(range(100, 106)), 60.0)
    cache_tokens(cm, list(range(200, 206)))
    pins.pin((None, None, "B"), list(range(200, 206)), 60.0)
    assert pins.counts["evicted_for_limit"] == 1 and pins.counts["demoted_to_host"] == 0
    pins.release_all()
    cm.check_accounting([])


def test_server_args_check_the_host_tier():
    assert ServerArgs(kv_host_tier_gb=0.5).kv_host_tier_gb == 0.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--kv-host-tier-gb"):
            ServerArgs(kv_host_tier_gb=bad)
    with pytest.raises(ValueError, match="radix cache"):
        ServerArgs(kv_host_tier_gb=1.0, disable_radix_cache=True)
    kv = KVPool(8, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    assert host_tier_tokens(1 / 1024, kv) == 2**20 // kv.bytes_per_token()


# ---- with the default model (fp32) -------------------------------------------------------------------


def gen(rid: str, prompt: list[int], max_new: int = 1) -> GenerateReq:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return GenerateReq(rid=rid, input_ids=prompt, params=params)


def run_one(sched, m: GenerateReq, logits: list) -> dict:
    """Run one request to its end; returns its last output. `logits` collects every forward's output."""
    logits.clear()
    sched.handle(m)
    last = None
    while sched.has_work():
        for o in sched.step():
            last = o
        sched.check_accounting()
    return last


def test_demote_promote_round_trip_gives_bit_identical_logits(default_model_dir, default_tokenizer):
    sched = make_scheduler(
        default_model_dir,
        default_tokenizer,
        max_total_tokens=160,
        kv_host_tier_gb=0.05,
        chunked_prefill_size=0,
    )
    assert sched.cm.host is not None and sched.server_info()["host_tier_tokens"] > 0
    logits: list[torch.Tensor] = []
    forward = sched.runner.forward
    sched.runner.forward = lambda batch: logits.append(forward(batch)) or logits[-1]
    rng = random.Random(1)
    prompt = [rng.randrange(100, 40000) for _ in range(100)]
    other = [rng.randrange(100, 40000) for _ in range(140)]
    run_one(sched, gen("a0", prompt), logits)
    out = run_one(sched, gen("a1", prompt), logits)  # served from the device pool
    assert (out.cached_tokens, out.cached_tokens_host) == (99, 0)
    from_device = logits[0].clone()
    run_one(sched, gen("b", other), logits)  # needs the pool: the prompt's KV moves to the host tier
    assert sched.cm.cache.match_prefix(prompt).indices.numel() < 99
    out = run_one(sched, gen("a2", prompt), logits)  # loaded back from the host tier
    assert out.cached_tokens == 99 and out.cached_tokens_host > 0
    assert logits[0].shape == from_device.shape == (1, sched.runner.vocab_size)
    assert torch.equal(logits[0], from_device)  # bit-identical: the KV made the round trip unchanged
    info = sched.server_info()
    assert info["host_saved_tokens"] > 0 and info["host_loaded_tokens"] >= out.cached_tokens_host


def test_a_history_on_the_host_waits_for_room_instead_of_being_recomputed(tiny_model_dir, default_tokenizer):
    """A session's history was moved to the host tier; its next step arrives while a long request holds
    the pool: it waits for that request to finish, then loads the whole history from the host."""
    sched = make_scheduler(
        tiny_model_dir, default_tokenizer, max_total_tokens=256, kv_host_tier_gb=0.01, chunked_prefill_size=32
    )
    rng = random.Random(3)
    history = [4] + [rng.randrange(10, 512) for _ in range(99)]
    run_one(sched, gen("h0", history), [])
    run_one(sched, gen("other", [5] + [rng.randrange(10, 512) for _ in range(199)]), [])
    assert sched.cm.cache.match_prefix(history).indices.numel() == 0  # evicted: only the host has it
    sched.handle(gen("long", [6] + [rng.randrange(10, 512) for _ in range(199)], max_new=30))
    while not sched.running:
        sched.step()
    assert sched.cm.available() < 100  # no room to load the history now; a 32-token chunk would fit
    sched.handle(gen("h1", history + [7]))
    finished = []
    while sched.has_work():
        for o in sched.step():
            if o.finished_reason is not None:
                finished.append(o)
        sched.check_accounting()
    assert [o.rid for o in finished] == ["long", "h1"]
    assert (finished[1].cached_tokens, finished[1].cached_tokens_host) == (100, 100)
    info = sched.server_info()
    assert info["tier_load_waits"] >= 1 and info["tier_tokens_recomputed"] == 0


def test_aborts_leak_nothing_in_either_pool(tiny_model_dir, default_tokenizer):
    sched = make_scheduler(tiny_model_dir, default_tokenizer, max_total_tokens=192, kv_host_tier_gb=0.01)
    rng = random.Random(2)
    system = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(rng.randrange(20, 60))] for _ in range(10)]
    for round_ in range(3):
        for i, p in enumerate(prompts):
            sched.handle(gen(f"r{round_}-{i}", p, max_new=6))
        for step in range(12):
            sched.step()
            sched.check_accounting()
            if step % 3 == 2:
                sched.handle(AbortReq(rid=f"r{round_}-{step}"))
        sched.handle(AbortReq(rid="", abort_all=True))
        while sched.has_work():
            sched.step()
        sched.check_accounting()
    assert sched.cm.host.counts["host_saved_tokens"] > 0
    assert sched.flush_cache()
    assert sched.cm.allocator.available() == sched.cm.allocator.size
    assert sched.cm.host.allocator.available() == sched.cm.host.size
    assert sched.cm.req_pool.available() == sched.cm.req_pool.size
