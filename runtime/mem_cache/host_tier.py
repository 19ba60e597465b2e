"""Host tier under the radix cache: KV evicted from the device pool is kept in host memory and loaded back.

Layout: a second `KVPool` on the CPU with the device pool's shape (pinned on CUDA, so copies are
asynchronous), its own `SlotAllocator`, and its own `RadixCache` keyed by the same token keys. When the device
cache evicts a leaf (`RadixCache.on_evict`), `save` copies the leaf's whole path into the host tree (what the
host holds of it already is matched, not copied again). A prefix match that reaches further in the host tree
than in the device tree is loaded back (`CacheManager` does that at admission: device slots, `load`, insert).
The host tree keeps its own LRU: when full, `save` evicts its least recently used leaves. Host copies stay
after a load (the tier is inclusive), so a prefix evicted again costs no second copy.

Accounting (`check`): host free slots + host tree slots == host pool size, no slot held twice, and the host
tree's own integrity check; `CacheManager.check_accounting` runs it with the device check.
"""

from __future__ import annotations

import torch

from runtime.mem_cache.memory_pool import KVPool, SlotAllocator
from runtime.mem_cache.radix_cache import Key, MatchResult, RadixCache, TreeNode


def host_tier_tokens(gb: float, device_pool: KVPool) -> int:
    """Tokens of KV that `gb` GiB of host memory hold in the device pool's layout."""
    return int(gb * 2**30) // device_pool.bytes_per_token()


class HostTier:
    def __init__(self, device_pool: KVPool, size: int):
        if size < 1:
            raise ValueError(f"host tier needs at least one token of room, got {size}")
        self.device_pool = dev = device_pool
        self.pinned = dev.k[0].is_cuda  # pinned pages: device<->host copies run asynchronously
        self.pool = KVPool(size, dev.num_layers, dev.num_kv_heads, dev.head_dim, dev.dtype, "cpu")
        if self.pinned:
            self.pool.k = [t.pin_memory() for t in self.pool.k]
            self.pool.v = [t.pin_memory() for t in self.pool.v]
        self.allocator = SlotAllocator(size, "cpu")
        self.tree = RadixCache()
        self.counts = dict(host_saved_tokens=0, host_loaded_tokens=0, host_dropped_tokens=0)

    @property
    def size(self) -> int:
        return self.allocator.size

    # ---- device -> host ------------------------------------------------------------------------------
    def save(self, key: Key, device_slots: torch.Tensor) -> int:
        """Copy the KV of `key` (device slots `device_slots`) into the host tier; returns the tokens copied
        (0 when the host holds all of it already, or cannot make room for the rest)."""
        res = self.tree.match_prefix(key)
        have = res.indices.numel()
        need = len(key) - have
        if need <= 0:
            self.tree.insert(key, res.indices)  # refresh its LRU time: it was just in use on the device
            return 0
        self.tree.lock(res.last_node)  # making room must not evict the part we extend
        try:
            host = self._alloc(need)
            if host is None:
                return 0
            self._copy_out(device_slots[have:], host)
            dup = self.tree.insert(key, torch.cat([res.indices, host]))
            self.allocator.free(host[: max(0, dup - have)])  # not expected: nothing was inserted meanwhile
        finally:
            self.tree.unlock(res.last_node)
        self.counts["host_saved_tokens"] += need
        return need

    def _copy_out(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Device KV -> host pool. On CUDA every layer's rows go to pinned staging buffers without blocking,
        then one synchronize before they are scattered into the host pool."""
        src = device_slots.to(self.device_pool.k[0].device)
        pairs = [(self.pool.k, self.device_pool.k), (self.pool.v, self.device_pool.v)]
        staged = []
        for layer in range(self.pool.num_layers):
            for host_pool, dev_pool in pairs:
                rows = dev_pool[layer].index_select(0, src)
                if self.pinned:
                    buf = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                    rows = buf.copy_(rows, non_blocking=True)
                staged.append((host_pool[layer], rows))
        if self.pinned:
            torch.cuda.current_stream().synchronize()
        for dst, rows in staged:
            dst.index_copy_(0, host_slots, rows)

    def _alloc(self, n: int) -> torch.Tensor | None:
        slots = self.allocator.alloc(n)
        if slots is None and n <= self.allocator.available() + self.tree.evictable_size():
            freed = self.tree.evict(n - self.allocator.available())
            self.counts["host_dropped_tokens"] += freed.numel()
            self.allocator.free(freed)
            slots = self.allocator.alloc(n)
        return slots

    # ---- host -> device ------------------------------------------------------------------------------
    def match(self, key: Key | list[int]) -> MatchResult:
        return self.tree.match_prefix(key)

    def lock(self, node: TreeNode) -> None:
        self.tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree.unlock(node)

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy host slots' KV into device slots (issued on the current stream, before any forward that
        reads them; with pinned memory the copy is asynchronous)."""
        dev = self.device_pool.k[0].device
        dst = device_slots.to(dev)
        for layer in range(self.pool.num_layers):
            for src_pool, dst_pool in ((self.pool.k, self.device_pool.k), (self.pool.v, self.device_pool.v)):
                rows = src_pool[layer].index_select(0, host_slots)
                if self.pinned:
                    rows = rows.pin_memory()
                dst_pool[layer].index_copy_(0, dst, rows.to(dev, non_blocking=self.pinned))
        self.counts["host_loaded_tokens"] += host_slots.numel()

    # ---- sizes, reset, checks ------------------------------------------------------------------------
    def used(self) -> int:
        return self.tree.total_size()

    def reset(self) -> None:
        """Drop everything (an explicit cache flush); raises RuntimeError while a host node is locked."""
        self.allocator.free(self.tree.reset())

    def check(self) -> None:
        """Raise AssertionError if a host slot is lost or held twice, or the host tree is malformed."""
        held = torch.cat([self.allocator.free_slots(), self.tree.all_slots()])
        assert held.numel() == self.size, (
            f"host tier accounting broken: free {self.allocator.available()} + tree {self.tree.total_size()}"
            f" != host pool size {self.size}"
        )
        assert torch.unique(held).numel() == self.size, "host tier accounting broken: a slot is held twice"
        self.tree.check_integrity()

    def info(self) -> dict:
        return {
            "host_tier_tokens": self.size,
            "host_tier_used_tokens": self.used(),
            "host_tier_pinned_tokens": self.tree.protected_size(),
            **self.counts,
        }
