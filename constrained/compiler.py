"""Compile grammar specs into CompiledGrammar objects, off the caller's thread, with an LRU cache.

Compile cost is outlines-core's Index construction, roughly (DFA states) x (vocabulary size): 10-50 ms for a
small regex, ~1 s for a flat JSON schema, ~5 s for ``json_object`` at vocab 49152 on one CPU core. The Index
build releases the GIL, so a worker thread compiles while the scheduler keeps decoding. Given a
``CompilePool`` (the server's case), compiles run in memory- and time-capped worker processes instead; the
cache stays here either way, so it survives worker restarts.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from constrained.errors import GrammarError
from constrained.grammar import CompiledGrammar, build_index
from constrained.jump_forward import plan_jump_forward
from constrained.spec import DEFAULT_WHITESPACE, validate_spec
from constrained.vocab import TokenVocabulary, build_vocabulary


class GrammarCompiler:
    """Compiles (kind, spec) for one tokenizer and model; results cached in an LRU of ``cache_size``."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_workers: int = 1,
        whitespace_pattern: str = DEFAULT_WHITESPACE,
        cache_size: int = 64,
        vocab: TokenVocabulary | None = None,
        pool_limits: dict | None = None,
    ):
        """``pool_limits`` (``workers``, ``memory_mb``, ``timeout_s``): compile in a ``CompilePool`` of worker
        processes with those limits; None: on ``max_workers`` threads of this process, without limits."""
        self.tokenizer = tokenizer
        self.vocab = vocab if vocab is not None else build_vocabulary(tokenizer)
        self.vocab_size = vocab_size
        self.whitespace_pattern = whitespace_pattern
        self.cache_size = cache_size
        self._pool = None
        self._executor = None
        if pool_limits is not None:
            from constrained.compile_pool import CompilePool

            self._pool = CompilePool(self.vocab, whitespace_pattern, **pool_limits)
        else:
            self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar | GrammarError] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future[CompiledGrammar]] = {}
        self._hits = self._misses = self._errors = 0
        self._seconds = 0.0

    def compile(self, kind: str, spec: str | dict) -> CompiledGrammar:
        """Blocking compile (runs on the worker pool; waits for it). Raises GrammarError."""
        return self.compile_async(kind, spec).result()

    def compile_async(self, kind: str, spec: str | dict) -> Future[CompiledGrammar]:
        """A future of the compiled grammar; already done on a cache hit.
        Concurrent calls share one compile.
        """
        if kind == "json_schema" and isinstance(spec, (dict, bool)):
            spec = json.dumps(spec)
        key = (kind, spec if kind != "json_object" else "")
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return _done(cached)
            inflight = self._inflight.get(key)
            if inflight is not None:
                self._hits += 1
                return inflight
            self._misses += 1
            if self._pool is not None:
                future = Future()
                self._inflight[key] = future
            else:
                future = self._executor.submit(self._compile, *key)
                self._inflight[key] = future
        if self._pool is not None:  # outside the lock: a done callback may run at once and take it
            self._pool.submit(*key).add_done_callback(lambda done: self._finish_pooled(key, done, future))
        return future

    def _finish_pooled(self, key: tuple[str, str], done: Future, future: Future[CompiledGrammar]) -> None:
        """Wrap a worker's Index (or error) as a CompiledGrammar, cache it and resolve ``future``."""
        kind, spec = key
        err = done.exception()
        if err is not None and not isinstance(err, GrammarError):
            with self._lock:  # not the spec's fault (pool shut down, worker failed to start): do not cache
                self._inflight.pop(key, None)
            # a GrammarError all the same, so the request fails alone and the scheduler keeps serving
            future.set_exception(GrammarError(f"grammar compilation failed: {err}"))
            return
        if err is None:
            out = done.result()
            result = CompiledGrammar(
                kind, spec, out.regex, out.index, self.vocab, self.vocab_size, out.seconds
            )
            seconds = out.seconds
        else:
            result, seconds = err, 0.0
        self._store(key, result, seconds)
        if isinstance(result, GrammarError):
            future.set_exception(result)
        else:
            future.set_result(result)

    def _compile(self, kind: str, spec: str) -> CompiledGrammar:
        start = time.perf_counter()
        result: CompiledGrammar | GrammarError
        try:
            regex = validate_spec(kind, spec, self.whitespace_pattern)
            try:
                index = build_index(regex, self.vocab)
            except ValueError as err:  # validate_spec passed, so this is a vocabulary problem
                raise GrammarError(f"cannot compile {kind} for this tokenizer: {err}") from None
            result = CompiledGrammar(
                kind, spec, regex, index, self.vocab, self.vocab_size, time.perf_counter() - start
            )
        except GrammarError as err:
            result = err
        self._store((kind, spec), result, time.perf_counter() - start)
        if isinstance(result, GrammarError):
            raise result
        return result

    def _store(self, key: tuple[str, str], result: CompiledGrammar | GrammarError, seconds: float) -> None:
        with self._lock:
            self._seconds += seconds
            self._errors += isinstance(result, GrammarError)
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self._inflight.pop(key, None)

    def plan_jump_forward(self, output_ids: list[int], forced: str) -> tuple[int, list[int]]:
        """``plan_jump_forward`` with this compiler's tokenizer and vocabulary."""
        return plan_jump_forward(self.tokenizer, output_ids, forced, vocab=self.vocab)

    def stats(self) -> dict[str, float | int]:
        """hits (served from the cache or joined an in-flight compile), misses (compiles started), errors
        (compiles that raised GrammarError; cached too), compile_seconds (total), cached (LRU entries)."""
        with self._lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "errors": self._errors,
                "compile_seconds": round(self._seconds, 6),
                "cached": len(self._cache),
                "worker_restarts": self._pool.restarts if self._pool is not None else 0,
            }

    def worker_pids(self) -> list[int]:
        """Live compile worker processes (empty without a pool)."""
        return self._pool.worker_pids() if self._pool is not None else []

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def shutdown(self, wait: bool = True) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=True)
        if self._pool is not None:
            self._pool.shutdown()


def _done(result: CompiledGrammar | GrammarError) -> Future[CompiledGrammar]:
    future: Future[CompiledGrammar] = Future()
    if isinstance(result, GrammarError):
        future.set_exception(result)
    else:
        future.set_result(result)
    return future
