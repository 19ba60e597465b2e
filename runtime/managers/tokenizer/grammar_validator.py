"""The HTTP process's spec check before a request is queued, as jobs of the grammar sandbox.

Some specs make automaton construction run for minutes and eat gigabytes, so the check (``validate_spec``:
size and depth limits, schema keywords, each regex's byte-level automaton) runs in the same capped worker
pool the scheduler compiles in (``constrained.compile_pool``, check-only: no vocabulary), with the server's
limits: up to --grammar-workers checks at once, --grammar-queue-size waiting, each past --grammar-timeout-s
or --grammar-memory-mb refused. Identical specs in flight share one check; verdicts are cached
(``constrained.grammar_cache``: a timeout only briefly, a queue-full or crash never).
"""

from __future__ import annotations

import asyncio

from constrained.errors import GrammarError, GrammarUnavailable
from runtime.errors import RequestError
from runtime.server_args import ServerArgs

VERDICT_CACHE_ENTRIES = 1024  # a verdict is the spec and a short message; the bytes are --grammar-cache-mb's


class GrammarValidator:
    def __init__(self, args: ServerArgs):
        self.limits = args.grammar_pool_limits
        self.backend = args.grammar_backend  # checks run on the backend the scheduler will compile with
        self.wait_s = args.grammar_wait_s
        self.cache_bytes = args.grammar_cache_mb << 20
        self._pool = None
        self._cache = None

    def _ensure(self):
        if self._cache is None:  # on first use: no worker threads for a server that never sees a grammar
            from constrained.backends import backends_used
            from constrained.compile_pool import CompilePool
            from constrained.grammar_cache import GrammarCache
            from constrained.spec import DEFAULT_WHITESPACE

            self._pool = CompilePool(
                None, DEFAULT_WHITESPACE, backends=backends_used(self.backend), **self.limits
            )
            self._cache = GrammarCache(
                lambda key: self._pool.submit(key[0], key[1], check=True, backend=key[2]),
                lambda key, result: result,
                lambda key, value: 256 + len(key[1]) + len(str(value)),
                self.cache_bytes,
                VERDICT_CACHE_ENTRIES,
            )
        return self._cache

    async def check(self, kind: str, spec: str):
        """The worker's CompileResult (index None) for a usable spec. Raises GrammarError (the spec's fault)
        or RequestError 503 (queue full, waited past --grammar-queue-timeout-s, worker crashed)."""
        from constrained.backends import backend_chain

        chain = ",".join(backend_chain(self.backend, kind))  # GrammarError: no backend expresses the kind
        ticket = self._ensure().get((kind, spec, chain))
        try:
            # a cancelled wait (timeout, client gone) cancels the ticket: a check only it waits for is dropped
            return await asyncio.wait_for(asyncio.wrap_future(ticket), self.wait_s)
        except asyncio.TimeoutError:
            raise RequestError(
                f"the {kind} was not checked within {self.wait_s:g} s (--grammar-queue-timeout-s): the "
                "grammar workers are busy; this is temporary, retry later",
                503,
            ) from None
        except GrammarUnavailable as e:
            raise RequestError(str(e), 503) from None

    async def validate(self, kind: str, spec: str) -> str | None:
        """None when the spec is usable, else the reason it is not (a 400). Raises RequestError 503 when it
        cannot be checked now."""
        try:
            await self.check(kind, spec)
        except GrammarError as e:
            return str(e)
        return None

    def stats(self) -> dict:
        if self._cache is None:
            return {}
        return {**self._cache.stats(), **self._pool.stats()}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
