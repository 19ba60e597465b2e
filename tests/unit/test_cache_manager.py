"""CacheManager budgets with exact numbers and slot ids: available(), alloc with eviction when short,
start / cache_prefix / release, and the accounting invariant after each."""

from __future__ import annotations

import pytest
import torch

from runtime.managers.scheduler.cache_manager import CacheManager
from runtime.managers.scheduler.req import Req
from runtime.mem_cache.memory_pool import ReqToTokenPool, SlotAllocator
from runtime.mem_cache.radix_cache import RadixCache
from runtime.messages import RequestOptions
from runtime.sampling_params import SamplingParams


def make_cm(pool: int = 16, rows: int = 4) -> CacheManager:
    return CacheManager(RadixCache(), ReqToTokenPool(rows, 32), SlotAllocator(pool))


def cache_tokens(cm: CacheManager, key: list[int]) -> list[int]:
    """Put `key` into the cache with freshly allocated slots; returns those slots."""
    slots = cm.alloc_slots(len(key))
    assert cm.cache.insert(key, slots) == 0
    return slots.tolist()


def make_req(prompt: list[int], max_new: int = 4) -> Req:
    return Req(rid="r", prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new))


def test_available_is_free_plus_evictable():
    cm = make_cm(16)
    assert cm.available() == 16
    cache_tokens(cm, [1, 2, 3, 4])
    assert (cm.allocator.available(), cm.cache.evictable_size(), cm.available()) == (12, 4, 16)
    res = cm.cache.match_prefix([1, 2, 3, 4])
    cm.cache.lock(res.last_node)  # a locked prefix is not obtainable
    assert cm.available() == 12
    cm.cache.unlock(res.last_node)
    assert cm.available() == 16
    cm.check_accounting([])


def test_alloc_takes_free_slots_last_in_first_out():
    cm = make_cm(16)
    assert cm.alloc_slots(4).tolist() == [13, 14, 15, 16]
    assert cm.alloc_slots(2).tolist() == [11, 12]
    assert cm.allocator.available() == 10


def test_alloc_evicts_least_recently_used_leaves_when_short():
    cm = make_cm(16)
    old = cache_tokens(cm, [1, 2, 3, 4, 5])  # slots 12..16
    new = cache_tokens(cm, [7, 8, 9, 10, 11, 12])  # slots 6..11, used later
    assert (old, new) == ([12, 13, 14, 15, 16], [6, 7, 8, 9, 10, 11])
    assert cm.allocator.available() == 5
    slots = cm.alloc_slots(8)  # 3 short: the older leaf (5 tokens) goes whole
    # Free list [1..5] + evicted [12..16]; the last 8 freed are handed out first.
    assert slots.tolist() == [3, 4, 5, 12, 13, 14, 15, 16]
    assert cm.cache.match_prefix([1, 2, 3, 4, 5]).indices.numel() == 0
    assert cm.cache.match_prefix([7, 8, 9, 10, 11, 12]).indices.tolist() == new
    assert (cm.allocator.available(), cm.cache.total_size()) == (2, 6)


def test_alloc_fails_without_touching_anything_when_locked_cache_blocks_it():
    cm = make_cm(8)
    cache_tokens(cm, [1, 2, 3, 4, 5, 6])
    res = cm.cache.match_prefix([1, 2, 3, 4, 5, 6])
    cm.cache.lock(res.last_node)
    assert cm.alloc_slots(3) is None
    assert (cm.allocator.available(), cm.cache.total_size(), cm.cache.protected_size()) == (2, 6, 6)
    cm.cache.unlock(res.last_node)


def test_request_lifecycle_keeps_the_invariant_with_exact_counts():
    cm = make_cm(16)
    shared = cache_tokens(cm, [1, 2, 3])  # 13 free, 3 cached
    req = make_req([1, 2, 3, 4, 5])
    assert cm.match(req) == 3 and req.match_indices.tolist() == shared
    assert cm.start(req)
    assert (req.kv_len, req.cache_owned_len, cm.cache.protected_size(), cm.available()) == (3, 3, 3, 13)
    cm.append_slots(req, cm.alloc_slots(2))  # the 2 prompt tokens not cached
    assert req.kv_len == 5 and cm.allocator.available() == 11
    assert cm.req_pool.read(req.req_pool_idx, 5).tolist()[:3] == shared
    cm.check_accounting([req])

    cm.cache_prefix(req)  # publish all 5: the request keeps only a lock, no slots of its own
    assert (req.cache_owned_len, cm.cache.total_size(), cm.cache.protected_size()) == (5, 5, 5)
    cm.check_accounting([req])

    req.output_ids = [6]
    cm.append_slots(req, cm.alloc_slots(1))
    assert (req.kv_len, cm.allocator.available()) == (6, 10)
    cm.check_accounting([req])

    cm.release(req)  # its 6 tokens go to the cache, the lock and the row are dropped
    assert req.req_pool_idx is None and (req.kv_len, req.cache_owned_len) == (0, 0)
    assert (cm.allocator.available(), cm.cache.total_size(), cm.cache.evictable_size()) == (10, 6, 6)
    assert cm.req_pool.available() == 4
    cm.check_accounting([])


def test_release_frees_duplicates_of_what_is_already_cached():
    cm = make_cm(16)
    cache_tokens(cm, [1, 2, 3, 4])  # cached by an earlier request
    req = make_req([1, 2, 3, 4])
    req.match_len, req.match_node, req.match_indices = 0, cm.cache.root, torch.empty(0, dtype=torch.int64)
    assert cm.start(req)  # computed without the cache hit: 4 slots of its own for the same tokens
    cm.append_slots(req, cm.alloc_slots(4))
    assert cm.allocator.available() == 8
    cm.release(req)
    assert (cm.allocator.available(), cm.cache.total_size()) == (12, 4)
    cm.check_accounting([])


def test_release_without_caching_frees_own_slots_only():
    cm = make_cm(16)
    cache_tokens(cm, [1, 2])
    req = make_req([1, 2, 3])
    cm.match(req)
    cm.start(req)
    cm.append_slots(req, cm.alloc_slots(1))
    cm.release(req, cache_tokens=False)
    assert (cm.allocator.available(), cm.cache.total_size(), cm.cache.protected_size()) == (14, 2, 0)
    cm.check_accounting([])


def test_drop_kv_gives_own_slots_to_the_decode_run_and_never_cuts_into_cache_owned_ones():
    cm = make_cm(16)
    cache_tokens(cm, [1, 2])
    req = make_req([1, 2, 3])
    cm.match(req)
    cm.start(req)
    own = cm.alloc_slots(3)
    cm.append_slots(req, own)  # kv 5: 2 cached + 3 own
    cm.drop_kv_from(req, 3)
    assert req.kv_len == 3 and cm.allocator.available() == 11 and cm.available() == 13
    cm.check_accounting([req])
    # the dropped positions' slots are the request's next positions' slots again
    again = cm.run_slots([req], [2])
    assert again.tolist() == own[1:].tolist()
    cm.append_slots(req, again)
    cm.drop_kv_from(req, 1)  # inside the cached prefix: the request gives all its KV back instead
    assert req.req_pool_idx is None and req.kv_len == 0
    assert (cm.allocator.available(), cm.cache.total_size(), cm.cache.protected_size()) == (14, 2, 0)
    cm.check_accounting([])


def test_jump_forward_rewrite_then_finish_caches_only_kv_of_kept_tokens():
    """Regression (a JSON Schema through jump-forward killed the server): a request whose cached prefix
    covers output tokens that jump-forward then rewrites, and which finishes in the same step, must not
    insert the old tokens' KV under the new tokens (that put one cache-owned slot in two nodes)."""
    cm = make_cm(32)
    req = make_req([1, 2, 3])
    req.output_ids = [4, 5]
    cm.match(req)
    cm.start(req)
    cm.append_slots(req, cm.alloc_slots(4))  # positions 0..3 computed (the last token has no KV yet)
    cm.cache_prefix(req)  # positions 0..3 now belong to the cache
    cm.append_slots(req, cm.alloc_slots(1))  # decode step: position 4 (token 5) own
    cm.drop_kv_from(req, 3 + 0)  # jump-forward keeps 0 output tokens: 4 and 5 are rewritten
    req.output_ids = [6, 7, 8]
    cm.release(req, cache_tokens=True)  # finished: whatever KV it still holds goes to the cache
    cm.check_accounting([])
    assert cm.cache.match_prefix([1, 2, 3, 6, 7]).indices.numel() == 3


def test_accounting_check_catches_a_lost_slot():
    cm = make_cm(8)
    cm.alloc_slots(1)  # allocated and held by nobody
    broken = "KV accounting broken: free 7 \\+ cache 0 \\+ requests 0 \\+ decode runs 0 = 7"
    with pytest.raises(AssertionError, match=broken):
        cm.check_accounting([])


def test_start_fails_when_no_row_is_free():
    cm = make_cm(16, rows=1)
    a, b = make_req([1, 2]), make_req([3, 4])
    cm.match(a)
    cm.match(b)
    assert cm.start(a)
    assert not cm.start(b) and b.req_pool_idx is None and b.locked_node is None
    cm.release(a, cache_tokens=False)


def _finish_and_cache(cm: CacheManager, req: Req) -> None:
    """Admit `req` (after its prefix match), give it slots for the rest of its prompt, release it to the
    cache."""
    cm.match(req)
    assert cm.start(req)
    cm.append_slots(req, cm.alloc_slots(req.seq_len - req.kv_len))
    cm.release(req)


def test_cache_salt_isolates_prefixes():
    """Requests share cached KV only with requests of the same salt; unsalted ones only with each other."""
    cm = make_cm(64)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]

    def salted(salt):
        r = make_req(prompt)
        r.options = RequestOptions(cache_salt=salt)
        return r

    _finish_and_cache(cm, make_req(prompt))  # unsalted: cached
    assert cm.match(salted("tenant-a")) == 0
    _finish_and_cache(cm, salted("tenant-a"))
    assert cm.match(salted("tenant-a")) == len(prompt) - 1  # its own salt hits (one token recomputed)
    assert cm.match(salted("tenant-b")) == 0
    assert cm.match(make_req(prompt)) == len(prompt) - 1  # unsalted still hits the unsalted copy
    assert cm.cache.total_size() == 2 * len(prompt)  # two copies, never one shared
    cm.check_accounting([])


def test_salted_keys_never_collide_with_token_ids():
    r = make_req([0, 1, 2**31])
    r.options = RequestOptions(cache_salt="s")
    key = r.cache_key(3)
    assert min(key) >= 2**32 and [k - key[0] for k in key] == [0, 1, 2**31]
    r2 = make_req([0, 1, 2**31])
    r2.options = RequestOptions(cache_salt="t")
    assert not set(key) & set(r2.cache_key(3))


def test_a_match_ending_inside_a_node_locks_only_the_matched_tokens():
    """A prompt sharing one token with a long cached sequence locks that token, not the whole sequence:
    otherwise a 9-token prompt never fits a 16-slot pool holding a 12-token sequence (it waited forever)."""
    cm = make_cm(16)
    cache_tokens(cm, list(range(1, 13)))  # 12 slots cached, 4 free
    req = make_req([1, *range(50, 58)])  # shares the first token only
    assert cm.match(req) == 1
    assert cm.start(req)
    assert cm.cache.protected_size() == 1 and cm.available() == 15
    cm.append_slots(req, cm.alloc_slots(req.seq_len - req.kv_len))  # 8 slots: evicts the unlocked part
    cm.check_accounting([req])
    cm.release(req)
    assert cm.cache.protected_size() == 0
    cm.check_accounting([])
    # a full match ending inside a node (a cached prefix of a longer sequence) is exact too
    cache_tokens(cm, [100, 101, 102, 103, 104, 105])
    short = make_req([100, 101, 102, 103, 200])
    assert cm.match(short) == 4 and cm.start(short)
    assert cm.cache.protected_size() == 4
    cm.release(short, cache_tokens=False)
    cm.check_accounting([])


def test_matches_taken_before_another_request_splits_the_node_stay_exact():
    """Two requests matched in the same step, both inside one cached node: the first one's start splits
    the node, the second one's match then ends above its node's new start and is still locked exactly."""
    cm = make_cm(16)
    cache_tokens(cm, list(range(1, 11)))
    deep, shallow = make_req([1, 2, 3, 4, 5, 6, 60]), make_req([1, 2, 70])
    assert cm.match(deep) == 6 and cm.match(shallow) == 2
    assert cm.start(deep) and cm.start(shallow)
    assert cm.cache.protected_size() == 6
    cm.release(deep, cache_tokens=False)
    assert cm.cache.protected_size() == 2
    cm.release(shallow, cache_tokens=False)
    cm.check_accounting([])


def test_one_slot_each_is_append_slots_per_request():
    """A decode step's batched table write equals one `append_slots` per request (rows, positions, kv_len)."""
    cms = make_cm(64, rows=4), make_cm(64, rows=4)
    reqs = {}
    for cm in cms:
        reqs[cm] = [make_req(list(range(1, 2 + i))) for i in range(3)]
        for req in reqs[cm]:
            req.req_pool_idx = cm.req_pool.alloc()
            cm.append_slots(req, cm.alloc_slots(len(req.prompt_ids)))
    batched, single = cms
    for step in range(2):
        slots = batched.alloc_slots(3)
        assert torch.equal(slots, single.alloc_slots(3))
        batched.append_one_slot_each(reqs[batched], slots)
        for i, req in enumerate(reqs[single]):
            single.append_slots(req, slots[i : i + 1])
        want = [2 + step, 3 + step, 4 + step]
        assert [r.kv_len for r in reqs[batched]] == [r.kv_len for r in reqs[single]] == want
    assert torch.equal(batched.req_pool.req_to_token, single.req_pool.req_to_token)
    one = make_cm(8, rows=2)  # a batch of one takes the per-request path
    req = make_req([5, 6])
    req.req_pool_idx = one.req_pool.alloc()
    one.append_one_slot_each([req], one.alloc_slots(1))
    assert req.kv_len == 1 and one.req_pool.read(req.req_pool_idx, 1).tolist() == [8]


# ---- decode runs ---------------------------------------------------------------------------------------
def start_decoding(cm: CacheManager, prompt: list[int], max_new: int = 40) -> Req:
    """A request whose prompt KV is its own and that decodes next (kv_len == seq_len - 1 after a sample)."""
    req = make_req(prompt, max_new)
    cm.match(req)
    cm.start(req)
    cm.append_slots(req, cm.alloc_slots(len(prompt)))
    return req


def test_decoding_requests_fill_their_positions_from_their_own_contiguous_runs():
    cm = make_cm(200)
    a, b = start_decoding(cm, [1, 2]), start_decoding(cm, [3, 4])
    steps = []
    for _ in range(5):
        slots = cm.run_slots([a, b], [1, 1])
        cm.append_one_slot_each([a, b], slots)
        steps.append(slots.tolist())
    a_slots, b_slots = [s[0] for s in steps], [s[1] for s in steps]
    # a step takes one slot per request, but each request's slots follow one another in the pool
    assert a_slots == list(range(a_slots[0], a_slots[0] + 5))
    assert b_slots == list(range(b_slots[0], b_slots[0] + 5))
    assert cm.info()["decode_run_tokens"] == 2 * (32 - 5)
    cm.check_accounting([a, b])
    cm.release(a, cache_tokens=False)
    cm.release(b, cache_tokens=False)
    assert cm.allocator.available() == 200 and cm.info()["decode_run_tokens"] == 0
    cm.check_accounting([])


def test_a_run_is_no_longer_than_the_request_can_use():
    cm = make_cm(200)
    req = start_decoding(cm, [1, 2], max_new=3)
    cm.append_slots(req, cm.run_slots([req], [1]))
    assert cm.info()["decode_run_tokens"] == 3  # max_new_tokens 3 + this step's slot - the slot taken
    cm.check_accounting([req])


def test_rejected_draft_slots_return_to_the_head_of_the_run():
    cm = make_cm(200)
    req = start_decoding(cm, [1, 2, 3])
    req.output_ids = [9]  # kv covers the prompt; the last token and 4 draft tokens are verified
    slots = cm.run_slots([req], [5]).tolist()
    cm.append_slots(req, torch.tensor(slots))
    cm.drop_kv_from(req, 3 + 2)  # the last token and one draft token kept
    assert req.kv_len == 5
    again = cm.run_slots([req], [3])
    assert again.tolist() == slots[2:]  # the rejected positions reuse their slots
    cm.append_slots(req, again)
    cm.check_accounting([req])


def test_runs_go_back_when_a_step_cannot_be_served_otherwise():
    cm = make_cm(70, rows=4)
    a, b = start_decoding(cm, [1, 2]), start_decoding(cm, [3, 4])
    cm.append_one_slot_each([a, b], cm.run_slots([a, b], [1, 1]))  # two runs of 32: 70 - 4 - 64 = 2 free
    assert cm.allocator.available() == 2 and cm.available() == 2 + 62
    c = start_decoding(cm, [5, 6])  # the prompt takes the last 2 free slots
    slots = cm.run_slots([a, b, c], [1, 1, 1])  # c has no run and the free list is empty
    assert slots is not None and cm.info()["decode_run_tokens"] == 0
    cm.append_one_slot_each([a, b, c], slots)
    cm.check_accounting([a, b, c])


def test_a_prefill_takes_the_runs_back_when_the_pool_runs_short():
    cm = make_cm(70, rows=4)
    a, b = start_decoding(cm, [1, 2]), start_decoding(cm, [3, 4])
    cm.append_one_slot_each([a, b], cm.run_slots([a, b], [1, 1]))
    c = make_req([5] * 20)
    cm.match(c)
    cm.start(c)
    cm.append_slots(c, cm.alloc_slots(20))  # 2 free: the runs go back to the free list for it
    assert cm.info()["decode_run_tokens"] == 0
    cm.check_accounting([a, b, c])


def test_a_step_that_cannot_get_its_slots_returns_none_and_loses_nothing():
    cm = make_cm(40, rows=4)
    a, b = start_decoding(cm, [1] * 18), start_decoding(cm, [2] * 18)
    cm.append_one_slot_each([a, b], cm.run_slots([a, b], [1, 1]))  # 4 free: too few for runs, one slot each
    assert cm.run_slots([a, b], [3, 3]) is None  # 0 free, nothing to evict
    cm.check_accounting([a, b])
    for r in (a, b):
        cm.release(r, cache_tokens=False)
    assert cm.allocator.available() == 40
    cm.check_accounting([])


def test_a_flush_that_frees_every_slot_puts_the_pool_back_in_order():
    cm = make_cm(16)
    cache_tokens(cm, [1, 2, 3])
    req = start_decoding(cm, [4, 5])
    cm.append_one_slot_each([req], cm.run_slots([req], [1]))
    req.output_ids = [6, 7]  # kv covers the prompt and the first output token
    cm.release(req)  # its tokens go to the cache: the free list is now in no particular order
    assert cm.flush()
    assert cm.allocator.free_slots().tolist() == list(range(1, 17))
    cm.check_accounting([])


def test_run_slots_without_evicting_leaves_the_cache_and_takes_nothing():
    """A decode riding along with a prefill (evict=False) gets its slot from the free list or not at all:
    the cached prefix stays, and no run is filled."""
    cm = make_cm(8)
    cache_tokens(cm, [1, 2, 3, 4])  # evictable
    req = start_decoding(cm, [5, 6, 7])  # 8 - 4 - 3: 1 free slot
    assert cm.run_slots([req], [2], evict=False) is None
    assert (cm.allocator.available(), cm.cache.total_size(), cm.info()["decode_run_tokens"]) == (1, 4, 0)
    cm.append_slots(req, cm.run_slots([req], [1], evict=False))  # the free slot
    assert cm.cache.total_size() == 4
    cm.append_slots(req, cm.run_slots([req], [2]))  # a decode step evicts
    assert cm.cache.total_size() < 4
    cm.check_accounting([req])
