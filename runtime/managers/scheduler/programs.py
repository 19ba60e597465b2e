"""Programs: the requests of one agent run, scheduled and retained together.

A *program* is the requests that name the same `program_id` (the DSL gives every call of one `@function`
run, forks and `run_batch` items included, its own), or else the same `session_id`, within one tenant and
cache salt. A request that names neither belongs, when the server infers programs (`--schedule-policy
program` or `--kv-retention auto`), to the program of the earlier request whose whole prompt its prompt
begins with (`Lineage`: an agent's next call resends its history, a fork's sub-agents extend their parent's);
else it starts a program of its own.

`ProgramTable` keeps, per program: its *attained service* (tokens computed for it so far: every prefill
chunk when it is admitted, every generated token when its request leaves), the requests it has live now, and
the gaps between one of its requests finishing and its next one arriving (what `retention` learns from).

Recomputation is not service. A prompt chunk is charged only past what its request already paid for (a
retracted request's re-prefill is free) and past the program's last history when the prompt begins with it
(`Program.histories`: the last finished request's prompt, and its prompt and output, as lengths and prefix
hashes, so an answer the client re-renders still credits the prompt before it); generated tokens are
charged once, as the request leaves. Charged, a program whose history was evicted during a tool pause rose a
level by recomputing it, waited behind the others, lost its history again while it waited, and rose again
(bench.agent_replay, 16 programs in a pool a third of their histories: `program` job time p50 24 s against
`lpm`'s 8 s on one trace). Only the last history is remembered: of sub-agents extending one history in
parallel, one that recomputes what another computed last is charged for it.

`--schedule-policy program` orders the waiting queue by Autellix's program-level least attained service
(PLAS, arXiv 2502.13965): a request's *level* is its program's attained service on a log scale (level 0
below QUANTUM_TOKENS, then one level per doubling, at most MAX_LEVEL), lower levels first, and within a level
`lpm`'s order (the longest prefix it will not compute, then the longest device match, then arrival). Short
programs therefore finish first, and a long program's next call queues behind them.

Starvation bound: a waiting request's level drops by one for every PROMOTE_AFTER_S it has waited, so any
request reaches level 0 within MAX_LEVEL x PROMOTE_AFTER_S (80 s); and, as under `lpm`, the oldest request
goes first once it has waited `schedule_policy.OVERDUE_AFTER_S` (120 s). No request waits longer than that
bound plus the time for the requests in front of it at level 0 to be admitted.

Memory: a program's record lives while it has live requests, and at most PROGRAM_IDLE_S after; at most
MAX_PROGRAMS records are kept (the least recently active idle ones go first), each with GAP_SAMPLES gaps.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from runtime.managers.scheduler.req import Req

QUANTUM_TOKENS = 1024  # attained service below this is level 0
MAX_LEVEL = 8  # levels past QUANTUM_TOKENS x 2**7 (131k tokens) are one level
PROMOTE_AFTER_S = 10.0  # a waiting request's level drops by one per this many seconds waited
GAP_SAMPLES = 32  # gaps kept per program (the newest)
MAX_PROGRAMS = 4096  # program records kept (idle ones beyond it go, least recently active first)
PROGRAM_IDLE_S = 3600.0  # an idle program's record is forgotten after this long
MIN_ANCHOR_TOKENS = 16  # shorter prompts are not told apart by their text: they start programs of their own
MAX_ANCHORS = 4096  # prompts remembered for inferring programs (the oldest go first)
FORK_FANOUT = 4  # requests that may continue one prompt (a call's next call and its forks' sub-agents)

ProgramKey = tuple  # (tenant, cache salt, ("program", id) | ("session", id) | ("lineage", n))


def program_key(req: Req) -> ProgramKey | None:
    """The program a request belongs to (None: it names none, none was inferred, and it is a program of
    its own)."""
    opts = req.options
    pid = getattr(opts, "program_id", None)
    if pid is not None:
        return (opts.tenant, opts.cache_salt, ("program", pid))
    if opts.session_id is not None:
        return (opts.tenant, opts.cache_salt, ("session", opts.session_id))
    if req.lineage is not None:
        return (opts.tenant, opts.cache_salt, ("lineage", req.lineage))
    return None


_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)


def prefix_hashes(ids: list[int]) -> np.ndarray:
    """h[L - 1] identifies ids[:L]: the sum of (id + 1) x B**position, modulo 2**64 (numpy's unsigned
    arithmetic wraps), so every prefix's hash is one vectorised pass."""
    powers = np.full(len(ids), _HASH_BASE, dtype=np.uint64)
    powers[0] = 1
    return np.cumsum((np.asarray(ids, dtype=np.uint64) + np.uint64(1)) * np.cumprod(powers))


def extend_hash(h: int, n: int, ids: list[int]) -> int:
    """The `prefix_hashes` value of a sequence whose first `n` tokens hash to `h`, followed by `ids`."""
    mod = 1 << 64
    base = int(_HASH_BASE)
    power = pow(base, n, mod)
    for i in ids:
        h = (h + (i + 1) * power) % mod
        power = power * base % mod
    return h


def prompt_hashes(req: Req) -> np.ndarray:
    """`prefix_hashes` of the request's prompt, computed once per request."""
    if req.prompt_hashes is None:
        req.prompt_hashes = prefix_hashes(req.prompt_ids)
    return req.prompt_hashes


@dataclass
class _Anchor:
    program: int  # the lineage number of the request whose whole prompt this is
    seen: float  # when that request arrived (time.monotonic())
    followers: int = 0  # requests that continued it so far (at most FORK_FANOUT)


class Lineage:
    """Infers the program of a request that names none, from its prompt alone: a request whose prompt
    begins with the whole prompt of an earlier one (same tenant and cache salt, at least MIN_ANCHOR_TOKENS
    tokens, seen within PROGRAM_IDLE_S) continues that request's program, the longest such prompt winning;
    else it starts a new one. An agent resends its history with every call and a sub-agent extends its
    parent's, so both join their program; two programs that share only a system prompt or a tool catalogue
    do not (neither prompt is the whole of the other). A prompt is continued by at most FORK_FANOUT requests,
    so one bare system prompt sent first (a warm-up) cannot merge every later program into one.

    Memory and time: at most MAX_ANCHORS prompts are remembered, as hashes of their whole text (the oldest go
    first); a request's arrival costs one pass over its prompt and a lookup per remembered prompt length."""

    def __init__(self, max_anchors: int = MAX_ANCHORS, idle_s: float = PROGRAM_IDLE_S):
        self.max_anchors, self.idle_s = max_anchors, idle_s
        # (tenant, salt, length, hash) -> anchor, oldest first
        self._anchors: OrderedDict[tuple, _Anchor] = OrderedDict()
        self._lengths: list[int] = []  # the remembered prompts' lengths, sorted, one entry per prompt
        self._next = 0
        self.counts = dict(lineage_continued=0, lineage_started=0)

    def __len__(self) -> int:
        return len(self._anchors)

    def assign(self, req: Req, now: float) -> int | None:
        """The lineage number of `req`'s program (None: its prompt is too short to tell)."""
        ids = req.prompt_ids
        if len(ids) < MIN_ANCHOR_TOKENS:
            return None
        self._forget(now)
        scope = (req.options.tenant, req.options.cache_salt)
        hashes = prompt_hashes(req)  # kept on the request: its program charge and finish use them again
        program = None
        end = bisect.bisect_right(self._lengths, len(ids))
        last = None
        for length in reversed(self._lengths[:end]):  # longest first
            if length == last:
                continue
            last = length
            anchor = self._anchors.get((*scope, length, int(hashes[length - 1])))
            if anchor is not None and anchor.followers < FORK_FANOUT:
                anchor.followers += 1
                program = anchor.program
                break
        if program is None:
            program, self._next = self._next, self._next + 1
            self.counts["lineage_started"] += 1
        else:
            self.counts["lineage_continued"] += 1
        key = (*scope, len(ids), int(hashes[-1]))
        if key in self._anchors:  # the same prompt again: its newest sender's program goes on from it
            self._drop(key)
        self._anchors[key] = _Anchor(program, now)
        bisect.insort(self._lengths, len(ids))
        while len(self._anchors) > self.max_anchors:
            self._drop(next(iter(self._anchors)))
        return program

    def _forget(self, now: float) -> None:
        while self._anchors:
            key, anchor = next(iter(self._anchors.items()))
            if now - anchor.seen < self.idle_s:
                break
            self._drop(key)

    def _drop(self, key: tuple) -> None:
        del self._anchors[key]
        del self._lengths[bisect.bisect_left(self._lengths, key[2])]


@dataclass
class Program:
    service: int = 0  # tokens computed for the program so far (prefill + decode), recomputation not counted
    live: set[str] = field(default_factory=set)  # rids of its requests queued or running now
    last_finish: float | None = None  # when its live set last became empty (None: never, or not idle)
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=GAP_SAMPLES))  # finish -> next arrival
    finished: int = 0  # times its live set became empty (a request that could be followed)
    followed: int = 0  # of those, the times another request of it arrived later
    touched: float = 0.0  # last arrival or finish (time.monotonic())
    # its last history as (length, `prefix_hashes` value), longest first: the last finished request's prompt
    # and output, and its prompt alone (recomputing either is not charged)
    histories: tuple[tuple[int, int], ...] = ()
    new_gap: float | None = None  # the gap its latest arrival ended (None: it arrived while another ran)
    last_rid: str | None = None  # the request whose finish last made it idle (None: never)
    # the tools its last answer called, as (tenant, name) (`retention.Retention.tool_calls`); its next
    # arrival's gap is each one's pause
    tools: tuple[tuple, ...] = ()


def level_of(service: int) -> int:
    """PLAS level of an attained service: 0 below QUANTUM_TOKENS, +1 per doubling, at most MAX_LEVEL."""
    if service < QUANTUM_TOKENS:
        return 0
    return min(MAX_LEVEL, 1 + int(math.log2(service / QUANTUM_TOKENS)))


class ProgramTable:
    def __init__(self, max_programs: int = MAX_PROGRAMS, idle_s: float = PROGRAM_IDLE_S, infer: bool = False):
        """`infer`: a request naming no program or session joins the program its prompt continues
        (`Lineage`)."""
        self.max_programs, self.idle_s = max_programs, idle_s
        self.lineage = Lineage(idle_s=idle_s) if infer else None
        self._programs: OrderedDict[ProgramKey, Program] = OrderedDict()  # least recently active first
        # program_idle: times a program's live set became empty; program_gaps: of those, the times another
        # of its requests came later (the pooled follow-up rate)
        self.counts = dict(program_requests=0, program_idle=0, program_gaps=0, programs_forgotten=0)

    def __len__(self) -> int:
        return len(self._programs)

    def get(self, key: ProgramKey | None) -> Program | None:
        return self._programs.get(key) if key is not None else None

    def arrive(self, req: Req, now: float | None = None) -> Program | None:
        """A request entered the scheduler: record the gap since its program went idle (inferring its
        program first when it names none and the table infers programs)."""
        now = time.monotonic() if now is None else now
        key = program_key(req)
        if key is None and self.lineage is not None:  # it names no program or session
            req.lineage = self.lineage.assign(req, now)
            key = program_key(req)
        if key is None:
            return None
        prog = self._programs.pop(key, None)
        if prog is None:
            prog = Program()
        prog.new_gap = None
        if not prog.live and prog.last_finish is not None:
            prog.new_gap = max(0.0, now - prog.last_finish)
            prog.gaps.append(prog.new_gap)
            prog.followed += 1
            self.counts["program_gaps"] += 1
        prog.live.add(req.rid)
        prog.last_finish, prog.touched = None, now
        self._programs[key] = prog  # most recently active last
        self.counts["program_requests"] += 1
        self._forget(now)
        return prog

    def charge(self, req: Req, start: int, end: int) -> None:
        """Prompt positions [start, end) of `req` were prefilled: its program is charged for them, less what
        the request paid for before (a retracted request's re-prefill) and what recomputes the program's
        last history. Positions past the prompt (a retracted request's earlier output) are charged as
        generated tokens when it leaves."""
        prog = self.get(program_key(req))
        end = min(end, len(req.prompt_ids))
        if prog is None or end <= start:
            return
        paid = req.charged_to
        for length, h in prog.histories:  # longest first
            if length <= paid:
                break
            if start < length <= len(req.prompt_ids) and int(prompt_hashes(req)[length - 1]) == h:
                paid = length  # it continues the program's last history: recomputing that is free
                break
        prog.service += end - start - max(0, min(end, paid) - start)
        req.charged_to = max(req.charged_to, end)

    def finish(self, req: Req, now: float | None = None) -> Program | None:
        """`req` left (finished, aborted, failed): its generated tokens are charged; when it was the program's
        last live request the program goes idle (the next arrival's gap starts now)."""
        key = program_key(req)
        prog = self.get(key)
        if prog is None or req.rid not in prog.live:
            return None
        now = time.monotonic() if now is None else now
        prog.service += len(req.output_ids)
        if req.prompt_ids:
            ph = int(prompt_hashes(req)[-1])
            prog.histories = ((len(req.all_ids), extend_hash(ph, len(req.prompt_ids), req.output_ids)),)
            prog.histories += ((len(req.prompt_ids), ph),) if req.output_ids else ()
        req.prompt_hashes = None  # 8 bytes a prompt token: not kept past the request
        prog.live.discard(req.rid)
        prog.touched = now
        if not prog.live:
            prog.last_finish, prog.last_rid = now, req.rid
            prog.finished += 1
            self.counts["program_idle"] += 1
        self._programs.move_to_end(key)
        return prog

    def service(self, req: Req) -> int:
        """Attained service of the request's program; a request of no program counts its own output (a
        retracted one has some)."""
        prog = self.get(program_key(req))
        return prog.service if prog is not None else len(req.output_ids)

    def level(self, req: Req, now: float) -> int:
        """The request's PLAS level, lowered by one per PROMOTE_AFTER_S it has waited (the starvation
        bound)."""
        aged = int(max(0.0, now - req.arrival) / PROMOTE_AFTER_S)
        return max(0, level_of(self.service(req)) - aged)

    def _forget(self, now: float) -> None:
        """Drop idle programs past PROGRAM_IDLE_S, and the least recently active idle ones past
        MAX_PROGRAMS."""
        while self._programs:
            key, prog = next(iter(self._programs.items()))
            if prog.live:  # the oldest has live requests: look no further (records stay bounded by them)
                if len(self._programs) <= self.max_programs:
                    break
                idle = next((k for k, p in self._programs.items() if not p.live), None)
                if idle is None:
                    break
                key = idle
            elif len(self._programs) <= self.max_programs and now - prog.touched < self.idle_s:
                break
            del self._programs[key]
            self.counts["programs_forgotten"] += 1

    def info(self) -> dict:
        lineage = self.lineage
        inferred = {} if lineage is None else {"lineage_prompts": len(lineage), **lineage.counts}
        return {"programs_tracked": len(self._programs), **self.counts, **inferred}
