"""The scheduler's memory: every per-request structure is released when its request leaves (finished,
aborted, failed or retracted and resumed), with speculation on; the memory report counts what each
structure holds; the guard sheds the evictable structures past its budget; the caps of the shared drafting
index and the session records hold; the C-heap helpers work on this libc."""

from __future__ import annotations

import gc
import logging
import random
import weakref

import pytest
import torch

from runtime import allocator
from runtime.managers.scheduler.drafting import SequenceIndex
from runtime.managers.scheduler.req import Req
from runtime.managers.scheduler.sessions import MAX_SESSION_RECORD_TOKENS, SessionPins
from runtime.mem_cache.radix_cache import RadixCache
from runtime.messages import AbortReq, GenerateReq, RequestOptions
from runtime.sampling_params import SamplingParams
from tests.scheduler_utils import make_scheduler


def _prompt(rng: random.Random) -> list[int]:
    """A prompt that repeats a short phrase (prompt lookup drafts from it) with a distinct head."""
    phrase = [rng.randrange(20, 500) for _ in range(rng.randrange(3, 7))]
    return [rng.randrange(20, 500) for _ in range(4)] + phrase * rng.randrange(2, 6)


def test_every_request_structure_is_released_after_hundreds_of_requests(
    tiny_model_dir, default_tokenizer, monkeypatch, caplog
):
    """240 requests through a real scheduler with suffix speculation and a pool small enough to retract:
    a quarter aborted mid-run, a quarter failed inside a step, some with sessions. Afterwards no queue,
    output or drafting state holds anything and every `Req` object is gone."""
    sched = make_scheduler(
        tiny_model_dir,
        default_tokenizer,
        speculative_algorithm="suffix",
        speculative_num_draft_tokens=4,
        max_total_tokens=700,
        max_running_requests=24,
        new_token_ratio=0.0,
    )
    made: list[weakref.ref] = []
    from_message = Req.from_message.__func__

    def tracked(cls, msg, timeout_s=None):
        req = from_message(cls, msg, timeout_s)
        made.append(weakref.ref(req))
        return req

    monkeypatch.setattr(Req, "from_message", classmethod(tracked))
    # the injected faults' log records would keep their tracebacks, whose frames hold the whole batch's
    # requests: pytest's log capture keeps records (a server's log handler does not), so none are made
    caplog.set_level(logging.CRITICAL, logger="radixlm.scheduler")
    advance = sched._advance

    def failing_advance(req, *a):
        if req.rid.startswith("fail") and len(req.output_ids) >= 2:
            raise RuntimeError("injected fault")
        return advance(req, *a)

    monkeypatch.setattr(sched, "_advance", failing_advance)
    rng = random.Random(0)
    kinds = ("ok", "abort", "fail", "ok")
    finishes: dict[str, dict] = {}
    for wave in range(4):
        rids = []
        for i in range(60):
            rid = f"{kinds[i % 4]}-{wave}-{i}"
            session = f"s{i % 5}" if i % 6 == 0 else None
            params = SamplingParams(max_new_tokens=rng.randrange(6, 40), temperature=0.8, ignore_eos=True)
            sched.handle(
                GenerateReq(
                    rid=rid,
                    input_ids=_prompt(rng),
                    params=params,
                    options=RequestOptions(session_id=session, cache_ttl_s=30),
                )
            )
            rids.append(rid)
        steps = 0
        while sched.has_work():
            if steps == 4:  # by now some aborted requests run, some wait, some drafted
                for rid in rids:
                    if rid.startswith("abort"):
                        sched.handle(AbortReq(rid=rid))
            for out in sched.step():
                if out.finished_reason is not None:
                    finishes[out.rid] = out.finished_reason
            sched.check_accounting()
            steps += 1
            assert steps < 5000, "the scheduler did not drain"
    assert len(finishes) == 240
    stats = sched.stats
    assert (
        stats["retractions"] > 0 and stats["requests_failed_internal"] > 0 and stats["requests_aborted"] > 0
    )
    assert stats["spec_verify_steps"] > 0  # drafts were verified: the speculative path ran
    assert all(finishes[r]["type"] == "abort" for r in finishes if not r.startswith("ok"))

    assert not (sched.grammar_wait or sched.waiting or sched.reextend or sched.running)
    assert not sched.outputs.pending()
    gc.collect()
    alive = [ref() for ref in made if ref() is not None]
    assert not alive, f"{len(alive)} requests still referenced, e.g. {alive[0].rid}"
    parts = sched.server_info()["memory"]["structures"]
    assert parts["requests"]["entries"] == 0 and parts["spec_requests"]["entries"] == 0
    assert parts["spec_shared_index"]["entries"] > 0  # finished requests' text: shared, capped, evictable
    assert 0 < parts["session_records"]["entries"] <= 5
    sched.check_accounting()


def test_the_guard_sheds_evictable_structures_past_its_budget(tiny_model_dir, default_tokenizer, caplog):
    sched = make_scheduler(
        tiny_model_dir, default_tokenizer, speculative_algorithm="suffix", memory_budget_mb=1024
    )
    for i in range(6):
        sched.handle(
            GenerateReq(
                rid=f"r{i}",
                input_ids=[30 + i, 40, 41, 42, 40, 41, 42],
                params=SamplingParams(max_new_tokens=8, ignore_eos=True),
                options=RequestOptions(session_id=f"s{i}"),
            )
        )
    while sched.has_work():
        sched.step()
    before = sched.server_info()["memory"]["structures"]
    assert before["spec_shared_index"]["entries"] > 0 and before["session_records"]["entries"] == 6
    guard = sched.memory
    guard.check(sched)
    assert guard.sheds == 0  # within budget: nothing shed
    guard.budget_bytes, guard.baseline_rss = 1, 0  # every byte of RSS is now over budget
    with caplog.at_level("WARNING", logger="radixlm.scheduler"):
        guard.check(sched, now=guard._next_check)
    after = sched.server_info()["memory"]
    assert after["guard_sheds"] == 1
    assert after["shed_counts"] == {"spec_shared_index": 1, "session_records": 1}  # no grammar ever compiled
    assert after["structures"]["spec_shared_index"]["entries"] == 0
    assert after["structures"]["session_records"]["entries"] == 0
    assert "shed spec_shared_index" in caplog.text and "nothing left to shed" in caplog.text
    guard.check(sched)  # within CHECK_EVERY_S of the last check: no second read
    assert sched.memory.sheds == 1 and after["heap_trims"] >= 2  # after each shed
    caplog.clear()
    with caplog.at_level("WARNING", logger="radixlm.scheduler"):
        guard.check(sched, now=guard._next_check)  # still over, nothing left: not said again every second
    assert guard.sheds == 2 and "nothing left to shed" not in caplog.text
    sched.check_accounting()  # shedding touched no KV


def test_the_guard_trims_the_heap_after_growth(tiny_model_dir, default_tokenizer, monkeypatch):
    """RSS grown by TRIM_AFTER_BYTES since the last trim: the guard trims the C heap (and times it)."""
    from runtime.managers.scheduler import memory

    sched = make_scheduler(tiny_model_dir, default_tokenizer)
    guard = sched.memory
    rss = [guard._trimmed_rss]
    monkeypatch.setattr(memory.allocator, "rss_bytes", lambda: rss[0])
    trims: list[bool] = []
    monkeypatch.setattr(memory.allocator, "trim", lambda: trims.append(True) or True)
    rss[0] += memory.TRIM_AFTER_BYTES // 2
    guard.check(sched, now=guard._next_check)
    assert not trims
    rss[0] += memory.TRIM_AFTER_BYTES
    guard.check(sched, now=guard._next_check)
    assert trims == [True] and guard.trims == 1 and guard.info()["heap_trims"] == 1
    guard.check(sched, now=guard._next_check)  # measured from the RSS after that trim: no second one
    assert trims == [True]


def test_flush_cache_forgets_the_shared_drafting_index(tiny_model_dir, default_tokenizer):
    sched = make_scheduler(tiny_model_dir, default_tokenizer, speculative_algorithm="suffix")
    sched.handle(
        GenerateReq(rid="a", input_ids=[50, 51, 52, 53, 54], params=SamplingParams(max_new_tokens=6))
    )
    while sched.has_work():
        sched.step()
    assert len(sched.spec.drafter.shared) > 0
    assert sched.flush_cache()
    assert len(sched.spec.drafter.shared) == 0


def test_shared_index_stays_under_its_key_cap():
    index = SequenceIndex(max_keys=1000)
    rng = random.Random(1)
    for _ in range(200):
        index.add([rng.randrange(5000) for _ in range(30)])
        assert len(index) <= 1000
    assert index.approx_bytes == len(index) * 330
    index.clear()
    assert len(index) == 0 and index.propose([1, 2, 3], 4) == []


def test_session_records_are_capped_in_tokens():
    sessions = SessionPins(RadixCache(), max_pinned_tokens=0)
    big = MAX_SESSION_RECORD_TOKENS // 3
    for i in range(5):
        sessions.remember((None, None, f"s{i}"), list(range(big)), pinned=False)
        assert sessions.record_tokens <= MAX_SESSION_RECORD_TOKENS
    assert sessions.num_records == 3 and sessions.record_tokens == 3 * big
    # the same session again replaces its record
    sessions.remember((None, None, "s4"), [1, 2, 3], pinned=False)
    assert sessions.num_records == 3 and sessions.record_tokens == 2 * big + 3
    assert sessions.explain((None, None, "s4"), [1, 2, 9], 0, lambda ids: "") is not None
    assert sessions.forget_records() == 3 and sessions.record_tokens == 0


def test_radix_cache_counts_its_nodes_as_they_come_and_go():
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], torch.arange(4))
    cache.insert([1, 2, 9], torch.arange(10, 13))  # splits [1,2,3,4]
    assert cache.num_nodes() == 3
    cache.check_integrity()
    cache.evict(10)
    assert cache.num_nodes() == 0
    cache.check_integrity()


@pytest.mark.skipif(allocator._LIBC is None, reason="not glibc")
def test_allocator_on_glibc():
    assert not allocator.configure()  # the default: glibc's dynamic threshold, nothing to set
    assert allocator.configure(4 << 20)  # mallopt accepts a fixed one (RADIXLM_MMAP_THRESHOLD)
    assert allocator.rss_bytes() > 10 << 20
    assert allocator.total_memory_bytes() > allocator.rss_bytes()
    heap = allocator.heap_info()
    if heap:  # glibc >= 2.33
        assert 0 <= heap["heap_in_use_bytes"] <= heap["heap_bytes"] and heap["heap_free_bytes"] >= 0
        assert heap["mmapped_bytes"] > 0  # this process's large buffers (the tokenizer's, torch's)
    allocator.trim()  # returns a bool either way; it must not fail
