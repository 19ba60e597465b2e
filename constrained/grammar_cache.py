"""Shared grammar jobs and their results: one job per spec however many requests wait, a cache with a byte
budget, and cancellation when the last waiter leaves.

Used over a ``CompilePool`` by the scheduler's ``GrammarCompiler`` (values: CompiledGrammar) and by the HTTP
process's spec check (values: CompileResult without an Index). Each caller gets its own ``Ticket`` (a
Future): cancelling it (an abort, a client gone, a deadline) drops that waiter only; when no ticket waits on
a job any more and no worker has taken it yet, the job leaves the pool's queue.

What is cached, and for how long:

* results and deterministic failures (``GrammarError``: bad syntax, unsupported keyword, over the memory
  cap), least recently used first out once the entries' estimated sizes pass ``max_bytes``;
* ``GrammarTimeout`` only for ``timeout_ttl_s``: compile time depends on the machine's load, so a spec that
  timed out under load gets another try later; until then a resend costs nothing;
* ``GrammarUnavailable`` (queue full, crash) and anything unexpected: never.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from constrained.errors import GrammarError, GrammarTimeout, GrammarUnavailable

TIMEOUT_TTL_S = 60.0  # how long a compile timeout is remembered (a resend within it is refused at once)


class Ticket(Future):
    """One waiter's handle on a shared job. ``deadline`` (time.monotonic) is for the caller's use."""

    def __init__(self, key: Hashable):
        super().__init__()
        self.key = key
        self.deadline: float | None = None


@dataclass
class _Pending:
    job: Future | None = None
    tickets: set = field(default_factory=set)


@dataclass
class _Entry:
    value: Any  # the result, or the GrammarError to raise
    expires: float | None = None  # time.monotonic(); None: until evicted


class GrammarCache:
    """``get(key)`` -> Ticket resolved with ``finish(key, start(key).result())`` or the job's exception.

    ``start(key)``: submit the job, returning a Future; ``finish(key, raw)``: turn its result into the value
    handed out (may raise GrammarError); ``size_of(key, value)``: bytes the entry holds (recomputed on every
    store, so values whose memo grows, like CompiledGrammar's masks, are counted as they are now).
    """

    def __init__(
        self,
        start: Callable[[Hashable], Future],
        finish: Callable[[Hashable, Any], Any],
        size_of: Callable[[Hashable, Any], int],
        max_bytes: int,
        max_entries: int | None = None,
        timeout_ttl_s: float = TIMEOUT_TTL_S,
    ):
        self._start, self._finish, self._size_of = start, finish, size_of
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.timeout_ttl_s = timeout_ttl_s
        # reentrant: cancelling a job runs its done callbacks (which take it) in the cancelling thread
        self._lock = threading.RLock()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._inflight: dict[Hashable, _Pending] = {}
        self._bytes = 0
        self.hits = self.misses = self.errors = self.evictions = self.cancelled = 0

    def get(self, key: Hashable) -> Ticket:
        ticket = Ticket(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.expires is not None and entry.expires <= time.monotonic():
                self._drop(key)
                entry = None
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                _resolve(ticket, entry.value)
                return ticket
            pending = self._inflight.get(key)
            if pending is not None:
                self.hits += 1
                pending.tickets.add(ticket)
            else:
                self.misses += 1
                pending = self._inflight[key] = _Pending(tickets={ticket})
                pending.job = self._start(key)
                # may run at once (a job refused by a full queue), resolving the ticket before it is returned
                pending.job.add_done_callback(lambda job: self._done(key, pending, job))
        ticket.add_done_callback(self._on_ticket_done)
        return ticket

    def fail(self, ticket: Ticket, error: BaseException) -> None:
        """Stop waiting for ``ticket`` and fail it with ``error`` (a deadline passed, say)."""
        self._release(ticket)
        _resolve(ticket, error)

    def _on_ticket_done(self, ticket: Ticket) -> None:
        if ticket.cancelled():
            self._release(ticket)

    def _release(self, ticket: Ticket) -> None:
        """Forget one waiter; the last one gone cancels the job if no worker has taken it yet."""
        with self._lock:
            pending = self._inflight.get(ticket.key)
            if pending is None or ticket not in pending.tickets:
                return
            pending.tickets.discard(ticket)
            if not pending.tickets and pending.job is not None and pending.job.cancel():
                self.cancelled += 1  # _done ran inside cancel(): the key is no longer in flight

    def _done(self, key: Hashable, pending: _Pending, job: Future) -> None:
        if job.cancelled():
            error: BaseException = GrammarUnavailable("the grammar job was cancelled")
            value, cache = error, False
        else:
            error = job.exception()
            if error is None:
                try:
                    value = self._finish(key, job.result())
                except GrammarError as err:
                    value = err
            elif isinstance(error, (GrammarError, GrammarUnavailable)):
                value = error
            else:  # not the spec's fault and not expected: the request fails alone, nothing is cached
                value = GrammarUnavailable(f"grammar compilation failed: {type(error).__name__}: {error}")
            cache = not isinstance(value, GrammarUnavailable)
        with self._lock:
            if self._inflight.get(key) is pending:
                del self._inflight[key]
            if cache:
                self.errors += isinstance(value, GrammarError)
                ttl = self.timeout_ttl_s if isinstance(value, GrammarTimeout) else None
                self._store(key, value, time.monotonic() + ttl if ttl is not None else None)
            tickets, pending.tickets = list(pending.tickets), set()
        for ticket in tickets:
            _resolve(ticket, value)

    def _store(self, key: Hashable, value: Any, expires: float | None) -> None:
        if key in self._entries:
            self._drop(key)
        if expires is not None and expires <= time.monotonic():
            return
        self._entries[key] = _Entry(value, expires)
        # sizes are re-read on every store: a grammar's mask memo grows while it serves
        now = time.monotonic()
        self._bytes = 0
        for k, entry in list(self._entries.items()):
            if entry.expires is not None and entry.expires <= now:
                del self._entries[k]
            else:
                self._bytes += self._size_of(k, entry.value)
        while self._entries and (
            self._bytes > self.max_bytes
            or (self.max_entries is not None and len(self._entries) > self.max_entries)
        ):
            old_key, old = self._entries.popitem(last=False)
            self._bytes -= self._size_of(old_key, old.value)
            self.evictions += 1

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        self._bytes -= self._size_of(key, entry.value)

    def queued_waiters(self) -> int:
        with self._lock:
            return sum(len(p.tickets) for p in self._inflight.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        """hits (served from the cache or joined an in-flight job), misses (jobs started), errors (jobs that
        ended in GrammarError; cached too), evictions (entries dropped for the byte budget or the count),
        cancelled (jobs dropped from the queue when their last waiter left), cached / cache_bytes (entries
        and their estimated size), inflight (jobs queued or running)."""
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "errors": self.errors,
                "evictions": self.evictions,
                "cancelled": self.cancelled,
                "cached": len(self._entries),
                "cache_bytes": self._bytes,
                "cache_budget_bytes": self.max_bytes,
                "inflight": len(self._inflight),
            }


def _resolve(ticket: Future, value: Any) -> None:
    try:
        if isinstance(value, BaseException):
            ticket.set_exception(value)
        else:
            ticket.set_result(value)
    except InvalidStateError:  # cancelled meanwhile: its waiter is gone
        pass
