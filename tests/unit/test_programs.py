"""Program-level scheduling (`--schedule-policy program`, runtime/managers/scheduler/programs.py): requests
of one program (`program_id`, else `session_id`) share an attained service; PLAS admits the lowest level
first and `lpm`'s order within a level; aging and the overdue rule bound any request's wait; the program
records stay bounded."""

from __future__ import annotations

import time

from runtime.managers.scheduler.programs import (
    MAX_LEVEL,
    PROMOTE_AFTER_S,
    QUANTUM_TOKENS,
    ProgramTable,
    level_of,
    program_key,
)
from runtime.managers.scheduler.schedule_policy import OVERDUE_AFTER_S, order_waiting
from runtime.messages import GenerateReq, RequestOptions
from runtime.sampling_params import SamplingParams
from tests.scheduler_utils import make_scheduler
from tests.unit.test_host_tier import cache_tokens, make_cm, make_req


def _req(prompt, program=None, session=None, rid=None, arrival=None):
    r = make_req(prompt)
    r.rid = rid or f"r{id(r)}"
    r.options = RequestOptions(program_id=program, session_id=session)
    r.arrival = time.monotonic() if arrival is None else arrival
    return r


def test_program_key_is_the_program_id_else_the_session_within_tenant_and_salt():
    assert program_key(_req([1])) is None
    a = _req([1], program="p")
    b = _req([1], program="p", session="s")
    assert program_key(a) == program_key(b)  # the program id names the program when both are given
    s = _req([1], session="p")
    assert program_key(s) != program_key(a)  # a session and a program of the same name never meet
    salted = _req([1], program="p")
    salted.options = RequestOptions(program_id="p", cache_salt="x")
    assert program_key(salted) != program_key(a)


def test_levels_double():
    assert level_of(0) == level_of(QUANTUM_TOKENS - 1) == 0
    assert level_of(QUANTUM_TOKENS) == 1 and level_of(2 * QUANTUM_TOKENS - 1) == 1
    assert level_of(2 * QUANTUM_TOKENS) == 2
    assert level_of(10**12) == MAX_LEVEL


def test_plas_puts_short_programs_first_and_lpm_orders_within_a_level():
    cm = make_cm(pool=64, host=32)
    cached = list(range(100, 110))
    cache_tokens(cm, cached)
    table = ProgramTable()
    now = time.monotonic()
    long_ = _req(cached + [1], program="long", arrival=now - 3)  # oldest, and a cache hit
    table.arrive(long_)
    table.charge(long_, 5 * QUANTUM_TOKENS)  # its earlier calls
    cold_short = _req([7, 8, 9], program="short", arrival=now - 2)
    hit_short = _req(cached + [2], program="other", arrival=now - 1)
    loner = _req([5, 6], arrival=now)  # no program: one of its own, no service yet
    for r in (cold_short, hit_short):
        table.arrive(r)
    ordered, matched = order_waiting("program", [long_, cold_short, hit_short, loner], cm, programs=table)
    assert matched
    # level 0 (lpm within it: the cache hit first, then arrival), then the long program at level 3
    assert ordered == [hit_short, cold_short, loner, long_]
    # the same queue under lpm: the long program's cache hit and age put it first
    assert order_waiting("lpm", [long_, cold_short, hit_short, loner], cm)[0][0] is long_


def test_a_programs_service_is_shared_by_its_calls_and_forks():
    table = ProgramTable()
    first = _req([1, 2, 3], program="p", rid="a")
    fork = _req([1, 2, 4], program="p", rid="b")
    table.arrive(first)
    table.arrive(fork)
    table.charge(first, 300)
    first.output_ids = [5] * 20
    table.finish(first)
    assert table.service(fork) == 320  # the fork's level counts its sibling's work
    assert table.get(program_key(fork)).last_finish is None  # a fork still runs: not idle, no gap yet
    table.finish(fork)
    nxt = _req([1, 2, 3, 5], program="p", rid="c")
    prog = table.arrive(nxt)
    assert len(prog.gaps) == 1 and prog.followed == 1 and prog.new_gap is not None


def test_aging_bounds_the_wait_of_a_long_programs_request():
    """The starvation bound: a level-L request is at level 0 after L x PROMOTE_AFTER_S, and first in the
    queue once it has waited OVERDUE_AFTER_S, whatever the levels of the others."""
    cm = make_cm(pool=64, host=32)
    table = ProgramTable()
    now = time.monotonic()
    long_ = _req([1, 2, 3], program="long")
    table.arrive(long_)
    table.charge(long_, 40 * QUANTUM_TOKENS)
    lvl = level_of(40 * QUANTUM_TOKENS)
    assert lvl == 6
    long_.arrival = now - (lvl - 1) * PROMOTE_AFTER_S - 0.5
    assert table.level(long_, now) == 1
    long_.arrival = now - lvl * PROMOTE_AFTER_S - 0.5
    assert table.level(long_, now) == 0
    fresh = [_req([50 + i, 60], program=f"s{i}", arrival=now - 1) for i in range(3)]
    for r in fresh:
        table.arrive(r)
    # at level 0 it competes on lpm's terms (arrival breaks the tie: it is the oldest)
    assert order_waiting("program", [*fresh, long_], cm, programs=table)[0][0] is long_
    # a request whose level stayed high by a younger queue's service still goes first once overdue
    young = _req([9, 9], program="long", arrival=now - OVERDUE_AFTER_S - 1)
    table.charge(young, 10**9)
    table.arrive(young)
    ordered = order_waiting("program", [*fresh, young], cm, programs=table)[0]
    assert ordered[0] is young


def test_program_records_are_bounded():
    table = ProgramTable(max_programs=8, idle_s=100.0)
    now = time.monotonic()
    for i in range(50):
        r = _req([1], program=f"p{i}", rid=f"r{i}")
        table.arrive(r, now)
        table.finish(r, now)
    assert len(table) <= 8
    live = [_req([1], program=f"live{i}", rid=f"l{i}") for i in range(12)]
    for r in live:
        table.arrive(r, now)
    assert len(table) == 12  # records with live requests stay (bounded by the live requests)
    later = _req([1], program="late", rid="late")
    table.arrive(later, now + 101)  # idle records past idle_s go
    assert all(table.get(program_key(r)) is not None for r in live)
    for r in live:
        table.finish(r, now + 101)
    table.arrive(_req([1], program="later", rid="x"), now + 300)
    assert len(table) <= 8


# ---- the scheduler, tiny model -----------------------------------------------------------------------------
def _msg(rid, prompt, max_new, program=None):
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return GenerateReq(rid=rid, input_ids=prompt, params=params, options=RequestOptions(program_id=program))


def _drain(s, order):
    for _ in range(2000):
        if not s.has_work():
            return
        for o in s.step():
            assert o.error is None, o.error
            if o.finished_reason is not None:
                order.append(o.rid)
        s.check_accounting()
    raise AssertionError("the scheduler did not drain")


def test_the_scheduler_charges_programs_and_admits_short_ones_first(tiny_model_dir, default_tokenizer):
    """A long program's call waits behind short programs' calls that arrived after it (one request runs at a
    time), though its prefix is cached; under fcfs it would go first. The program's service counts its
    prompt and output tokens."""
    history = [10 + (i * 7) % 490 for i in range(600)]
    other = [11 + (i * 5) % 490 for i in range(600)]
    for policy in ("program", "fcfs"):
        s = make_scheduler(tiny_model_dir, default_tokenizer, schedule_policy=policy, max_running_requests=1)
        s.handle(_msg("warm", other, 8, program="long"))
        _drain(s, [])
        s.handle(_msg("warm2", history, 8, program="long"))
        _drain(s, [])
        assert s.programs.service(_req([1], program="long")) == 1216 > QUANTUM_TOKENS
        s.handle(_msg("blocker", [30, 31, 32], 6))
        s.step()  # the blocker runs; everything below queues behind it
        s.handle(_msg("long-next", history + [5, 6, 7], 4, program="long"))
        for i in range(3):
            s.handle(_msg(f"short{i}", [40 + i, 41, 42], 4, program=f"short{i}"))
        order: list[str] = []
        _drain(s, order)
        if policy == "program":
            assert order == ["blocker", "short0", "short1", "short2", "long-next"], order
            assert s.server_info()["programs_tracked"] == 4
        else:
            assert order == ["blocker", "long-next", "short0", "short1", "short2"], order
