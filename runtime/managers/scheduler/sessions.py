"""Session pins: an agent's history stays in the radix cache while its tool runs.

When a request that names a `session_id` finishes, the path of its tokens (prompt + output) is locked in the
radix tree for `cache_ttl_s`, so LRU eviction under memory pressure cannot take exactly the history the
session's next request will reuse. A session holds one pin: its next request's pin replaces it (the new
path usually extends the old one). Pins end at their TTL, on `DELETE /v1/sessions/{id}`, or when the pinned
total would pass `--max-pinned-tokens` (the oldest goes first); the scheduler also drops the oldest pin
rather than stall when pinned memory is what keeps a request from being admitted. A released pin only
unlocks: the tokens stay in the cache as ordinary LRU entries. With a host tier, a pin pushed out by
--max-pinned-tokens is demoted instead: its path is copied to the host tier and locked there until its TTL
(its device copy becomes ordinary LRU); host pins are bounded by --max-pinned-tokens too (the oldest host
pin goes first), and a pin is dropped when the host tier has no room for it.

A session is its id within its tenant and cache salt (`SessionKey`). Each tenant (--api-keys-file) may hold
at most --tenant-max-pins pins and --tenant-max-pinned-tokens tokens in them (device and host together):
past the token quota its own oldest pin goes first, so one tenant cycling new session ids cannot push out
another's pins beyond its share; a request that would open a pin past the count quota is refused (429).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from runtime.mem_cache.host_tier import HostTier
from runtime.mem_cache.radix_cache import BasePrefixCache, RadixCache, TreeNode

MAX_SESSION_RECORDS = 1024  # sessions whose last request is remembered for the cache-miss explainer
# ... and their tokens in all (int32: 16 MB): a few long agent histories must not hold 1,024 x 128k tokens
MAX_SESSION_RECORD_TOKENS = 4 << 20
SNIPPET_TOKENS = 8  # tokens of context either side of a divergence in an explanation


@dataclass
class SessionRecord:
    """A session's last finished request, for explaining the next one's cache misses."""

    tokens: np.ndarray  # int32: its prompt + output
    state: str = "pinned"  # or why its pin ended: expired, deleted, evicted_for_limit, evicted_for_memory


@dataclass
class Pin:
    node: TreeNode  # the last node of the pinned path (locking it locks the whole path)
    tokens: int  # path length: what the pin protects at most (paths of two sessions may share tokens)
    expires_at: float  # time.monotonic()
    on_host: bool = False  # `node` is in the host tier's tree (demoted past --max-pinned-tokens)


SessionKey = tuple[str | None, str | None, str]  # (tenant, cache salt, session id)


class SessionPins:
    """A session is its id *within its tenant and cache salt*: a request of another tenant or salt naming
    the same id has no pin, no record and no explanation of this one, and cannot replace or release its pin.
    (Keyed by the id alone, another salt's request got the text around the divergence from the session's
    last request, and walked a victim's prompt 8 tokens at a time.)

    `tenant_max_pins` / `tenant_max_tokens` (0: none) bound what one tenant's pins hold; requests without a
    tenant are not counted against them."""

    def __init__(
        self,
        cache: BasePrefixCache,
        max_pinned_tokens: int,
        host: HostTier | None = None,
        tenant_max_pins: int = 0,
        tenant_max_tokens: int = 0,
    ):
        self.cache = cache
        self.host = host
        self.max_pinned_tokens = max_pinned_tokens
        self.tenant_max_pins, self.tenant_max_tokens = tenant_max_pins, tenant_max_tokens
        self._pins: OrderedDict[SessionKey, Pin] = OrderedDict()  # oldest first
        self.tenant_pins: Counter[str] = Counter()  # pins per tenant
        self.tenant_tokens: Counter[str] = Counter()  # their path lengths, device and host together
        self._next_expiry = float("inf")  # no pin expires before this (`expire` skips its scan until then)
        self.pinned_tokens = 0  # sum of the device pins' path lengths (an upper bound of what they protect)
        self.host_pinned_tokens = 0  # the same for pins demoted to the host tier
        self.counts = dict(
            pinned=0,
            expired=0,
            deleted=0,
            evicted_for_limit=0,
            evicted_for_memory=0,
            evicted_for_tenant_quota=0,
            demoted_to_host=0,
        )
        self._records: OrderedDict[SessionKey, SessionRecord] = OrderedDict()  # least recently finished first
        self.record_tokens = 0  # tokens held by `_records`, kept under MAX_SESSION_RECORD_TOKENS

    def __len__(self) -> int:
        return len(self._pins)

    def quota_problem(self, sid: SessionKey, prompt_len: int) -> str | None:
        """Why a request of session `sid` may not start (HTTP 429), or None: its tenant would need a pin past
        --tenant-max-pins, or its prompt alone is longer than --tenant-max-pinned-tokens."""
        tenant = sid[0]
        if tenant is None:
            return None
        if (
            self.tenant_max_pins
            and sid not in self._pins
            and self.tenant_pins[tenant] >= self.tenant_max_pins
        ):
            return (
                f"tenant quota --tenant-max-pins ({self.tenant_max_pins}) reached: end a session "
                "(DELETE /v1/sessions/{id}) or send this request without a session"
            )
        if self.tenant_max_tokens and prompt_len > self.tenant_max_tokens:
            return (
                f"tenant quota --tenant-max-pinned-tokens ({self.tenant_max_tokens}) is smaller than this "
                f"session's prompt ({prompt_len} tokens): send it without a session"
            )
        return None

    def pin(self, sid: SessionKey, key: list[int], ttl_s: float, limit: int | None = None) -> bool:
        """Lock the cached path of `key` (a request's cache key, just inserted) for `ttl_s` seconds; False
        when nothing was pinned (TTL 0, no cache, or longer than a limit). `limit`: the pinned tokens this pin
        may bring the device pins to (default --max-pinned-tokens; automatic retention's pins, which give
        way under pressure, have their own)."""
        self._release(sid, reason=None)
        tenant = sid[0]
        limit = self.max_pinned_tokens if limit is None else limit
        if ttl_s <= 0 or not self.cache.enabled or len(key) > limit:
            return False
        if tenant is not None and self.tenant_max_tokens and len(key) > self.tenant_max_tokens:
            return False
        res = self.cache.match_prefix(key)
        if not res.indices.numel():
            return False
        n = res.indices.numel()
        if tenant is not None:  # the tenant's own oldest pins make room within its quotas
            while (self.tenant_max_tokens and self.tenant_tokens[tenant] + n > self.tenant_max_tokens) or (
                self.tenant_max_pins and self.tenant_pins[tenant] >= self.tenant_max_pins
            ):
                own = next(s for s in self._pins if s[0] == tenant)
                self._release(own, reason="evicted_for_tenant_quota")
        while self.pinned_tokens + res.indices.numel() > limit:
            oldest = next((s for s, p in self._pins.items() if not p.on_host), None)
            if oldest is None:
                break
            if not self._demote(oldest):
                self._release(oldest, reason="evicted_for_limit")
        node = self.cache.exact_node(res.last_node, n)
        self.cache.lock(node)
        expires_at = time.monotonic() + ttl_s
        self._pins[sid] = Pin(node, n, expires_at)
        self._next_expiry = min(self._next_expiry, expires_at)
        self.pinned_tokens += n
        if tenant is not None:
            self.tenant_pins[tenant] += 1
            self.tenant_tokens[tenant] += n
        self.counts["pinned"] += 1
        return True

    def pin_on_host(self, sid: SessionKey, key: list[int], ttl_s: float) -> bool:
        """`pin`, then move the pin to the host tier at once (its device copy becomes ordinary LRU): automatic
        retention's choice when the device's memory is wanted now. False (nothing pinned) without a host tier
        or room there."""
        if self.host is None or not self.pin(sid, key, ttl_s):
            return False
        if self._demote(sid):
            return True
        self._release(sid, reason=None)
        return False

    def retime(self, sid: SessionKey, ttl_s: float, now: float | None = None) -> bool:
        """Let the pin of `sid` (device or host) end `ttl_s` from now instead; False when it has none."""
        pin = self._pins.get(sid)
        if pin is None:
            return False
        pin.expires_at = (time.monotonic() if now is None else now) + ttl_s
        self._next_expiry = min(self._next_expiry, pin.expires_at)
        return True

    def release(self, sid: SessionKey, reason: str | None = "deleted") -> int:
        """Unlock the pin of session `sid`; returns the tokens it pinned (0: it had none). `reason` names
        the counter to bump (None: replaced by the session's own newer pin)."""
        return self._release(sid, reason)

    def _release(self, sid: SessionKey, reason: str | None) -> int:
        pin = self._pins.pop(sid, None)
        if pin is None:
            return 0
        tenant = sid[0]
        if tenant is not None:
            self.tenant_pins[tenant] -= 1
            self.tenant_tokens[tenant] -= pin.tokens
            if not self.tenant_pins[tenant]:
                del self.tenant_pins[tenant], self.tenant_tokens[tenant]
        if pin.on_host:
            self.host.unlock(pin.node)
            self.host_pinned_tokens -= pin.tokens
        else:
            self.cache.unlock(pin.node)
            self.pinned_tokens -= pin.tokens
        if reason:
            self.counts[reason] += 1
            if sid in self._records:
                self._records[sid].state = reason
        return pin.tokens

    def _demote(self, sid: SessionKey) -> bool:
        """Move a device pin to the host tier (copy its path there, lock it there, unlock it here). False
        when there is no host tier or it has no room."""
        pin = self._pins[sid]
        if self.host is None or not isinstance(self.cache, RadixCache):
            return False
        # host pins are bounded by the same limit as device pins: the oldest of them go first
        while self.host_pinned_tokens + pin.tokens > self.max_pinned_tokens:
            oldest = next((s for s, p in self._pins.items() if p.on_host), None)
            if oldest is None:
                return False
            self._release(oldest, reason="evicted_for_limit")
        key, slots = self.cache.path(pin.node)
        key, slots = key[: pin.tokens], slots[: pin.tokens]
        self.host.save(key, slots)
        hit = self.host.match(key)
        if hit.indices.numel() < len(key):
            return False
        self.host.lock(hit.last_node)
        self.cache.unlock(pin.node)
        self.pinned_tokens -= pin.tokens
        self.host_pinned_tokens += pin.tokens
        pin.node, pin.on_host = hit.last_node, True
        self.counts["demoted_to_host"] += 1
        return True

    def expire(self, now: float | None = None) -> None:
        """Release the pins whose TTL has passed (called every step: a scan only once one is due)."""
        now = time.monotonic() if now is None else now
        if now < self._next_expiry:
            return
        for sid in [s for s, p in self._pins.items() if p.expires_at <= now]:
            self._release(sid, reason="expired")
        self._next_expiry = min((p.expires_at for p in self._pins.values()), default=float("inf"))

    def release_oldest(self) -> bool:
        """Memory is short: drop the oldest pin. False when there is none."""
        oldest = next((s for s, p in self._pins.items() if not p.on_host), None)
        if oldest is None:  # host pins hold no device memory
            return False
        self._release(oldest, reason="evicted_for_memory")
        return True

    def release_all(self) -> None:
        for sid in list(self._pins):
            self._release(sid, reason=None)

    # ---- the cache-miss explainer ------------------------------------------------------------------------
    def remember(self, sid: SessionKey, tokens: list[int], pinned: bool) -> None:
        """Record a session's finished request (prompt + output) for explaining its next one."""
        old = self._records.pop(sid, None)
        if old is not None:
            self.record_tokens -= len(old.tokens)
        state = "pinned" if pinned else "expired"  # no pin (TTL 0, or over the limit): as good as expired
        self._records[sid] = SessionRecord(np.asarray(tokens, dtype=np.int32), state)
        self.record_tokens += len(tokens)
        while len(self._records) > MAX_SESSION_RECORDS or self.record_tokens > MAX_SESSION_RECORD_TOKENS:
            self.record_tokens -= len(self._records.popitem(last=False)[1].tokens)

    def forget_records(self) -> int:
        """Drop every explainer record (the memory guard sheds them); returns how many there were. Pins
        stay: they hold KV, not this process's memory."""
        n = len(self._records)
        self._records.clear()
        self.record_tokens = 0
        return n

    @property
    def num_records(self) -> int:
        return len(self._records)

    def explain(self, sid: SessionKey, prompt: list[int], cached: int, decode) -> dict | None:
        """Why a session's request found fewer cached tokens than its previous request left behind, or where
        its prompt stopped repeating that request's tokens; None when nothing was lost. `decode`: token ids
        -> text, for the snippets around the divergence. Only the record of the request's own session (its
        tenant, salt and id) is read."""
        rec = self._records.get(sid)
        if rec is None or not prompt:
            return None
        prev = rec.tokens
        n = min(len(prev), len(prompt))
        mismatch = np.flatnonzero(prev[:n] != np.asarray(prompt[:n], dtype=np.int32))
        common = int(mismatch[0]) if mismatch.size else n
        # what the previous request could leave cached: its tokens but the last (never had KV), and never
        # the last prompt token (its logits must be computed)
        reachable = min(common, len(prev) - 1, len(prompt) - 1)
        if cached < reachable:  # a pin taken by a limit, a DELETE or a flush, then LRU: evicted
            reason = "expired" if rec.state == "expired" else "evicted"
            index = cached
        elif common < min(len(prev), len(prompt)):
            reason, index = "diverged", common
        else:
            return None
        lo, hi = max(0, index - SNIPPET_TOKENS), index + SNIPPET_TOKENS
        return {
            "reason": reason,
            "index": index,
            "expected_cached_tokens": reachable,
            "previous_text": decode(prev[lo:hi].tolist()),
            "new_text": decode(list(prompt[lo:hi])),
        }

    def info(self) -> dict:
        return {
            "sessions_pinned": len(self._pins),
            "session_pinned_tokens": self.pinned_tokens,
            "session_host_pinned_tokens": self.host_pinned_tokens,
            "max_pinned_tokens": self.max_pinned_tokens,
            "session_pin_tenants": len(self.tenant_pins),
            **{f"session_pins_{k}": v for k, v in self.counts.items()},
        }
