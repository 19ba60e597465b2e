"""CompilePool: memory and time limits per compile, breached workers replaced, queue wait not counted.

Runs over a 256-byte vocabulary, so no tokenizer is needed: compile times here are those of the byte-level
automaton (``[ -~]{0,2000}``: ~0.8 s on a loaded 2-core machine).
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import outlines_core
import pytest

from constrained import GrammarError
from constrained.compile_pool import CompilePool
from constrained.errors import GrammarTimeout

# ~80k DFA states x ~200 byte transitions: far over a 32 MB cap, reached in well under a second
HUGE = r'([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt]){0,8192}'


def _pool(queue_size: int = 64, **limits) -> CompilePool:
    vocab = SimpleNamespace(outlines=outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)}))
    return CompilePool(vocab, "", queue_size=queue_size, **limits)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too: it runs nothing
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_memory_breach_is_a_grammar_error_naming_the_limit_and_the_worker_is_replaced():
    pool = _pool(workers=1, memory_mb=32, timeout_s=60)
    try:
        assert pool.submit("regex", "[a-z]{3}").result(timeout=60).index is not None
        (first_pid,) = pool.worker_pids()
        with pytest.raises(
            GrammarError, match=r"needs more memory than the limit of 32 MB \(--grammar-memory-mb"
        ):
            pool.submit("regex", HUGE).result(timeout=60)
        assert _gone(first_pid)
        result = pool.submit("regex", "[0-9]+").result(timeout=60)  # a fresh worker takes the next job
        assert result.index.get_initial_state() is not None
        assert pool.restarts == 1 and pool.worker_pids() != [first_pid]
    finally:
        pool.shutdown()


def test_timeout_kills_the_compile_so_it_stops_using_cpu():
    pool = _pool(workers=1, memory_mb=512, timeout_s=0.5)
    try:
        pool.submit("regex", "a").result(timeout=60)  # start-up is not a compile: warm the worker first
        (pid,) = pool.worker_pids()
        start = time.monotonic()
        with pytest.raises(GrammarTimeout, match=r"longer than the limit of 0.5 s \(--grammar-timeout-s\)"):
            pool.submit("regex", "[ -~]{0,6000}").result(timeout=60)
        assert time.monotonic() - start < 10
        assert _gone(pid)
    finally:
        pool.shutdown()


def test_timeout_counts_compile_time_not_queue_wait():
    probe = _pool(workers=1, memory_mb=512, timeout_s=60)
    try:
        one = max(
            probe.submit("regex", f"[ -~]{{0,{1500 + i}}}").result(timeout=60).seconds for i in range(2)
        )
    finally:
        probe.shutdown()
    # 10 jobs of ~one each on one worker: the last waits ~9x one in the queue, more than the limit of 4x
    timeout_s = max(4 * one, 0.2)
    pool = _pool(workers=1, memory_mb=512, timeout_s=timeout_s)
    try:
        pool.submit("regex", "a").result(timeout=60)
        start = time.monotonic()
        futures = [pool.submit("regex", f"[ -~]{{0,{1500 + i}}}") for i in range(10)]  # distinct specs
        results = [f.result(timeout=300) for f in futures]
        waited = time.monotonic() - start
        assert all(r.seconds < timeout_s for r in results)
        if waited <= timeout_s:
            pytest.skip(f"the queue drained in {waited:.1f} s: too fast to show queue wait is not counted")
        # the last job waited longer than the limit in the queue, and still compiled
        assert pool.restarts == 0
    finally:
        pool.shutdown()


def test_an_unusable_spec_is_an_error_without_killing_the_worker():
    pool = _pool(workers=1, memory_mb=256, timeout_s=30)
    try:
        with pytest.raises(GrammarError, match="regex"):
            pool.submit("regex", "(unclosed").result(timeout=60)
        (pid,) = pool.worker_pids()
        pool.submit("regex", "ok").result(timeout=60)
        assert pool.worker_pids() == [pid] and pool.restarts == 0
    finally:
        pool.shutdown()
