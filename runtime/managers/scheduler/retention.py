"""Automatic retention (`--kv-retention auto`): keep a program's KV between its calls without the client
asking, and load it back from the host or disk tier before its next call.

When a request of a program (`programs.py`) finishes and it gave no `cache_ttl_s` (an explicit TTL is the
client's and wins: `sessions.SessionPins` pins it as asked), `Retention.retain` decides, after Continuum's
cost/benefit (arXiv 2511.02230):

- **How long.** The program's own gaps between a request finishing and its next arriving (at least
  MIN_OWN_GAPS of them; else the gaps of all programs, the newest POOLED_GAPS; else FIRST_GAP_S): the TTL is
  TTL_MARGIN x their GAP_QUANTILE quantile, within [MIN_TTL_S, --max-session-ttl-s]. When the answer called
  tools (the front end parses the calls and sends their names, `ToolCallsMade`, before the answer goes
  out), the gaps that followed those tools' earlier calls, in any program of the tenant, are the basis
  instead (the slowest tool's, once it has MIN_OWN_GAPS): a program waits on a web search longer than on
  a file read, whatever it did last (Continuum's per-tool TTL). The decision is then taken again with
  them: the pin's TTL changes, or its tier when p moved across rho.
- **Whether it pays.** The expected reuse is p = P(the program sends another request) x P(it comes within the
  TTL), both counted online (the program's own finishes and follow-ups, with the pooled rate as a prior of
  weight PRIOR_WEIGHT). The memory pressure is rho = 0 while the waiting requests' tokens, the running
  requests' reservations and this path fit in (1 - HEADROOM) of the slots obtainable now; past that, rho is
  their ratio to those slots (at most 1). Holding the path costs others rho per token; keeping it saves p per
  token.
- **What is done.** p > rho and p >= MIN_REUSE: pin on the device for the TTL. Else, with a host tier and
  p >= MIN_REUSE: pin in the host tier (copied there, its device copy left to LRU), and `prefetch` loads it
  back when the pool has room. Else, with only a disk tier (`--kv-disk-dir`) and p >= MIN_REUSE: demoted
  to the disk (its full blocks were offered to the disk as the request left, like every cached prefix; the
  device copy is left to LRU), and `prefetch` reads it back. Else, with no lower tier and p >= MIN_REUSE:
  pinned on the device all the same, held against waiting requests only as long as `relieve` allows. Else
  nothing: the path is an ordinary LRU entry (which eviction still copies to the host tier).

Under pressure: automatic pins may hold up to (1 - HEADROOM) of the pool (or --max-pinned-tokens where that
is larger: the explicit pins' cap, sized for pins that never give way, would refuse most agent histories).
While no waiting request can be admitted the scheduler calls `relieve`, which releases the automatic device
pin of least expected reuse (the oldest among equals) once the waiting requests' waits, added up, are as
long as the prefill that pin is expected to save (p x its tokens / the measured prefill rate: a ski-rental
rule, at most twice the cost of the better choice in hindsight); until then the pins hold and the server
waits for their programs. Each waiting request's wait counts: four requests queued behind a pin pay its
rent four times as fast as one. LRU would release at once, and with programs whose histories together
outgrow the pool that thrashes: each call evicts the history the next call of another program needs
(bench.agent_replay with six 20-turn programs in a pool a third of their histories: 109k prefill tokens
recomputed under LRU). A decode step short of slots releases pins before it retracts anything. Programs
that never return (a flood of one-shot programs) drive p toward 0 and stop being pinned.

Prefetch (KVFlow, arXiv 2507.07400): a program whose reuse is expected (p >= MIN_REUSE) is remembered until
its next request arrives or its TTL passes. When no request waits (the program's tool runs), `prefetch` looks
at a few of them per step; one whose path the host tier, then the disk tier, holds past the device's, when
the free and evictable slots hold that part plus PREFETCH_HEADROOM of the pool, is copied back (evicting the
least recently used cache entries to the host tier if the free list is short; never a live request's memory)
and inserted into the radix cache, at most PREFETCH_TOKENS_PER_STEP per step. Each finish is prefetched at
most once, so two programs cannot evict each other back and forth. The program's next request then finds it
on the device.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.managers.scheduler.cache_manager import CacheManager
from runtime.managers.scheduler.programs import Program, ProgramKey, ProgramTable, program_key
from runtime.managers.scheduler.req import Req
from runtime.managers.scheduler.sessions import SessionPins

MIN_OWN_GAPS = 2  # a program's own gaps needed before its TTL is learned from them alone
POOLED_GAPS = 512  # the newest gaps of all programs: the prior of a program with too few of its own
FIRST_GAP_S = (
    10.0  # the TTL's basis before any gap was seen (vLLM router data: 95% of next calls within 10 s)
)
GAP_QUANTILE = 0.9
TTL_MARGIN = 1.5
MIN_TTL_S = 1.0
PRIOR_WEIGHT = 2.0  # finishes' worth of the pooled follow-up rate in a program's own rate
MIN_REUSE = 0.15  # below this expected reuse nothing is retained (a first call on a fresh server: 0.2)
HEADROOM = 0.25  # share of obtainable slots kept for arrivals before pinning counts as pressure
PREFETCH_HEADROOM = 0.25  # share of the pool left free after a prefetch
PREFETCH_TOKENS_PER_STEP = 4096
PREFETCH_CHECKS_PER_STEP = 4  # expected programs looked at per step (round robin): each is a radix match
MAX_EXPECTED = 256  # programs remembered for prefetch
MAX_EXPECTED_TOKENS = 1 << 18  # their keys' tokens together
FIRST_PREFILL_RATE = 1000.0  # tokens/s a pin's worth is counted in before an extend batch was timed
MIN_RATE_TOKENS = 64  # extend batches shorter than this are not timed (fixed costs dominate them)
TOOL_GAPS = 64  # gaps kept per tool (the newest)
MAX_TOOLS = 1024  # tools remembered, per tenant and name (the least recently called go first)
MAX_TOOL_NAME_CHARS = 128  # longer names are cut: they key a table, they are never shown
MAX_TOOLS_PER_ANSWER = 16  # parallel calls of one answer counted (the slowest decides the wait)


@dataclass(frozen=True)
class Decision:
    # "device" (pinned on the device), "host" (pinned in the host tier), "disk" (left to LRU on the device,
    # read back from the disk tier) or "lru" (not pinned, not expected back)
    action: str
    ttl_s: float
    reuse: float  # p: the expected chance the program reuses the path within ttl_s
    pressure: float  # rho at the time


@dataclass
class _Finished:
    """A retention decision the front end may still refine with the tools the answer called (its path is
    the `PathMap` entry's)."""

    program: ProgramKey
    sid: tuple
    action: str


@dataclass
class _Expected:
    """A program expected back: until when, and its path's disk block names (hashed once, when first read)."""

    until: float
    disk_names: list[str] | None = None


class PathMap:
    """Token paths by key with a value each, oldest first, at most `max_entries` entries and `max_tokens`
    tokens together: adding past either bound drops the oldest (a longer path than `max_tokens` is not
    kept)."""

    def __init__(self, max_entries: int = MAX_EXPECTED, max_tokens: int = MAX_EXPECTED_TOKENS):
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self._entries: OrderedDict[Hashable, tuple[list[int], Any]] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, k: Hashable) -> bool:
        return k in self._entries

    def put(self, k: Hashable, path: list[int], value: Any) -> None:
        self.pop(k)
        if len(path) > self.max_tokens:
            return
        self._entries[k] = (path, value)
        self.tokens += len(path)
        while len(self._entries) > self.max_entries or self.tokens > self.max_tokens:
            self.pop(next(iter(self._entries)))

    def pop(self, k: Hashable | None) -> tuple[list[int], Any] | None:
        """(path, value) of `k`, removed; None when it is not kept."""
        entry = self._entries.pop(k, None) if k is not None else None
        if entry is not None:
            self.tokens -= len(entry[0])
        return entry

    def oldest(self) -> tuple[Hashable, list[int], Any]:
        k, (path, value) = next(iter(self._entries.items()))
        return k, path, value

    def move_to_end(self, k: Hashable) -> None:
        self._entries.move_to_end(k)


def quantile(values, q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Retention:
    def __init__(
        self,
        programs: ProgramTable,
        pins: SessionPins,
        cm: CacheManager,
        max_ttl_s: float,
    ):
        self.programs, self.pins, self.cm, self.max_ttl_s = programs, pins, cm, max_ttl_s
        self.pooled: deque[float] = deque(maxlen=POOLED_GAPS)
        self._auto: OrderedDict[tuple, float] = OrderedDict()  # pins this policy took -> p, oldest first
        # programs whose path is expected back: pin sid -> (cache key, _Expected), oldest first
        self._expected = PathMap()
        # (tenant, tool name) -> the gaps that followed its calls, least recently called first
        self.tool_gaps: OrderedDict[tuple, deque[float]] = OrderedDict()
        # rid of a finished request -> (its path, its decision), until its program's next arrival
        self._finished = PathMap()
        self.prefill_rate: float | None = None  # tokens/s of extend batches (`observe_prefill`), smoothed
        self.counts = dict(
            retain_device=0,
            retain_host=0,
            retain_disk=0,
            retain_lru=0,
            retain_relieved=0,
            retain_tool_timed=0,
            prefetched_tokens=0,
            prefetches=0,
        )

    # ---- learning ---------------------------------------------------------------------------------------
    def arrived(self, req: Req, prog: Program | None) -> None:
        """A program's request arrived (after `ProgramTable.arrive`): its gap joins the pooled gaps, and it no
        longer needs a prefetch."""
        if prog is None:
            return
        if prog.new_gap is not None:
            self.pooled.append(prog.new_gap)
            for tool in prog.tools:  # the tools the last answer called: this gap was their pause
                gaps = self.tool_gaps.pop(tool, None) or deque(maxlen=TOOL_GAPS)
                gaps.append(prog.new_gap)
                self.tool_gaps[tool] = gaps  # most recently called last
            while len(self.tool_gaps) > MAX_TOOLS:
                self.tool_gaps.popitem(last=False)
        prog.tools = ()
        self._finished.pop(prog.last_rid)
        self._expected.pop(pin_sid(req))

    def gaps(self, prog: Program):
        """The gaps the program's TTL is learned from: those of the tools its last answer called (the slowest
        tool's, of those with MIN_OWN_GAPS), else its own, else the pooled ones."""
        known = [g for g in map(self.tool_gaps.get, prog.tools) if g is not None and len(g) >= MIN_OWN_GAPS]
        if known:
            return max(known, key=lambda g: quantile(g, GAP_QUANTILE))
        return prog.gaps if len(prog.gaps) >= MIN_OWN_GAPS else self.pooled

    def ttl(self, prog: Program) -> float:
        gaps = self.gaps(prog)
        basis = quantile(gaps, GAP_QUANTILE) if gaps else FIRST_GAP_S
        return min(self.max_ttl_s, max(MIN_TTL_S, TTL_MARGIN * basis))

    def reuse(self, prog: Program, ttl: float) -> float:
        counts = self.programs.counts
        pooled_rate = (counts["program_gaps"] + 1) / (counts["program_idle"] + 2)
        # prog.finished counts the finish being decided: it has not been followed yet, and may never be
        rate = (prog.followed + PRIOR_WEIGHT * pooled_rate) / (prog.finished + PRIOR_WEIGHT)
        gaps = self.gaps(prog)
        within = sum(g <= ttl for g in gaps) / len(gaps) if gaps else GAP_QUANTILE
        return rate * within

    def decide(self, prog: Program, tokens: int, demand: int, available: int) -> Decision:
        """`tokens`: the path to keep; `demand`: the slots waiting and running requests need now;
        `available`: the slots obtainable now (`CacheManager.available`)."""
        ttl = self.ttl(prog)
        p = self.reuse(prog, ttl)
        need = demand + tokens
        rho = 0.0 if need <= (1 - HEADROOM) * available else min(1.0, need / max(1, available))
        if p >= MIN_REUSE and p > rho:
            action = "device"
        elif p >= MIN_REUSE and self.pins.host is not None:
            action = "host"
        elif p >= MIN_REUSE and self.cm.disk is not None:
            action = "disk"
        elif p >= MIN_REUSE:  # no lower tier: pinned all the same, held only as long as `relieve` allows
            action = "device"
        else:
            action = "lru"
        return Decision(action, ttl, p, rho)

    # ---- acting -------------------------------------------------------------------------------------------
    def retain(self, req: Req, key: list[int], demand: int) -> Decision | None:
        """`req` (of a program, no explicit TTL) finished and its tokens `key` are cached: pin them on the
        device, in the host tier, or leave them to LRU (the module docstring). None: not a program's."""
        pkey = program_key(req)
        prog = self.programs.get(pkey)
        if prog is None or prog.live:  # a fork still runs: the program is not idle, nothing to decide yet
            return None
        sid = pin_sid(req)
        d = self._act(sid, key, self.decide(prog, len(key), demand, self.cm.available()))
        self.counts[f"retain_{d.action}"] += 1
        self._finished.put(req.rid, key, _Finished(pkey, sid, d.action))
        return d

    def tool_calls(self, rid: str, names: list[str], demand: int) -> Decision | None:
        """The answer of finished request `rid` called tools `names`: its program now waits on them, so
        its retention is decided again with their gaps (`gaps`). None when that program has moved on (its
        next request came) or `rid`'s finish was not decided here."""
        entry = self._finished.pop(rid)
        if entry is None:
            return None
        key, done = entry
        prog = self.programs.get(done.program)
        if prog is None or prog.live or prog.last_rid != rid:
            return None
        tenant, names = done.program[0], names[:MAX_TOOLS_PER_ANSWER]
        prog.tools = tuple(dict.fromkeys((tenant, n[:MAX_TOOL_NAME_CHARS]) for n in names))
        d = self.decide(prog, len(key), demand, self.cm.available())
        if d.action == done.action and d.action in ("device", "host"):  # the same tier: only the TTL moves
            self.pins.retime(done.sid, d.ttl_s)
            if done.sid in self._expected:
                self._expect(done.sid, key, time.monotonic() + d.ttl_s)
        else:
            d = self._act(done.sid, key, d)
            self.counts[f"retain_{done.action}"] -= 1
            self.counts[f"retain_{d.action}"] += 1
        self.counts["retain_tool_timed"] += 1
        return d

    def _act(self, sid: tuple, key: list[int], d: Decision) -> Decision:
        """Carry out decision `d` for pin `sid` over path `key` (its previous pin, if any, is replaced);
        returns it with the action taken (a pin that could not be taken is "lru")."""
        self.pins.release(sid, reason=None)
        self._auto.pop(sid, None)
        action = d.action
        if action == "device" and not self.pins.pin(sid, key, d.ttl_s, self.device_limit()):
            action = "lru"
        elif action == "host" and not self.pins.pin_on_host(sid, key, d.ttl_s):
            action = "lru"
        if action == "device":
            self._auto[sid] = d.reuse
        tiers = self.cm.host is not None or self.cm.disk is not None
        if d.reuse >= MIN_REUSE and tiers:  # (a device pin may be relieved and evicted)
            self._expect(sid, key, time.monotonic() + d.ttl_s)
        else:
            self._expected.pop(sid)
        return Decision(action, d.ttl_s, d.reuse, d.pressure)

    def device_limit(self) -> int:
        """The device pins' tokens an automatic pin may bring them to: (1 - HEADROOM) of the pool, or
        --max-pinned-tokens where that is larger (0 there disables every pin). An automatic pin gives way
        whenever a waiting request or a decode step needs its memory (`relieve`, `release_oldest`), so it
        is not held to the explicit pins' cap, which is sized for pins that do not."""
        cap = self.pins.max_pinned_tokens
        return 0 if cap == 0 else max(cap, int((1 - HEADROOM) * self.cm.allocator.size))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """An extend batch computed `tokens` in `seconds`: the prefill rate a pin's worth is counted in."""
        if tokens >= MIN_RATE_TOKENS and seconds > 0:
            rate = tokens / seconds
            self.prefill_rate = rate if self.prefill_rate is None else 0.8 * self.prefill_rate + 0.2 * rate

    def _device_pin(self, sid: tuple):
        """Pin `sid` while it holds device memory (None: released, expired, or moved to the host tier)."""
        pin = self.pins._pins.get(sid)
        return pin if pin is not None and not pin.on_host else None

    def worth_s(self, sid: tuple) -> float:
        """Seconds of prefill an automatic pin is expected to save: p x its tokens / the prefill rate."""
        pin = self._device_pin(sid)
        if pin is None:
            return 0.0
        return self._auto.get(sid, 0.0) * pin.tokens / (self.prefill_rate or FIRST_PREFILL_RATE)

    def relieve(self, waited_s: float = math.inf) -> bool:
        """No waiting request could be admitted, and together they have waited `waited_s` seconds (the sum
        of their waits since): release the automatic device pin of least expected reuse (the oldest among
        equals; it becomes an ordinary LRU entry) once that is as long as the prefill the pin is expected to
        save (`worth_s`). Until then the pin holds and the waiting requests wait: releasing it only moves the
        recompute to its program's next call, and under a KV pool smaller than the programs' histories that
        is thrashing (each call recomputing what the one before evicted). Paying the waits up to the pin's
        worth, then releasing (a ski-rental rule, the rent being every waiting request's delay), costs at
        most twice the better choice in hindsight. False when nothing was released."""
        while self._auto:
            sid = min(self._auto, key=self._auto.__getitem__)  # min keeps the first (oldest) of equals
            if self._device_pin(sid) is None:
                del self._auto[sid]
                continue
            if waited_s < self.worth_s(sid):
                return False
            del self._auto[sid]
            self.pins.release(sid, reason="evicted_for_memory")
            self.counts["retain_relieved"] += 1
            return True
        return False

    def holding(self) -> bool:
        """Whether an automatic device pin is held against waiting requests (`relieve` declined)."""
        return any(self._device_pin(sid) is not None for sid in self._auto)

    # ---- prefetch ------------------------------------------------------------------------------------------
    def _expect(self, sid: tuple, key: list[int], until: float) -> None:
        self._expected.put(sid, key, _Expected(until))

    def prefetch(self, now: float | None = None) -> int:
        """Load expected programs' paths from the host tier, then the disk tier, into free or LRU device
        slots; returns the tokens loaded. Call it only when no request waits. Up to PREFETCH_CHECKS_PER_STEP
        programs are looked at, round robin; a program stays expected until its next request arrives or its
        TTL passes (its path may be evicted from the device later)."""
        cm = self.cm
        if (cm.host is None and cm.disk is None) or not self._expected:
            return 0
        now = time.monotonic() if now is None else now
        budget, loaded = PREFETCH_TOKENS_PER_STEP, 0
        headroom = int(PREFETCH_HEADROOM * cm.allocator.size)
        for _ in range(min(PREFETCH_CHECKS_PER_STEP, len(self._expected))):
            sid, key, expected = self._expected.oldest()
            if expected.until <= now:
                self._expected.pop(sid)
                continue
            self._expected.move_to_end(sid)
            got = load_from_host(cm, key, budget - loaded, headroom) if cm.host is not None else 0
            if got == 0 and cm.disk is not None:  # the host holds nothing past the device: the disk may
                if expected.disk_names is None:
                    expected.disk_names = cm.disk.block_names(key)
                got = load_from_disk(cm, key, expected.disk_names, budget - loaded, headroom)
            if got is None:  # no room now: try again on a later step
                break
            if got:  # loaded once per finish: a later eviction is LRU's call, not undone again
                self._expected.pop(sid)
                loaded += got
                self.counts["prefetches"] += 1
            if loaded >= budget:
                break
        self.counts["prefetched_tokens"] += loaded
        return loaded

    def info(self) -> dict:
        return {
            **self.counts,
            "retain_auto_pins": len(self._auto),
            "retain_expected_programs": len(self._expected),
            "retain_pooled_gaps": len(self.pooled),
            "retain_tools_known": len(self.tool_gaps),
        }


def pin_sid(req: Req) -> tuple:
    """The pin an automatic retention takes for the request's program: its session's own pin (one per
    session), else one keyed by the program id (a tuple where a session id is a string: they never meet)."""
    if req.session_id is not None:
        return req.session_key
    return program_key(req)


def load_from_host(cm: CacheManager, key: list[int], budget: int, headroom: int) -> int | None:
    """Copy what the host tier holds of `key` past the device match into device slots and insert it into the
    radix cache. Returns the tokens loaded (0: nothing to load), None when the free and evictable slots lack
    them plus `headroom`, or they exceed `budget`. The slots come from the free list, then from evicting the
    least recently used cache entries (which go to the host tier); no live request's memory is touched."""
    d_res = cm.cache.match_prefix(key)
    d = d_res.indices.numel()
    hit = cm.host.match(key)
    h = hit.indices.numel()
    if h <= d:
        return 0
    need = h - d
    if need > budget:
        return None
    node = cm.cache.exact_node(d_res.last_node, d)
    cm.cache.lock(node)  # the evictions below must not take the device part we extend
    cm.host.lock(hit.last_node)  # ... nor, copying into the host, the host part we load
    try:
        if cm.allocator.available() + cm.cache.evictable_size() < need + headroom:
            return None
        slots = cm.allocator.alloc(need)
        if slots is None:
            cm.allocator.free(cm.cache.evict(need - cm.allocator.available()))
            slots = cm.allocator.alloc(need)
        if slots is None:  # not expected: the room was counted above
            return None
        cm.host.load(hit.indices[d:], slots)
        dup = cm.cache.insert(key[:h], torch.cat([d_res.indices.to(slots.device), slots]))
        cm.allocator.free(slots[: max(0, dup - d)])  # not expected: nothing was inserted meanwhile
    finally:
        cm.host.unlock(hit.last_node)
        cm.cache.unlock(node)
    return need


def load_from_disk(
    cm: CacheManager, key: list[int], names: list[str], budget: int, headroom: int
) -> int | None:
    """`load_from_host` for the disk tier: read the blocks the disk holds of `key` (block names `names`) past
    the device match into device slots and insert them into the radix cache. Returns the tokens loaded (0:
    nothing more on disk, or its first file failed its checks), None when the free and evictable slots lack
    them plus `headroom`, or they exceed `budget`. The files are read only once the room is there."""
    d_res = cm.cache.match_prefix(key)
    d = d_res.indices.numel()
    n = cm.disk.cached_len(names)
    if n <= d:
        return 0
    if n - d > budget:
        return None
    node = cm.cache.exact_node(d_res.last_node, d)
    cm.cache.lock(node)  # the evictions below must not take the device part we extend
    try:
        if cm.allocator.available() + cm.cache.evictable_size() < n - d + headroom:
            return None
        got = cm.disk.read(key, names, d, n)
        if got is None:
            return 0
        k, v, m = got
        slots = cm.allocator.alloc(m)
        if slots is None:
            cm.allocator.free(cm.cache.evict(m - cm.allocator.available()))
            slots = cm.allocator.alloc(m)
        if slots is None:  # not expected: the room was counted above
            return None
        cm.disk.load(k, v, slots)
        dup = cm.cache.insert(key[: d + m], torch.cat([d_res.indices.to(slots.device), slots]))
        cm.allocator.free(slots[: max(0, dup - d)])  # not expected: nothing was inserted meanwhile
    finally:
        cm.cache.unlock(node)
    return m
