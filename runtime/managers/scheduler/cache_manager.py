"""Moves KV slots between requests, the radix cache and the free list.

A request's row `req_to_token[row, :kv_len]` holds its KV slots. The first `cache_owned_len` of them belong
to the
radix cache (matched at admission and kept alive by locking `locked_node`); the rest are the request's own.
When a request leaves (finish, abort, retraction) its tokens are inserted into the cache, duplicates freed and
the lock dropped, so the accounting invariant holds after every step:

    allocator.available() + cache.total_size() + sum(own slots of live requests) == pool size

A decoding request also owns a *decode run*: up to `DECODE_RUN` free slots taken from the pool in one piece,
from which its next positions are filled (`run_slots`), and to whose head a verify's rejected slots go back
(`drop_kv_from`). A batch that takes one slot per request per step from the shared free list interleaves
the requests' KV, and freed draft slots and evicted cache nodes scatter it; attention over scattered KV
is slower (`bench/paged_attention_op.py --layout`: 8 x 2300 keys, 37 ms contiguous against 52 ms
scattered). Runs count as the request's own slots in the invariant, as available to admission (they hold a
running request's next tokens, which the prefill adder reserves anyway), and they are given back whenever
the pool runs short.

With a host tier (`--kv-host-tier-gb`) the cache's evictions are copied there first, and `start` loads a
prefix the host holds beyond the device match back into fresh device slots (inserted into the cache like any
computed KV) instead of leaving it to be recomputed. When the pool has no room for it now, `start` records
that on the request (`tier_unloaded_len`) and the prefill adder lets it wait for room.

Sliding-window layers with their own pool (`memory_pool.SlidingSlotAllocator`, `sliding_window` > 0, the
largest window of the model's sliding layers, W):
  * a running request frees the sliding rows of its own tokens (not the cache-owned prefix) older than its
    window each time it appends: before computing position p the sliding layers read only positions
    p - W + 1 .. p, so rows of positions below `kv_len - W + 1` go back (`_free_out_of_window`);
  * the radix cache may drop a node's sliding K/V under pressure and keep the node (`evict_sliding`), and a
    finished request's tokens are cached with the rows it already freed missing;
  * so a cached prefix is reusable only up to a match end m where every sliding layer still holds the
    W - 1 tokens before m (positions max(0, m - W + 1) .. m - 1: what the first recomputed token, at m,
    attends to besides itself); a longer match is cut back to the longest such m
    (`sliding_usable_len`), and everything past it is recomputed. m = 0 always qualifies;
  * a rollback (`drop_kv_from`) to a position whose window was partly freed gives the request's KV back
    (recomputed at its next admission), as a rollback into the cache-owned prefix does;
  * `available()` is the smaller of what the full and the sliding pool can supply, so admission never
    takes more rows than there are.
Accounting adds: sliding free rows + rows held by full slots == sliding pool size, and a free full slot
holds no row (`SlidingSlotAllocator.check`).
"""

from __future__ import annotations

import hashlib
import os
import time

import torch

from runtime.managers.scheduler.req import Req
from runtime.mem_cache.disk_tier import BLOCK, DiskTier
from runtime.mem_cache.host_tier import HostTier, host_tier_tokens
from runtime.mem_cache.memory_pool import ReqToTokenPool, SlidingSlotAllocator, SlotAllocator
from runtime.mem_cache.radix_cache import BasePrefixCache, RadixCache
from runtime.models.model_loader import weights_fingerprint

DECODE_RUN = 32  # slots a decoding request takes from the pool at a time (~3 pages of one layer's K)


def sliding_usable_len(held: torch.Tensor, window: int) -> int:
    """The longest m <= len(held) such that `held[max(0, m - window + 1):m]` is all True: how much of a
    cached prefix whose tokens hold sliding-layer K/V where `held` (bool [n]) is True can be reused."""
    m = held.numel()
    missing = (~held).nonzero().flatten().tolist()
    for b in reversed(missing):  # b < m: the latest missing token not yet ruled out
        if m - window + 1 > b:  # the window before m starts after it
            return m
        m = b  # every end in (b, m] sees b: the longest candidate left ends right at b
    return m


class CacheManager:
    def __init__(
        self,
        cache: BasePrefixCache,
        req_pool: ReqToTokenPool,
        allocator: SlotAllocator,
        host: HostTier | None = None,
        disk: DiskTier | None = None,
        sliding_window: int = 0,
    ):
        """`sliding_window`: the model's largest sliding window (0: none); it takes effect only with a
        `SlidingSlotAllocator` (the sliding layers' own pool)."""
        self.cache = cache
        self.req_pool = req_pool
        self.allocator = allocator
        self.host = host
        self.disk = disk
        self._runs: dict[int, list[int]] = {}  # request row -> its decode run, next position's slot first
        self._run_slots = 0
        if host is not None:
            assert isinstance(cache, RadixCache), "a host tier sits under the radix cache"
            cache.on_evict = host.save
        self.sliding: SlidingSlotAllocator | None = None
        self.window = 0
        if isinstance(allocator, SlidingSlotAllocator) and sliding_window > 0:
            assert host is None and disk is None, "the KV tiers copy one pool: no sliding pool under them"
            self.sliding, self.window = allocator, sliding_window
            if isinstance(cache, RadixCache):
                cache.sliding_held = allocator.sliding_held
        self._sliding_done: dict[int, int] = {}  # request row -> positions below it hold no sliding row

    # ---- lookup ----------------------------------------------------------------------------------------
    def match(self, req: Req, tiers: bool = False) -> int:
        """Record on `req` the longest usable cached prefix (no cache mutation); returns its length. With
        `tiers` (lpm's ordering, every round over the queue) also what the host or disk tier holds past it,
        `req.tier_match_len`, from their in-memory indexes only: no slots gathered, no file touched, and the
        disk's block names hashed once per request (`_disk_names`)."""
        key = tuple(req.cache_key(req.prefix_limit()))
        res = self.cache.match_prefix(key)
        req.match_len, req.match_node, req.match_indices = len(res.indices), res.last_node, res.indices
        self._cut_to_sliding(req)
        if tiers:
            held = req.match_len
            if self.host is not None and len(key) > held:
                held = max(held, self.host.tree.prefix_len(key))
            if self.disk is not None and len(key) // BLOCK * BLOCK > held:
                held = max(held, self.disk.cached_len(self._disk_names(req, key)))
            req.tier_match_len = held - req.match_len
        return req.match_len

    def _cut_to_sliding(self, req: Req) -> None:
        """Cut the request's match back to where every sliding layer holds its window (`sliding_usable_len`);
        `match_node` stays (`exact_node` walks up to the shorter length)."""
        if self.sliding is None or not req.match_len:
            return
        m = sliding_usable_len(self.sliding.sliding_held(req.match_indices), self.window)
        if m < req.match_len:
            req.match_len, req.match_indices = m, req.match_indices[:m]

    def _disk_names(self, req: Req, key: tuple[int, ...]) -> list[str]:
        """The disk block names of `key`, kept on the request: a waiting request's key does not change, and
        hashing a 1.5k-token key's 23 block names costs ~1 ms: too much for each queued request each round."""
        memo = req.disk_names
        if memo is None or memo[0] != key:
            req.disk_names = memo = (key, self.disk.block_names(key))
        return memo[1]

    def available(self) -> int:
        """Slots obtainable right now: free, evictable, and the unused slots of decode runs (with a sliding
        pool, the smaller of that and the same count of its rows)."""
        full = self.allocator.available() + self.cache.evictable_size() + self._run_slots
        if self.sliding is None:
            return full
        rows = self.sliding.sliding_available() + self.cache.sliding_evictable_size() + self._run_slots
        return min(full, rows)

    def _free_now(self) -> int:
        """Slots `allocator.alloc` can give without evicting."""
        if self.sliding is None:
            return self.allocator.available()
        return min(self.allocator.available(), self.sliding.sliding_available())

    def _evictable_now(self) -> int:
        if self.sliding is None:
            return self.cache.evictable_size()
        return min(self.cache.evictable_size(), self.cache.sliding_evictable_size())

    # ---- slots -------------------------------------------------------------------------------------------
    def alloc_slots(self, n: int) -> torch.Tensor | None:
        """n slots from the free list, evicting cached prefixes and then taking the decode runs back for
        them. None: not even that gives n."""
        slots = self._alloc_evicting(n)
        if slots is None and self._run_slots:
            self._drop_runs()
            slots = self.allocator.alloc(n)
        return slots

    def _alloc_evicting(self, n: int) -> torch.Tensor | None:
        slots = self.allocator.alloc(n)
        if slots is None:
            self.allocator.free(self.cache.evict(n - self.allocator.available()))
            if self.sliding is not None:  # then only the sliding K/V of cached nodes, keeping the nodes
                self.sliding.free_sliding(self.cache.evict_sliding(n - self.sliding.sliding_available()))
            slots = self.allocator.alloc(n)
        return slots

    def run_slots(self, reqs: list[Req], counts: list[int], evict: bool = True) -> torch.Tensor | None:
        """`counts[i]` slots for the next positions of `reqs[i]` (a decode or verify step), concatenated in
        request order, from each request's decode run. A short run is refilled in one piece of up to
        `DECODE_RUN` slots (no more than the request can still use) while the free list has them; when it
        does not, only the missing slots are allocated (evicting), and when even eviction cannot supply
        them every run goes back to the free list first. None: not enough KV for the step (with
        evict=False: not enough without evicting a cached prefix; nothing is taken then)."""
        runs = self._runs
        short = [max(0, c - len(runs.get(r.req_pool_idx, ()))) for r, c in zip(reqs, counts)]
        need = sum(short)
        if need:
            want = [
                max(s, min(DECODE_RUN, r.remaining_new_tokens + c)) if s else 0
                for r, s, c in zip(reqs, short, counts)
            ]
            if sum(want) > self._free_now():
                want = short
                if not evict and need > self._free_now():
                    return None
                if need > self._free_now() + self._evictable_now():
                    self._drop_runs()
                    want = list(counts)
            got = self._alloc_evicting(sum(want))
            if got is None:
                return None
            got, at = got.tolist(), 0
            for req, w in zip(reqs, want):
                if w:
                    runs.setdefault(req.req_pool_idx, []).extend(got[at : at + w])
                    at += w
            self._run_slots += at
        out: list[int] = []
        for req, c in zip(reqs, counts):
            if c:
                run = runs[req.req_pool_idx]
                out.extend(run[:c])
                del run[:c]
        self._run_slots -= len(out)
        return torch.tensor(out, dtype=torch.int64, device=self.allocator.device)

    def _drop_runs(self) -> None:
        """Give every decode run's slots back to the free list (the pool ran short)."""
        for row in list(self._runs):
            self._drop_run(row)

    def _drop_run(self, row: int) -> None:
        run = self._runs.pop(row, None)
        if run:
            self._run_slots -= len(run)
            self.allocator.free(torch.tensor(run, dtype=torch.int64))

    def start(self, req: Req, room: int | None = None) -> bool:
        """Give a request without KV its row and the cached prefix recorded by `match`. False: no free row.
        `room`: the most slots a tier load may take (the prefill adder's budget; default: all available)."""
        assert req.req_pool_idx is None
        row = self.req_pool.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        if req.match_node is not self.cache.root and req.match_node.parent is None:
            # evicted since `match` (lpm matches the whole queue first; a tier load admitted before this
            # request made room): its match is gone, find what is left
            self.match(req)
        self._cut_to_sliding(req)  # again: a sliding eviction since `match` may have cut it shorter
        req.match_node = self.cache.exact_node(req.match_node, req.match_len)
        unlocked = self.available()
        self.cache.lock(req.match_node)
        req.locked_node = req.match_node
        req.tier_unloaded_len = 0
        if room is None:
            room = self.available()
        else:  # the lock just took what it made unevictable out of the caller's budget too
            room = min(room - (unlocked - self.available()), self.available())
        req.host_loaded_len = self._load_from_host(req, room) if self.host is not None else 0
        room -= req.host_loaded_len
        req.disk_loaded_len = self._load_from_disk(req, room) if self.disk is not None else 0
        req.cache_owned_len = req.kv_len = req.match_len
        if req.match_len:
            self.req_pool.write(row, 0, req.match_indices)
        return True

    def _load_from_host(self, req: Req, room: int) -> int:
        """Extend the request's locked device match with what the host tier holds past it: fresh device
        slots, a copy, an insert into the cache, the lock moved to the longer path. Returns the tokens
        loaded (0: nothing more in the host tier, or no device slots for it now: `req.tier_unloaded_len`)."""
        key = req.cache_key(req.prefix_limit())
        d = req.match_len
        if len(key) <= d:
            return 0
        hit = self.host.match(key)
        h = hit.indices.numel()
        if h <= d:
            return 0
        if room < h - d:  # checked first: a failed alloc_slots would still evict all it could
            req.tier_unloaded_len = h - d
            return 0
        self.host.lock(hit.last_node)  # the device evictions below copy into the host: keep ours there
        try:
            slots = self.alloc_slots(h - d)
            if slots is None:  # not expected: h - d slots were available
                return 0
            self.host.load(hit.indices[d:], slots)
        finally:
            self.host.unlock(hit.last_node)
        self._adopt(req, key[:h], slots)
        return h - d

    def _load_from_disk(self, req: Req, room: int) -> int:
        """The same as `_load_from_host` for the blocks the disk tier holds past the match (a file that fails
        its checks ends the run there: what follows is recomputed). Without room for them nothing is read."""
        key = tuple(req.cache_key(req.prefix_limit()))
        d = req.match_len
        names = self._disk_names(req, key)
        self.disk.hit(names[: d // BLOCK])  # the blocks the tiers above served: they rank the disk's eviction
        n = self.disk.cached_len(names)
        if n <= d:
            return 0
        if room < n - d:  # checked before reading: a request that waits for room retries
            req.tier_unloaded_len = max(req.tier_unloaded_len, n - d)
            return 0
        got = self.disk.read(key, names, d, n)
        if got is None:
            return 0
        k, v, m = got
        slots = self.alloc_slots(m)
        if slots is None:  # not expected: m <= n - d slots were available
            return 0
        self.disk.load(k, v, slots)
        self._adopt(req, key[: d + m], slots)
        return m

    def _adopt(self, req: Req, key: list[int], slots: torch.Tensor) -> None:
        """Insert loaded KV (`slots`, for the tokens of `key` past the request's match) into the cache and
        move the request's lock onto the longer path."""
        d = req.match_len
        dup = self.cache.insert(key, torch.cat([req.match_indices, slots]))
        self.allocator.free(slots[: max(0, dup - d)])  # not expected: the device held only d tokens
        res = self.cache.match_prefix(key)
        assert res.indices.numel() == len(key), "a just-loaded prefix must match in full"
        node = self.cache.exact_node(res.last_node, len(key))
        self.cache.lock(node)
        self.cache.unlock(req.locked_node)
        req.locked_node = req.match_node = node
        req.match_len, req.match_indices = len(key), res.indices

    def append_slots(self, req: Req, slots: torch.Tensor) -> None:
        """Record slots for the request's next tokens (their KV is written by the coming forward)."""
        if self.sliding is not None:
            self._free_out_of_window([req])
        self.req_pool.write(req.req_pool_idx, req.kv_len, slots)
        req.kv_len += slots.numel()

    def append_one_slot_each(self, reqs: list[Req], slots: torch.Tensor) -> None:
        """`append_slots(reqs[i], slots[i:i + 1])` for every request (a decode step), in one table write."""
        if len(reqs) == 1:
            self.append_slots(reqs[0], slots)
            return
        if self.sliding is not None:
            self._free_out_of_window(reqs)
        self.req_pool.write_each([r.req_pool_idx for r in reqs], [r.kv_len for r in reqs], slots)
        for req in reqs:
            req.kv_len += 1

    def _free_out_of_window(self, reqs: list[Req]) -> None:
        """Before the requests compute from position `kv_len` on: free the sliding rows of their own tokens
        below `kv_len - window + 1` (no sliding layer reads them again). A decode step frees one position a
        request: gathered in one read."""
        done, table = self._sliding_done, self.req_pool.req_to_token
        rows, positions, ranges = [], [], []
        for req in reqs:
            row = req.req_pool_idx
            lo = max(done.get(row, 0), req.cache_owned_len)
            hi = req.kv_len - self.window + 1
            if hi <= lo:
                continue
            done[row] = hi
            if hi - lo == 1:
                rows.append(row)
                positions.append(lo)
            else:
                ranges.append(table[row, lo:hi])
        if rows:
            ranges.append(table[torch.tensor(rows), torch.tensor(positions)])
        if ranges:
            self.sliding.free_sliding(torch.cat(ranges) if len(ranges) > 1 else ranges[0])

    def drop_kv_from(self, req: Req, pos: int) -> None:
        """The tokens from position `pos` on are rejected (a verify) or about to be rewritten (jump-forward):
        take the request's own KV for them out of its row, back to the head of its decode run (the slots of
        the same positions next time). Where that would cut into cache-owned slots the request gives all its
        KV back (it is recomputed over the cache's prefix at the next admission). Afterwards every KV slot
        the request holds belongs to a token it keeps, so releasing or caching it later is sound."""
        if req.req_pool_idx is None or pos >= req.kv_len:
            return
        if pos < req.cache_owned_len or (
            self.sliding is not None and pos - self.window + 1 < self._sliding_done.get(req.req_pool_idx, 0)
        ):  # into the cache's prefix, or to a position whose window lost sliding rows
            self.release(req, cache_tokens=False)
            return
        dropped = self.req_pool.read(req.req_pool_idx, req.kv_len, pos).tolist()
        run = self._runs.setdefault(req.req_pool_idx, [])
        run[:0] = dropped  # they are the slots of the request's next positions again
        self._run_slots += len(dropped)
        req.kv_len = pos

    def cache_prefix(self, req: Req) -> None:
        """Publish a running request's computed tokens to the cache so later requests can share them while
        it keeps decoding; the request then holds only a lock on them, no slots of its own."""
        if not self.cache.enabled or req.kv_len <= req.cache_owned_len:
            return
        key = req.cache_key(req.kv_len)
        if self.sliding is not None and not self._cache_keeps_window(req, key):
            return  # it inserts its tokens when it leaves instead
        slots = self.req_pool.read(req.req_pool_idx, req.kv_len).clone()
        if self.disk is not None:
            self.disk.offer(key, slots)
        dup = self.cache.insert(key, slots)
        self.allocator.free(slots[req.cache_owned_len : max(dup, req.cache_owned_len)])
        res = self.cache.match_prefix(key)
        assert len(res.indices) == req.kv_len, "a just-inserted prefix must match in full"
        self.req_pool.write(req.req_pool_idx, 0, res.indices)
        node = self.cache.exact_node(res.last_node, req.kv_len)
        self.cache.lock(node)
        self.cache.unlock(req.locked_node)
        req.locked_node, req.cache_owned_len = node, req.kv_len

    def _cache_keeps_window(self, req: Req, key) -> bool:
        """Whether publishing would keep the request's window whole: where the cache already holds the
        request's tokens, the request's row takes the cache's slots (its own are freed), and those must
        still hold sliding rows for the positions the next token reads."""
        cached = self.cache.match_prefix(key).indices
        lo = max(req.cache_owned_len, req.kv_len - self.window + 1)
        return cached.numel() <= lo or bool(self.sliding.sliding_held(cached[lo:]).all())

    def release(self, req: Req, cache_tokens: bool = True) -> None:
        """Return a request's KV: its tokens go into the cache (duplicates freed), then its lock and row."""
        if req.req_pool_idx is None:
            return
        row = req.req_pool_idx
        slots = self.req_pool.read(row, req.kv_len).clone()
        if cache_tokens and req.kv_len:
            key = req.cache_key(req.kv_len)
            if self.disk is not None:
                self.disk.offer(key, slots)
            dup = self.cache.insert(key, slots)
            self.allocator.free(slots[req.cache_owned_len : max(dup, req.cache_owned_len)])
        else:
            self.allocator.free(slots[req.cache_owned_len :])
        self.cache.unlock(req.locked_node)
        self._drop_run(row)
        self._sliding_done.pop(row, None)
        self.req_pool.free(row)
        req.req_pool_idx, req.locked_node, req.kv_len, req.cache_owned_len = None, None, 0, 0

    def flush(self) -> bool:
        """Drop the whole cache; only possible while no request holds a lock."""
        if self.cache.protected_size() > 0 or (self.host is not None and self.host.tree.protected_size()):
            return False
        self.allocator.free(self.cache.reset())
        if self.allocator.available() == self.allocator.size:  # nothing held: the pool in order again
            self.allocator.clear()
        if self.host is not None:
            self.host.reset()
        return True

    def info(self) -> dict:
        """The KV pool, the radix cache and the tiers below it, for server_info."""
        cache, alloc = self.cache, self.allocator
        host = self.host.info() if self.host is not None else {"host_tier_tokens": 0}
        disk = self.disk.info() if self.disk is not None else {"disk_tier_bytes": 0}
        return {
            "max_total_tokens": alloc.size,
            "free_slots": alloc.available(),
            "cache_tokens": cache.total_size(),
            "cache_evictable_tokens": cache.evictable_size(),
            "cache_protected_tokens": cache.protected_size(),
            "request_held_tokens": alloc.size - alloc.available() - cache.total_size(),
            "decode_run_tokens": self._run_slots,
            "token_usage": 1 - (alloc.available() + cache.evictable_size()) / alloc.size,
            "radix_cache_enabled": cache.enabled,
            **self._sliding_info(),
            **host,
            **disk,
        }

    def _sliding_info(self) -> dict:
        if self.sliding is None:
            return {"sliding_pool_tokens": 0}
        rows = self.sliding.sliding
        return {
            "sliding_pool_tokens": rows.size,
            "sliding_free_rows": rows.available(),
            "sliding_window": self.window,
            "cache_sliding_tokens": self.cache.sliding_evictable_size() + self.cache.sliding_protected_size(),
        }

    def save_to_disk(self, timeout_s: float = 55.0) -> None:
        """Graceful shutdown: queue every cached prefix not on disk yet (waiting for room in the writer's
        queue, which holds far fewer blocks than a large pool), then wait for the writer."""
        if self.disk is None or not isinstance(self.cache, RadixCache):
            return
        deadline = time.monotonic() + timeout_s
        for node in [n for n in self.cache._nodes() if n.is_leaf()]:
            self.disk.offer(*self.cache.path(node), wait_s=max(0.001, deadline - time.monotonic()))
        self.disk.flush(max(0.0, deadline - time.monotonic()))

    # ---- invariants -------------------------------------------------------------------------------------
    def check_accounting(self, live: list[Req]) -> None:
        """Raise AssertionError if any slot is lost or held twice."""
        own = [
            self.req_pool.read(r.req_pool_idx, r.kv_len, r.cache_owned_len)
            for r in live
            if r.req_pool_idx is not None
        ]
        rows = {r.req_pool_idx for r in live if r.req_pool_idx is not None}
        assert set(self._runs) <= rows, f"KV accounting broken: decode runs of rows {set(self._runs) - rows}"
        assert self._run_slots == sum(map(len, self._runs.values())), "KV accounting broken: run count"
        runs = [torch.tensor(run, dtype=torch.int64) for run in self._runs.values()]
        parts = [t.cpu() for t in (self.allocator.free_slots(), self.cache.all_slots(), *own)] + runs
        held = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        size = self.allocator.size
        assert held.numel() == size, (
            f"KV accounting broken: free {self.allocator.available()} + cache {self.cache.total_size()} + "
            f"requests {sum(o.numel() for o in own)} + decode runs {self._run_slots} = {held.numel()} "
            f"!= pool size {size}"
        )
        assert torch.unique(held).numel() == size, "KV accounting broken: a slot is held twice"
        self.cache.check_integrity()
        if self.host is not None:
            self.host.check()
        if self.sliding is not None:
            assert set(self._sliding_done) <= rows, "KV accounting broken: sliding marks of rows not live"
            self.sliding.check()


def make_tiers(args, model_dir: str, runner) -> tuple[HostTier | None, DiskTier | None]:
    """The KV tiers `args` ask for under the runner's KV pool (`--kv-host-tier-gb`, `--kv-disk-dir`)."""
    pool = runner.kv_pool
    host = HostTier(pool, host_tier_tokens(args.kv_host_tier_gb, pool)) if args.kv_host_tier_gb else None
    disk = None
    if args.kv_disk_dir:
        c = runner.config
        # what makes KV differ: the weights (their folder, and a hash of their config, headers and sampled
        # values: another model written over the same path differs), quantization, the compute dtype (the
        # pool's own dtype is DiskTier's: since --kv-cache-dtype they can differ), the attention geometry
        # and RoPE (its frequencies and attention scaling, as the config resolved them)
        rope = hashlib.blake2b(c.inv_freq.float().numpy().tobytes(), digest_size=8).hexdigest()
        identity = (
            f"{os.path.realpath(model_dir)}|{weights_fingerprint(model_dir)}|{args.quantization}|{args.dtype}|"
            f"{c.architecture}|{c.num_layers}x{pool.num_kv_heads}x{pool.head_dim}|"
            f"rope={rope}x{c.rope_attention_scaling}"
        )
        disk = DiskTier(args.kv_disk_dir, int(args.kv_disk_gb * 2**30), pool, identity)
    return host, disk
