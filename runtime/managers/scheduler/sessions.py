"""Session pins: an agent's history stays in the radix cache while its tool runs.

When a request that names a `session_id` finishes, the path of its tokens (prompt + output) is locked in the
radix tree for `cache_ttl_s`, so LRU eviction under memory pressure cannot take exactly the history the
session's next request will reuse. A session holds one pin: its next request's pin replaces it (the new
path usually extends the old one). Pins end at their TTL, on `DELETE /v1/sessions/{id}`, or when the pinned
total would pass `--max-pinned-tokens` (the oldest goes first); the scheduler also drops the oldest pin
rather than stall when pinned memory is what keeps a request from being admitted. A released pin only
unlocks: the tokens stay in the cache as ordinary LRU entries.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from runtime.mem_cache.radix_cache import BasePrefixCache, TreeNode


@dataclass
class Pin:
    node: TreeNode  # the last node of the pinned path (locking it locks the whole path)
    tokens: int  # path length: what the pin protects at most (paths of two sessions may share tokens)
    expires_at: float  # time.monotonic()


class SessionPins:
    def __init__(self, cache: BasePrefixCache, max_pinned_tokens: int):
        self.cache = cache
        self.max_pinned_tokens = max_pinned_tokens
        self._pins: OrderedDict[str, Pin] = OrderedDict()  # oldest first
        self.pinned_tokens = 0  # sum of the pins' path lengths (an upper bound of the tokens they protect)
        self.counts = dict(pinned=0, expired=0, deleted=0, evicted_for_limit=0, evicted_for_memory=0)

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, session_id: str, key: list[int], ttl_s: float) -> None:
        """Lock the cached path of `key` (a request's cache key, just inserted) for `ttl_s` seconds."""
        self.release(session_id, reason=None)
        if ttl_s <= 0 or not self.cache.enabled or len(key) > self.max_pinned_tokens:
            return
        res = self.cache.match_prefix(key)
        if not res.indices.numel():
            return
        while self._pins and self.pinned_tokens + res.indices.numel() > self.max_pinned_tokens:
            self.release(next(iter(self._pins)), reason="evicted_for_limit")
        self.cache.lock(res.last_node)
        self._pins[session_id] = Pin(res.last_node, res.indices.numel(), time.monotonic() + ttl_s)
        self.pinned_tokens += res.indices.numel()
        self.counts["pinned"] += 1

    def release(self, session_id: str, reason: str | None = "deleted") -> int:
        """Unlock the session's pin; returns the tokens it pinned (0: it had none). `reason` names the
        counter to bump (None: replaced by the session's own newer pin)."""
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return 0
        self.cache.unlock(pin.node)
        self.pinned_tokens -= pin.tokens
        if reason:
            self.counts[reason] += 1
        return pin.tokens

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for sid in [s for s, p in self._pins.items() if p.expires_at <= now]:
            self.release(sid, reason="expired")

    def release_oldest(self) -> bool:
        """Memory is short: drop the oldest pin. False when there is none."""
        if not self._pins:
            return False
        self.release(next(iter(self._pins)), reason="evicted_for_memory")
        return True

    def release_all(self) -> None:
        for sid in list(self._pins):
            self.release(sid, reason=None)

    def info(self) -> dict:
        return {
            "sessions_pinned": len(self._pins),
            "session_pinned_tokens": self.pinned_tokens,
            "max_pinned_tokens": self.max_pinned_tokens,
            **{f"session_pins_{k}": v for k, v in self.counts.items()},
        }
