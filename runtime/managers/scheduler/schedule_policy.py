"""Which waiting requests to prefill next: queue ordering policies and token-budget admission."""

from __future__ import annotations

import enum
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from runtime.managers.scheduler.cache_manager import CacheManager
from runtime.managers.scheduler.programs import ProgramTable
from runtime.managers.scheduler.req import Req

logger = logging.getLogger("radixlm.scheduler")

# Matching every waiting request against the tree costs O(total prompt tokens); past this queue length
# `lpm` falls back to arrival order, as prefix locality matters less than keeping the scheduler cheap.
LPM_MAX_QUEUE = 128
# `lpm` puts requests with long cached prefixes first, so a request whose prefix is not cached (evicted while
# its agent waited on a tool) could be passed over for as long as others keep hitting the cache
# (agent_swarm's LRU side on a loaded machine: 7 agents timed out at 600 s). So the oldest request that has
# waited longer than this goes first, one per scheduling round. It bounds starvation; it is no fairness rule:
# at 30 s every round of an overloaded swarm admitted an evicted agent's full recompute first, which evicted
# the next ones, and the sessions side recomputed 3.4x as much (186k tokens against 54k without the rule).
OVERDUE_AFTER_S = 120.0
# lpm ranks a request by the tokens it will not compute: its device match plus what the host or disk tier
# holds past it (a load, no prefill). Ranked by the device match alone, an agent resuming after a tool pause
# with its history on the host (a load plus ~65 new tokens) sorted like a cold request and waited behind
# other agents' full recomputes and cold 1.5k-token prompts (agent_swarm's tier sides: later-step p99 0.56x
# and 0.58x LRU's).


def order_waiting(
    policy: str,
    waiting: list[Req],
    cm: CacheManager,
    rng: random.Random | None = None,
    programs: ProgramTable | None = None,
) -> tuple[list[Req], bool]:
    """`waiting` in the order to try admission, and whether every request's match_* fields were just
    filled. Only the orders that need the matches (`lpm`, `dfs-weight`) match the whole queue; for the
    others `PrefillAdder.add_waiting` matches just the requests it is offered. `lpm` ranks by the prefix
    the request will not compute, on the device or in a lower tier (a tie goes to the longer device match,
    which needs no load); the oldest request goes first once it has waited OVERDUE_AFTER_S, so none starves
    behind cache hits. `program` (`programs` holds the programs' attained service) orders by PLAS level,
    then as `lpm` within a level, with the same starvation bound (`programs.py`). Requests of a lower
    `priority` come before the others (the policy's order within a priority; the starvation bound holds
    across priorities)."""
    if not any(r.priority for r in waiting):
        return _order(policy, waiting, cm, rng, programs)
    by_priority: dict[int, list[Req]] = defaultdict(list)
    for r in waiting:
        by_priority[r.priority].append(r)
    ordered, matched = [], True
    for p in sorted(by_priority):
        part, part_matched = _order(policy, by_priority[p], cm, rng, programs)
        ordered += part
        matched &= part_matched
    if policy in ("lpm", "program"):
        _overdue_first(ordered)
    return ordered, matched


def _order(
    policy: str,
    waiting: list[Req],
    cm: CacheManager,
    rng: random.Random | None,
    programs: ProgramTable | None = None,
) -> tuple[list[Req], bool]:
    if policy == "program":
        return _program_order(waiting, cm, programs or ProgramTable())
    if policy == "lpm" and len(waiting) > LPM_MAX_QUEUE:
        policy = "fcfs"
    if policy in ("lpm", "dfs-weight"):
        tiers = policy == "lpm"
        for req in waiting:
            cm.match(req, tiers)
    if policy == "lpm":
        ordered = sorted(waiting, key=lambda r: (-(r.match_len + r.tier_match_len), -r.match_len, r.arrival))
        _overdue_first(ordered)
        return ordered, True
    if policy == "dfs-weight":
        return _dfs_weight_order(waiting, cm), True
    if policy == "fcfs":
        return sorted(waiting, key=lambda r: r.arrival), False
    if policy == "random":
        out = list(waiting)
        (rng or random).shuffle(out)
        return out, False
    raise ValueError(f"unknown schedule policy {policy!r}")


def _program_order(waiting: list[Req], cm: CacheManager, programs: ProgramTable) -> tuple[list[Req], bool]:
    """PLAS: the lowest level (least attained service of the request's program, aged by its wait) first;
    within a level `lpm`'s order (arrival order past LPM_MAX_QUEUE, with no matching); the overdue request
    first."""
    now = time.monotonic()
    level = {id(r): programs.level(r, now) for r in waiting}
    if len(waiting) > LPM_MAX_QUEUE:
        ordered = sorted(waiting, key=lambda r: (level[id(r)], r.arrival))
        _overdue_first(ordered)
        return ordered, False
    for req in waiting:
        cm.match(req, True)
    ordered = sorted(
        waiting,
        key=lambda r: (level[id(r)], -(r.match_len + r.tier_match_len), -r.match_len, r.arrival),
    )
    _overdue_first(ordered)
    return ordered, True


def _overdue_first(ordered: list[Req]) -> None:
    """Move the oldest request to the front when it has waited past the starvation bound."""
    oldest = min(range(len(ordered)), key=lambda i: ordered[i].arrival, default=None)
    if oldest is not None and _overdue(ordered[oldest]):
        ordered.insert(0, ordered.pop(oldest))


def _overdue(req: Req) -> bool:
    """Waited past the starvation bound: `lpm` puts it first, and a tier waiter goes right after it."""
    return time.monotonic() - req.arrival > OVERDUE_AFTER_S


def _dfs_weight_order(waiting: list[Req], cm: CacheManager) -> list[Req]:
    """Depth-first over the radix tree, heavier subtrees (more waiting requests below) first, so requests
    sharing a prefix run back to back while that prefix is hot."""
    at_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for req in sorted(waiting, key=lambda r: r.arrival):
        node = req.match_node
        at_node[id(node)].append(req)
        while node is not None:
            weight[id(node)] += 1
            node = node.parent
    out: list[Req] = []
    stack = [cm.cache.root]
    while stack:
        node = stack.pop()
        out.extend(at_node.get(id(node), []))
        kids = [c for c in node.children.values() if weight.get(id(c))]
        stack.extend(sorted(kids, key=lambda c: weight[id(c)]))  # heaviest popped first
    return out


class AddResult(enum.Enum):
    CONTINUE = "continue"
    NO_TOKEN = "no_token"  # KV budget exhausted
    FULL = "full"  # prefill budget or running-request limit reached


@dataclass(frozen=True)
class AddOutcome:
    result: AddResult  # whether the caller should offer the next request
    tokens: int  # tokens of this request admitted into the batch now (0: not admitted; < extend_len: chunked)


class PrefillAdder:
    """Admits requests into one extend batch under three budgets.

    - KV: free + evictable slots, minus a reservation of `new_token_ratio` x the remaining max_new_tokens
      of every running request (they will need those slots to decode).
    - Prefill tokens per batch (`max_prefill_tokens`): the first request may exceed it so nothing starves.
    - Chunking: a prompt longer than the remaining chunk budget is cut; its rest runs in later batches.
    """

    def __init__(
        self,
        cm: CacheManager,
        running: list[Req],
        *,
        max_prefill_tokens: int,
        chunk_size: int,
        new_token_ratio: float,
        max_running: int,
    ):
        self.cm = cm
        self.ratio = new_token_ratio
        self.reserved = sum(self._reserve(r) for r in running)
        self.rem_total = cm.available() - self.reserved
        self.rem_prefill = max_prefill_tokens
        self.rem_chunk = chunk_size if chunk_size > 0 else None
        self.rem_requests = max_running - len(running)
        self.num_running = len(running)
        self.admitted: list[tuple[Req, int]] = []  # (request, tokens to extend now)

    def _reserve(self, req: Req) -> int:
        return int(req.remaining_new_tokens * self.ratio)

    def add(self, req: Req, extend_len: int) -> AddOutcome:
        """`extend_len`: tokens this request still has to prefill (after its cached prefix); past the chunk
        budget it is cut, and the rest runs in later batches."""
        if self.rem_requests <= 0:
            return AddOutcome(AddResult.FULL, 0)
        take = extend_len
        if self.rem_chunk is not None:
            take = min(take, self.rem_chunk)
        if self.admitted and take > self.rem_prefill:
            return AddOutcome(AddResult.FULL, 0)
        if take <= 0:
            return AddOutcome(AddResult.FULL, 0)
        need = take + (self._reserve(req) if take == extend_len else 0)
        if need > self.rem_total:
            if self.admitted or take > self.rem_total:
                return AddOutcome(AddResult.NO_TOKEN, 0)
        self.admitted.append((req, take))
        self.rem_total -= need
        self.rem_prefill -= take
        if self.rem_chunk is not None:
            self.rem_chunk -= take
        if take == extend_len:
            self.rem_requests -= 1
        return AddOutcome(AddResult.CONTINUE if take == extend_len else AddResult.FULL, take)

    def add_waiting(self, req: Req, matched: bool) -> AddOutcome | None:
        """Offer a request without KV: match its cached prefix (unless `order_waiting` just did), lock it and
        take a request row (`CacheManager.start`), then `add` it; the KV budget then sees the lock (a locked
        prefix is no longer evictable), so the slots of everything admitted can always be allocated.
        Not admitted: the lock and the row are given back. None: no free request row.

        A host or disk tier that holds the prefix past the device match when the pool has no room to load it
        (`tier_unloaded_len`) makes the request wait (NO_TOKEN, which ends the round, so the room that comes
        free is its own; `admit` keeps it first until it starts: `tier_waiting`) while something else holds
        device memory that will come free: running or just admitted requests, or locked cache paths (session
        pins, which the scheduler releases when nothing runs). Admitted now, a chunk would start recomputing
        what the tier holds. With none of those no room would come: it is admitted and recomputes that
        part."""
        if not matched:
            self.cm.match(req)
        room_may_come = bool(self.admitted or self.num_running or self.cm.cache.protected_size())
        before = self.cm.available()
        # a tier load may take the room left in this batch (the first request may overdraw the running
        # requests' reservation, as in `add`), never the slots counted for requests admitted before it
        room = self.rem_total + (0 if self.admitted else self.reserved)
        if not self.cm.start(req, room):
            return None
        if req.tier_unloaded_len and room_may_come:
            self.cm.release(req, cache_tokens=False)
            req.tier_waiting = True
            return AddOutcome(AddResult.NO_TOKEN, 0)
        self.rem_total -= before - self.cm.available()
        out = self.add(req, req.seq_len - req.match_len)
        if not out.tokens:
            held = self.cm.available()
            self.cm.release(req, cache_tokens=False)
            self.rem_total += self.cm.available() - held  # its lock (and what it loaded) is evictable again
        else:
            req.tier_waiting = False
        return out


def admit(
    cm: CacheManager,
    running: list[Req],
    held: list[Req],
    waiting: list[Req],
    args,
    rng: random.Random,
    offer: Callable[[PrefillAdder, Req, bool], AddOutcome | None],
    programs: ProgramTable | None = None,
) -> tuple[list[tuple[Req, int]], list[Req]]:
    """One extend batch: (admitted (request, tokens to compute now) with their KV slots appended, the
    waiting requests among them that started). `held` (requests holding KV: chunked prefill, jump-forward)
    go first, then `waiting` in `args.schedule_policy` order, under the budgets of `PrefillAdder`.
    `offer(adder, req, matched)` offers a waiting request: `adder.add_waiting` inside the scheduler's failure
    boundary (a request that failed there comes back as CONTINUE with no tokens: skipped).

    A request that waited for room to load its tier prefix (`Req.tier_waiting`) is offered first (after an
    overdue request) until it starts, and its refusal ends the round: all room that comes free is its own,
    and a longer resume arriving meanwhile cannot take it. Letting the requests behind it that fit go
    instead (with the waiter banking the room that comes free) measured a worse later-step p99 in a scaled
    replay of agent_swarm (scale 4, nine seeds: mean 8.6 s against 7.2 s; max 20 s against 14 s)."""
    adder = PrefillAdder(
        cm,
        running,
        max_prefill_tokens=args.max_prefill_tokens,
        chunk_size=args.chunked_prefill_size,
        new_token_ratio=args.new_token_ratio,
        max_running=args.max_running_requests,
    )
    held_admitted = 0
    for req in held:
        out = adder.add(req, req.seq_len - req.kv_len)
        held_admitted += out.tokens > 0
        if out.result is not AddResult.CONTINUE:
            break
    started: list[Req] = []
    if held_admitted == len(held):
        ordered, matched = order_waiting(args.schedule_policy, waiting, cm, rng, programs)
        first = min((r for r in ordered if r.tier_waiting), key=lambda r: r.arrival, default=None)
        if first is not None and first is not ordered[0]:
            at = 1 if _overdue(ordered[0]) else 0
            ordered = [r for r in ordered if r is not first]
            ordered.insert(at, first)
        for req in ordered:
            out = offer(adder, req, matched)
            if out is None:  # no free request row
                break
            if out.tokens:
                started.append(req)
            if out.result is not AddResult.CONTINUE:
                break
    admitted: list[tuple[Req, int]] = []
    for req, take in adder.admitted:
        slots = cm.alloc_slots(take)
        if slots is None:  # not expected (the adder counted every lock it took): wait for the next step
            logger.warning("no KV slots for %d admitted tokens of %s; it waits", take, req.rid[:256])
            if req in started:
                cm.release(req, cache_tokens=False)
                started.remove(req)
            continue
        cm.append_slots(req, slots)
        admitted.append((req, take))
    return admitted, started
