"""Compile grammar specs into CompiledGrammar objects, off the caller's thread, with a byte-budgeted cache.

Compile cost is outlines-core's Index construction, roughly (DFA states) x (vocabulary size): 10-50 ms for a
small regex, ~1 s for a flat JSON schema, ~5 s for ``json_object`` at vocab 49152 on one CPU core. Given
``pool_limits`` (the server's case), compiles run in memory- and time-capped worker processes
(``compile_pool``); otherwise on threads of this process (tests, in-process tools). Either way one job runs
per spec however many requests wait for it, and the cache (``grammar_cache``) stays here, so it survives
worker restarts.
"""

from __future__ import annotations

import collections
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor

from constrained.backends import (
    backend_chain,
    choose_backend,
    get_backend,
    register_text_tokenizer,
    run_chain,
)
from constrained.compile_pool import CompileResult
from constrained.grammar_cache import TIMEOUT_TTL_S, GrammarCache, Ticket
from constrained.jump_forward import plan_jump_forward
from constrained.spec import DEFAULT_WHITESPACE
from constrained.vocab import TokenVocabulary, build_vocabulary


class GrammarCompiler:
    """Compiles (kind, spec) for one tokenizer and model; results cached within ``cache_bytes`` (and at most
    ``cache_size`` entries), least recently used out first."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_workers: int = 1,
        whitespace_pattern: str = DEFAULT_WHITESPACE,
        cache_size: int | None = None,
        vocab: TokenVocabulary | None = None,
        pool_limits: dict | None = None,
        cache_bytes: int = 512 << 20,
        timeout_ttl_s: float = TIMEOUT_TTL_S,
        backend: str = "outlines",
    ):
        """``pool_limits`` (``workers``, ``memory_mb``, ``timeout_s``, ``queue_size``): compile in a
        ``CompilePool`` of worker processes with those limits; None: on ``max_workers`` threads of this
        process, without limits. ``backend``: a --grammar-backend choice (``constrained.backends``); the
        library default stays outlines-core, the server passes its --grammar-backend (default auto)."""
        self.tokenizer = tokenizer
        self.backend = backend
        self.vocab = vocab if vocab is not None else build_vocabulary(tokenizer)
        register_text_tokenizer(self.vocab, tokenizer)
        self.vocab_size = vocab_size
        self.whitespace_pattern = whitespace_pattern
        self._pool = None
        self._executor = None
        if pool_limits is not None:
            from constrained.compile_pool import CompilePool

            self._pool = CompilePool(self.vocab, whitespace_pattern, **pool_limits)
        else:
            self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self.cache = GrammarCache(
            self._submit, self._wrap, _entry_bytes, cache_bytes, cache_size, timeout_ttl_s
        )
        self._seconds = 0.0
        self._compiled = collections.Counter()  # backend name -> grammars compiled

    def compile(self, kind: str, spec: str | dict, backend: str | None = None):
        """Blocking compile (runs on the worker pool; waits for it). Raises GrammarError."""
        return self.compile_async(kind, spec, backend).result()

    def compile_async(self, kind: str, spec: str | dict, backend: str | None = None) -> Ticket:
        """This caller's future of the compiled grammar; already done on a cache hit. Concurrent calls share
        one compile; cancelling the returned future drops this caller (the last one cancels a queued compile).

        ``backend``: overrides the compiler's choice for this call. The backends tried are
        ``backend_chain``'s (raises GrammarError if none can express ``kind``); they are part of the cache
        key, and the grammar's ``.backend`` says which one compiled it.
        """
        if kind == "json_schema" and isinstance(spec, (dict, bool)):
            spec = json.dumps(spec)
        chain = ",".join(backend_chain(backend or self.backend, kind))
        return self.cache.get((kind, spec if kind != "json_object" else "", chain))

    def backend_for(self, kind: str) -> str:
        """The backend this compiler uses for ``kind``."""
        return choose_backend(self.backend, kind)

    def _submit(self, key: tuple[str, str, str]) -> Future:
        kind, spec, chain = key
        if self._pool is not None:
            return self._pool.submit(kind, spec, backend=chain)
        return self._executor.submit(self._build, kind, spec, chain)

    def _build(self, kind: str, spec: str, chain: str) -> CompileResult:
        """The in-process compile (no pool): what a worker does, on this thread."""
        started, start = time.monotonic(), time.perf_counter()
        name, text, payload = run_chain(chain, kind, spec, self.whitespace_pattern, self.vocab)
        seconds = time.perf_counter() - start
        return CompileResult(text, payload, seconds, started, 0, backend=name)

    def _wrap(self, key: tuple[str, str, str], out: CompileResult):
        self._seconds += out.seconds
        kind, spec, _ = key
        name = out.backend
        grammar = get_backend(name).load(
            kind, spec, out.regex, out.index, self.vocab, self.vocab_size, out.seconds, out.nbytes
        )
        self._compiled[name] += 1
        return grammar

    def plan_jump_forward(self, output_ids: list[int], forced: str) -> tuple[int, list[int]]:
        """``plan_jump_forward`` with this compiler's tokenizer and vocabulary."""
        return plan_jump_forward(self.tokenizer, output_ids, forced, vocab=self.vocab)

    def stats(self) -> dict[str, float | int]:
        """The cache's counters (``GrammarCache.stats``), compile_seconds (total), the pool's queued,
        running, rejected and worker_restarts, and ``compiled_<backend>``: grammars each backend compiled."""
        out: dict[str, float | int] = self.cache.stats()
        out["compile_seconds"] = round(self._seconds, 6)
        out.update({f"compiled_{name}": n for name, n in sorted(self._compiled.items())})
        pool = self._pool.stats() if self._pool is not None else {}
        out.update({k: pool.get(k, 0) for k in ("queued", "running", "rejected", "worker_restarts")})
        return out

    def worker_pids(self) -> list[int]:
        """Live compile worker processes (empty without a pool)."""
        return self._pool.worker_pids() if self._pool is not None else []

    def clear(self) -> None:
        self.cache.clear()

    def shutdown(self, wait: bool = True) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=True)
        if self._pool is not None:
            self._pool.shutdown()


def _entry_bytes(key: tuple[str, str], value) -> int:
    """Estimated bytes one cache entry holds: the spec, plus for a grammar its Index and mask memo
    (``CompiledGrammar.memory_bytes``), or for a cached error its message."""
    held = 256 + len(key[1])
    if hasattr(value, "memory_bytes"):  # a compiled grammar of any backend
        return held + value.memory_bytes()
    return held + len(str(value))
