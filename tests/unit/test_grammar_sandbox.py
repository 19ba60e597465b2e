"""The grammar sandbox under load: a bounded queue (503, not an unbounded backlog), cancellation of queued
jobs, only deterministic failures cached, a byte-budgeted LRU, a depth limit on schemas, and spec checks that
run side by side instead of behind one lock.

Pools run over a 256-byte vocabulary where no tokenizer is needed; ``[ -~]{0,N}`` takes ~1 s per few
thousand N there (the job that keeps a worker busy).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from types import SimpleNamespace

import outlines_core
import pytest

from constrained.compile_pool import CompilePool
from constrained.errors import GrammarError, GrammarTimeout, GrammarUnavailable
from constrained.grammar_cache import GrammarCache
from constrained.spec import MAX_SCHEMA_DEPTH, validate_spec
from runtime.errors import RequestError
from runtime.managers.tokenizer.grammar_validator import GrammarValidator
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs

SLOW = "[ -~]{{0,{}}}"  # a byte-level automaton that takes a while: format with a length


def _pool(**limits) -> CompilePool:
    vocab = SimpleNamespace(outlines=outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)}))
    return CompilePool(vocab, "", **{"memory_mb": 512, "timeout_s": 60, **limits})


def _wait(cond, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.02)


def _busy(pool: CompilePool, n: int = 6000) -> Future:
    """A job that keeps the pool's only worker busy; returns once a worker has taken it."""
    future = pool.submit("regex", SLOW.format(n))
    _wait(lambda: pool.stats()["running"] == 1 and pool.queued() == 0)
    return future


def _deep_schema(levels: int) -> str:
    text = '{"type": "string"}'
    for _ in range(levels):
        text = '{"type": "object", "properties": {"a": ' + text + "}}"
    return text


def test_a_full_queue_fails_at_once_with_a_transient_error_naming_the_option():
    pool = _pool(workers=1, queue_size=1)
    try:
        pool.submit("regex", "a").result(timeout=60)  # worker started
        busy = _busy(pool)
        queued = pool.submit("regex", "[0-9]+")
        refused = pool.submit("regex", "[a-z]+")
        assert refused.done()
        with pytest.raises(GrammarUnavailable, match="--grammar-queue-size"):
            refused.result()
        assert pool.stats()["rejected"] == 1
        assert queued.result(timeout=120).index is not None and busy.result(timeout=120)
    finally:
        pool.shutdown()


def test_a_cancelled_job_leaves_the_queue_before_any_worker_runs_it():
    pool = _pool(workers=1, queue_size=4)
    try:
        pool.submit("regex", "a").result(timeout=60)
        busy = _busy(pool)
        queued = pool.submit("regex", "[0-9]+")
        assert pool.queued() == 1
        assert queued.cancel()
        assert pool.queued() == 0  # at once, not when a worker gets to it
        busy.result(timeout=120)
        assert pool.stats()["running"] == 0
    finally:
        pool.shutdown()


def test_the_job_is_cancelled_only_when_its_last_waiter_leaves():
    pool = _pool(workers=1, queue_size=4)
    cache = GrammarCache(lambda key: pool.submit(*key), lambda key, r: r, lambda k, v: 1, 1 << 20)
    try:
        pool.submit("regex", "a").result(timeout=60)
        busy = _busy(pool)
        first, second = cache.get(("regex", "[0-9]+")), cache.get(("regex", "[0-9]+"))
        assert cache.stats()["misses"] == 1 and pool.queued() == 1
        first.cancel()
        assert pool.queued() == 1 and cache.stats()["cancelled"] == 0  # `second` still waits
        cache.fail(second, GrammarUnavailable("deadline"))  # a deadline, as the scheduler applies it
        assert pool.queued() == 0 and cache.stats()["cancelled"] == 1 and cache.stats()["inflight"] == 0
        with pytest.raises(GrammarUnavailable, match="deadline"):
            second.result()
        busy.result(timeout=120)
        again = cache.get(("regex", "[0-9]+"))  # nothing was cached: a new compile
        assert again.result(timeout=60).index is not None and cache.stats()["misses"] == 2
    finally:
        pool.shutdown()


def test_a_timeout_is_cached_only_for_its_ttl_but_a_bad_spec_for_good():
    pool = _pool(workers=1, queue_size=4, timeout_s=0.5)
    pool.submit("regex", "a").result(timeout=60)  # start-up is not compile time

    def cache_with(ttl: float) -> GrammarCache:
        return GrammarCache(
            lambda key: pool.submit(*key), lambda key, r: r, lambda k, v: 1, 1 << 20, timeout_ttl_s=ttl
        )

    try:
        remembered = cache_with(3600.0)
        for _ in range(2):
            with pytest.raises(GrammarTimeout, match="--grammar-timeout-s"):
                remembered.get(("regex", SLOW.format(20000))).result(timeout=120)
        assert remembered.stats()["misses"] == 1  # within its TTL a resend costs nothing

        forgotten = cache_with(0.0)
        for _ in range(2):
            with pytest.raises(GrammarTimeout):
                forgotten.get(("regex", SLOW.format(20001))).result(timeout=120)
        assert forgotten.stats()["misses"] == 2  # load-dependent: tried again once the TTL is over

        for _ in range(2):  # deterministic: cached even with a zero TTL for timeouts
            with pytest.raises(GrammarError, match="regex"):
                forgotten.get(("regex", "(unclosed")).result(timeout=60)
        assert forgotten.stats()["misses"] == 3 and forgotten.stats()["errors"] >= 2
    finally:
        pool.shutdown()


def test_a_transient_failure_is_never_cached():
    calls = []

    def start(key) -> Future:
        calls.append(key)
        future: Future = Future()
        future.set_exception(GrammarUnavailable("queue full") if len(calls) == 1 else RuntimeError("spawn"))
        return future

    cache = GrammarCache(start, lambda key, r: r, lambda k, v: 1, 1 << 20)
    for _ in range(2):
        with pytest.raises(GrammarUnavailable):
            cache.get(("regex", "a")).result()
    assert len(calls) == 2 and cache.stats()["cached"] == 0


def test_the_byte_budget_evicts_the_least_recently_used_entry():
    def start(key) -> Future:
        future: Future = Future()
        future.set_result("x" * key[1])
        return future

    cache = GrammarCache(start, lambda key, r: r, lambda k, v: len(v), max_bytes=250)
    cache.get(("a", 100)).result()
    cache.get(("b", 100)).result()
    cache.get(("a", 100)).result()  # a hit: `a` is now the most recently used
    assert cache.stats()["cache_bytes"] == 200 and cache.stats()["evictions"] == 0
    cache.get(("c", 100)).result()  # 300 > 250: the least recently used (`b`) goes
    s = cache.stats()
    assert s["evictions"] == 1 and s["cached"] == 2 and s["cache_bytes"] == 200
    misses = s["misses"]
    cache.get(("a", 100)).result()
    assert cache.stats()["misses"] == misses  # kept
    cache.get(("b", 100)).result()
    assert cache.stats()["misses"] == misses + 1  # evicted, compiled again


def test_a_compiled_grammar_counts_its_index_against_the_budget(default_tokenizer):
    from constrained import GrammarCompiler

    probe = GrammarCompiler(default_tokenizer, 49152, cache_bytes=1 << 40)
    one = probe.compile("regex", "[a-z]{1,20}")
    size = probe.stats()["cache_bytes"]
    assert one.index_bytes > 0 and size >= one.index_bytes
    probe.shutdown()
    small = GrammarCompiler(default_tokenizer, 49152, vocab=probe.vocab, cache_bytes=int(size * 1.5))
    small.compile("regex", "[a-z]{1,20}")
    small.compile("regex", "[a-y]{1,20}")  # about as big: both do not fit
    s = small.stats()
    assert s["evictions"] == 1 and s["cached"] == 1 and s["cache_bytes"] <= int(size * 1.5)
    small.shutdown()


def _deep_items(levels: int) -> str:
    """An array schema nested ``levels`` deep: ``levels + 1`` JSON objects, 10 characters per level."""
    return '{"items":' * levels + '{"type":"integer"}' + "}" * levels


@pytest.mark.parametrize("levels", [MAX_SCHEMA_DEPTH, 400, 5000])
def test_a_deeply_nested_schema_is_a_grammar_error_naming_the_depth_limit(levels):
    with pytest.raises(GrammarError, match=f"nested too deeply.*limit of {MAX_SCHEMA_DEPTH} levels"):
        validate_spec("json_schema", _deep_items(levels))
    SamplingParams(json_schema=_deep_items(levels)).verify()  # the HTTP-side parse does not blow up either


def test_a_schema_as_deep_as_real_ones_still_compiles():
    assert validate_spec("json_schema", _deep_schema(20))  # jsonschemabench's deepest: 21 JSON levels
    # the limit exactly: two JSON objects per level, plus the leaf (nested arrays would not do: each level
    # doubles their regex)
    assert validate_spec("json_schema", _deep_schema((MAX_SCHEMA_DEPTH - 1) // 2))


def _warm(validator: GrammarValidator, workers: int) -> CompilePool:
    """Start every worker of the validator's pool (start-up is not what these tests time)."""
    validator._ensure()
    pool = validator._pool
    for i in range(20):
        jobs = [pool.submit("regex", SLOW.format(500 + 10 * i + j), check=True) for j in range(workers)]
        for job in jobs:
            job.result(timeout=120)
        if len(pool.worker_pids()) == workers:
            return pool
    raise AssertionError("the workers did not all start")


def test_checks_run_side_by_side_on_two_workers():
    validator = GrammarValidator(ServerArgs(grammar_workers=2))

    async def both():
        return await asyncio.gather(
            validator.check("regex", SLOW.format(20000)), validator.check("regex", SLOW.format(20001))
        )

    try:
        _warm(validator, 2)
        a, b = asyncio.run(both())
        assert a.seconds > 0.05 and b.seconds > 0.05
        # each started before the other ended: they overlapped, not queued behind one lock
        assert a.started < b.started + b.seconds and b.started < a.started + a.seconds
    finally:
        validator.close()


def test_a_full_check_queue_is_a_503():
    validator = GrammarValidator(ServerArgs(grammar_workers=1, grammar_queue_size=1))

    async def run():
        busy = asyncio.ensure_future(validator.validate("regex", SLOW.format(6000)))
        await asyncio.to_thread(_wait, lambda: pool.stats()["running"] == 1 and pool.queued() == 0)
        results = await asyncio.gather(
            *(validator.validate("regex", SLOW.format(6001 + i)) for i in range(2)), return_exceptions=True
        )
        return [await busy, *results]

    try:
        pool = _warm(validator, 1)
        busy, queued, refused = asyncio.run(run())
        assert busy is None and queued is None
        assert isinstance(refused, RequestError) and refused.status == 503
        assert "--grammar-queue-size" in refused.message
    finally:
        validator.close()


def test_a_check_past_the_wait_limit_is_a_503_and_leaves_the_queue():
    validator = GrammarValidator(ServerArgs(grammar_workers=1, grammar_queue_timeout_s=0.2))

    async def run():
        busy = asyncio.ensure_future(validator.validate("regex", SLOW.format(30000)))
        await asyncio.to_thread(_wait, lambda: pool.stats()["running"] == 1)
        with pytest.raises(RequestError, match="--grammar-queue-timeout-s") as err:
            await validator.validate("regex", "[0-9]+")
        assert err.value.status == 503
        assert pool.queued() == 0 and validator.stats()["cancelled"] >= 1
        await asyncio.gather(busy, return_exceptions=True)

    try:
        pool = _warm(validator, 1)
        asyncio.run(run())
    finally:
        validator.close()


def test_the_scheduler_side_fails_an_overdue_wait_with_a_503_error_and_drops_an_aborted_compile(
    default_tokenizer,
):
    from runtime.managers.scheduler.grammar_manager import GrammarManager

    manager = GrammarManager(
        default_tokenizer, 49152, ServerArgs(grammar_workers=1, grammar_queue_timeout_s=3600)
    )
    pool = manager.compiler._pool
    try:
        manager.compile_async(SamplingParams(regex="[0-9]")).result(timeout=120)  # the worker is up
        slow = manager.compile_async(SamplingParams(regex="[a-z ]{0,400}"))
        _wait(lambda: pool.stats()["running"] == 1)
        overdue = manager.compile_async(SamplingParams(regex="[a-z]{2}"))
        aborted = manager.compile_async(SamplingParams(regex="[a-z]{3}"))
        assert manager.stats()["queued"] == 2
        manager.expire([slow, overdue, aborted])  # nothing is due yet
        assert not overdue.done() and manager.stats()["expired"] == 0
        overdue.deadline = time.monotonic() - 1  # as if --grammar-queue-timeout-s had passed
        manager.expire([slow, overdue, aborted])
        with pytest.raises(GrammarUnavailable, match="--grammar-queue-timeout-s.*retry"):
            overdue.result(timeout=0)
        manager.cancel(aborted)  # what Scheduler._finish_aborted does
        s = manager.stats()
        assert s["queued"] == 0 and s["cancelled"] == 2 and s["expired"] == 1 and not slow.done()
        assert slow.result(timeout=300).index_bytes > 0
        assert manager.stats()["inflight"] == 0
    finally:
        manager.shutdown()
