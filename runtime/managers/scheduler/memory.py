"""The scheduler process's memory: what each structure holds, and the guard that bounds what is not KV.

The KV pool and the weights are fixed at start-up; everything else the scheduler holds grows with traffic:
the radix tree's nodes, queued requests, speculative decoding's per-request and shared indexes, the
cache-miss explainer's session records, compiled grammars. `memory_report` lists each with its entries and
estimated bytes (the per-entry sizes below were measured with tracemalloc and RSS on CPython 3.11), beside
the process's RSS and the C heap (`runtime.allocator`), for `/get_server_info`'s `memory` and /metrics.

`MemoryGuard` trims the C heap whenever RSS grew by TRIM_AFTER_BYTES since the last trim (`runtime.allocator`
says why), and gives the growth a budget (`--memory-budget-mb`): RSS past the start-up footprint plus the
budget sheds the evictable structures in order
(the shared speculative index, the grammar cache, the session records), logging each with the bytes it
held. Shedding costs only speed: drafts and compiled grammars are rebuilt, an explanation is not given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from runtime import allocator
from runtime.managers.scheduler.drafting import LOCAL_TOKEN_BYTES, SHARED_MAX_BYTES
from runtime.managers.scheduler.sessions import MAX_SESSION_RECORD_TOKENS

if TYPE_CHECKING:
    from runtime.managers.scheduler.scheduler import Scheduler

logger = logging.getLogger("radixlm.scheduler")

# Estimated bytes (tracemalloc / RSS deltas, CPython 3.11): a radix node (object, children dict, slot tensor)
# plus, per token, its key element, its int object and its int64 slot; a request (Req, SamplingParams, send
# state) plus its token lists; a request's drafting state beside its index; a session record beside its
# int32 tokens; a step-cost sample of the draft budget
RADIX_NODE_BYTES, RADIX_TOKEN_BYTES = 450, 56
REQUEST_BYTES, REQUEST_TOKEN_BYTES = 2048, 40
SPEC_STATE_BYTES = 600
SESSION_RECORD_BYTES = 200
STEP_SAMPLE_BYTES = 120
MB = 1 << 20
CHECK_EVERY_S = 1.0  # how often the guard reads RSS (one /proc read)
# RSS growth since the last trim that makes the guard trim the C heap (`allocator.trim`): a burst's freed
# buffers go back within a second of passing it (see `runtime.allocator`)
TRIM_AFTER_BYTES = 128 * MB
AUTO_SHARE, AUTO_MIN_MB = 0.10, 1024  # --memory-budget-mb 0: a tenth of the machine, at least 1 GB


def structures(s: Scheduler) -> dict[str, dict[str, int]]:
    """Each structure that holds per-request or shared state: entries, tokens where it holds tokens,
    estimated bytes, and the cap where it has one of its own."""
    cache = s.cm.cache
    live = [*s.grammar_wait, *s.live_requests()]
    out: dict[str, dict[str, int]] = {
        "radix_tree": _sized(cache.num_nodes(), cache.total_size(), RADIX_NODE_BYTES, RADIX_TOKEN_BYTES),
        "requests": _sized(len(live), sum(r.seq_len for r in live), REQUEST_BYTES, REQUEST_TOKEN_BYTES),
    }
    if s.cm.host is not None:
        host = s.cm.host
        tree = host.tree
        out["host_tier"] = {
            **_sized(tree.num_nodes(), tree.total_size(), RADIX_NODE_BYTES, RADIX_TOKEN_BYTES),
            "pool_bytes": host.pool.nbytes(),  # allocated at start-up (--kv-host-tier-gb): not shed
        }
    if s.spec is not None:
        drafting = [r.spec for r in live if r.spec is not None]
        indexed = sum(st.index.indexed for st in drafting)
        out["spec_requests"] = _sized(len(drafting), indexed, SPEC_STATE_BYTES, LOCAL_TOKEN_BYTES)
        shared = s.spec.drafter.shared
        if shared is not None:
            out["spec_shared_index"] = {
                "entries": len(shared),
                "bytes": shared.approx_bytes,
                "cap_bytes": SHARED_MAX_BYTES,
            }
        samples = len(s.spec.budget.cost.samples)
        out["spec_step_samples"] = {"entries": samples, "bytes": samples * STEP_SAMPLE_BYTES}
    sessions = s.sessions
    out["session_records"] = {
        **_sized(sessions.num_records, sessions.record_tokens, SESSION_RECORD_BYTES, 4),
        "cap_bytes": MAX_SESSION_RECORD_TOKENS * 4,
    }
    grammar = s.grammars.stats()
    if grammar:
        out["grammar_cache"] = {
            "entries": grammar.get("cached", 0),
            "bytes": grammar.get("cache_bytes", 0),
            "cap_bytes": grammar.get("cache_budget_bytes", 0),
        }
    return out


def _sized(entries: int, tokens: int, per_entry: int, per_token: int) -> dict[str, int]:
    return {"entries": entries, "tokens": tokens, "bytes": entries * per_entry + tokens * per_token}


def auto_budget_bytes(setting_mb: int) -> int | None:
    """--memory-budget-mb in bytes: None for -1 (no guard); 0 picks AUTO_SHARE of the machine's memory,
    at least AUTO_MIN_MB."""
    if setting_mb < 0:
        return None
    if setting_mb > 0:
        return setting_mb * MB
    return max(AUTO_MIN_MB * MB, int(AUTO_SHARE * allocator.total_memory_bytes()))


class MemoryGuard:
    """Keeps the scheduler's RSS within its start-up footprint plus `budget_bytes` (None: only reports).

    `start()` takes the footprint once start-up is done (model, KV pool and kernels loaded); `check(s)`,
    called every step, reads RSS at most every CHECK_EVERY_S and acts only past the budget."""

    def __init__(self, budget_bytes: int | None):
        self.budget_bytes = budget_bytes
        self.baseline_rss = allocator.rss_bytes()
        self.sheds = 0  # times the guard found the process over budget
        self.shed_counts: dict[str, int] = {}  # structure -> times it was shed
        self.trims, self.trim_seconds = 0, 0.0
        self._trimmed_rss = self.baseline_rss  # RSS after the last trim
        self._next_check = 0.0
        self._stuck = False  # over budget with nothing left to shed: said once until back within it

    def start(self) -> None:
        self.baseline_rss = self._trimmed_rss = allocator.rss_bytes()

    def trim(self) -> None:
        """Give the C heap's free pages back (idle, or grown by TRIM_AFTER_BYTES): a few ms, timed."""
        t0 = time.perf_counter()
        allocator.trim()
        self.trim_seconds += time.perf_counter() - t0
        self.trims += 1
        self._trimmed_rss = allocator.rss_bytes()

    def over_budget(self) -> int:
        """Bytes of RSS past footprint + budget (<= 0: within it)."""
        if self.budget_bytes is None:
            return 0
        return allocator.rss_bytes() - self.baseline_rss - self.budget_bytes

    def check(self, s: Scheduler, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return
        self._next_check = now + CHECK_EVERY_S
        if allocator.rss_bytes() - self._trimmed_rss > TRIM_AFTER_BYTES:
            self.trim()
        if self.over_budget() <= 0:
            self._stuck = False
            return
        self.sheds += 1
        for name, held, shed in _sheddable(s):
            over = self.over_budget()
            if over <= 0:
                return
            if not held:
                continue
            shed()
            self.trim()
            self.shed_counts[name] = self.shed_counts.get(name, 0) + 1
            logger.warning(
                "memory guard: %.0f MB over --memory-budget-mb (%.0f MB past the start-up footprint): shed "
                "%s (~%.0f MB)",
                over / MB,
                self.budget_bytes / MB,
                name,
                held / MB,
            )
        over = self.over_budget()
        if over > 0 and not self._stuck:
            self._stuck = True
            logger.warning(
                "memory guard: still %.0f MB over budget with nothing left to shed (queued requests and the "
                "radix tree's nodes are bounded by --max-queued-requests and the KV pool)",
                over / MB,
            )

    def info(self) -> dict:
        return {
            "baseline_rss_bytes": self.baseline_rss,
            "budget_bytes": self.budget_bytes,
            "guard_sheds": self.sheds,
            "shed_counts": dict(self.shed_counts),
            "heap_trims": self.trims,
            "heap_trim_seconds": round(self.trim_seconds, 4),
        }


def _sheddable(s: Scheduler) -> list[tuple[str, int, Callable[[], object]]]:
    """(name, estimated bytes held, shed) of each evictable structure, cheapest to lose first."""
    out: list[tuple[str, int, Callable[[], object]]] = []
    shared = s.spec.drafter.shared if s.spec is not None else None
    if shared is not None:
        out.append(("spec_shared_index", shared.approx_bytes, shared.clear))
    grammar = s.grammars.stats()
    if grammar:
        out.append(("grammar_cache", grammar.get("cache_bytes", 0), s.grammars.clear_cache))
    sessions = s.sessions
    held = sessions.num_records * SESSION_RECORD_BYTES + sessions.record_tokens * 4
    out.append(("session_records", held, sessions.forget_records))
    return out


def memory_report(s: Scheduler, guard: MemoryGuard) -> dict:
    """`/get_server_info`'s `memory`: RSS, the C heap, each structure, the guard's budget and sheds."""
    rss = allocator.rss_bytes()
    return {
        "rss_bytes": rss,
        "rss_mb": round(rss / MB, 1),
        "growth_bytes": rss - guard.baseline_rss,
        **guard.info(),
        "heap": allocator.heap_info(),
        "structures": structures(s),
    }
