"""Program-level scheduling (`--schedule-policy program`, runtime/managers/scheduler/programs.py): requests
of one program (`program_id`, else `session_id`) share an attained service; PLAS admits the lowest level
first and `lpm`'s order within a level; aging and the overdue rule bound any request's wait; the program
records stay bounded."""

from __future__ import annotations

import time

from runtime.managers.scheduler.programs import (
    FORK_FANOUT,
    MAX_LEVEL,
    MIN_ANCHOR_TOKENS,
    PROMOTE_AFTER_S,
    QUANTUM_TOKENS,
    ProgramTable,
    level_of,
    prefix_hashes,
    program_key,
)
from runtime.managers.scheduler.schedule_policy import OVERDUE_AFTER_S, order_waiting
from runtime.messages import GenerateReq, RequestOptions
from runtime.sampling_params import SamplingParams
from tests.scheduler_utils import make_scheduler
from tests.unit.test_host_tier import cache_tokens, make_cm, make_req


def _req(prompt, program=None, session=None, rid=None, arrival=None, tenant=None):
    r = make_req(prompt)
    r.rid = rid or f"r{id(r)}"
    r.options = RequestOptions(program_id=program, session_id=session, tenant=tenant)
    r.arrival = time.monotonic() if arrival is None else arrival
    return r


def _credit(table, req, tokens):
    """Service the program of `req` attained in calls the test does not replay."""
    table.get(program_key(req)).service += tokens


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
    _credit(table, long_, 5 * QUANTUM_TOKENS)  # its earlier calls
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
    first = _req(list(range(1, 301)), program="p", rid="a")
    fork = _req([1, 2, 4], program="p", rid="b")
    table.arrive(first)
    table.arrive(fork)
    table.charge(first, 0, 300)
    first.output_ids = [5] * 20
    table.finish(first)
    assert table.service(fork) == 320  # the fork's level counts its sibling's work
    assert table.get(program_key(fork)).last_finish is None  # a fork still runs: not idle, no gap yet
    table.finish(fork)
    nxt = _req([1, 2, 3, 5], program="p", rid="c")
    prog = table.arrive(nxt)
    assert len(prog.gaps) == 1 and prog.followed == 1 and prog.new_gap is not None


def test_recomputing_a_programs_own_history_is_not_charged():
    """A call that recomputes the history its program computed last (evicted during the tool pause) is
    charged only for its new tokens, also when the client re-rendered the answer; another context of the
    same program, as long as that history, is charged in full; a retracted request's re-prefill is free
    and its output is charged once."""
    table = ProgramTable()
    history = list(range(100, 400))  # 300 tokens
    first = _req(history, program="p", rid="a")
    table.arrive(first)
    table.charge(first, 0, 300)
    first.output_ids = [7] * 8
    table.finish(first)
    assert table.service(first) == 308
    nxt = _req(history + [7] * 8 + list(range(500, 540)), program="p", rid="b")  # + output + a tool result
    table.arrive(nxt)
    table.charge(nxt, 0, 200)  # its history was evicted: recomputed in two chunks
    table.charge(nxt, 200, 348)
    assert table.service(nxt) == 308 + 40  # only the tool result is new
    nxt.output_ids = [8] * 8
    table.finish(nxt)
    assert table.service(nxt) == 356
    # the client re-rendered the answer (its tokens differ): the prompt before it is still credited
    rerendered = _req(nxt.prompt_ids + [9] * 8 + [1, 2], program="p", rid="c")
    table.arrive(rerendered)
    table.charge(rerendered, 0, 358)
    assert table.service(rerendered) == 356 + 10
    # retracted after 3 tokens and re-prefilled (its output too): nothing charged again, the output once
    rerendered.output_ids = [4, 4, 4]
    table.charge(rerendered, 0, 361)
    rerendered.output_ids += [4, 4]
    table.finish(rerendered)
    assert table.service(rerendered) == 366 + 5
    # as long as the last history and differing in its last token: only the last prompt is credited
    close = _req(rerendered.all_ids[:-1] + [11], program="p", rid="d")
    table.arrive(close)
    table.charge(close, 0, 363)
    assert table.service(close) == 371 + 5
    assert close.prompt_hashes is not None
    table.finish(close)
    assert close.prompt_hashes is None  # not kept past the request
    # another context of the program, as long, differing in its first token: charged in full
    other = _req([11] + close.prompt_ids[1:], program="p", rid="e")
    table.arrive(other)
    table.charge(other, 0, 363)
    assert table.service(other) == 376 + 363


def test_aging_bounds_the_wait_of_a_long_programs_request():
    """The starvation bound: a level-L request is at level 0 after L x PROMOTE_AFTER_S, and first in the
    queue once it has waited OVERDUE_AFTER_S, whatever the levels of the others."""
    cm = make_cm(pool=64, host=32)
    table = ProgramTable()
    now = time.monotonic()
    long_ = _req([1, 2, 3], program="long")
    table.arrive(long_)
    _credit(table, long_, 40 * QUANTUM_TOKENS)
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
    _credit(table, young, 10**9)
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


# ---- programs inferred from prompts (requests that name none) -------------------------------------------
def _ids(seed, n):
    return [(seed * 7919 + 31 * i) % 4000 + 10 for i in range(n)]


def test_prefix_hashes_tell_prefixes_apart_and_match_equal_ones():
    a = _ids(1, 300)
    h = prefix_hashes(a)
    assert len(h) == 300 and len(set(h.tolist())) == 300
    assert prefix_hashes(a[:120])[-1] == h[119]
    assert prefix_hashes([*a[:119], a[119] + 1])[-1] != h[119]
    assert prefix_hashes([0, 0])[-1] != prefix_hashes([0])[-1]  # a zero token still counts


def test_a_request_naming_no_program_continues_the_one_whose_prompt_it_extends():
    table = ProgramTable(infer=True)
    catalogue = _ids(1, 200)
    a1 = _req(catalogue + _ids(2, 40), rid="a1")
    b1 = _req(catalogue + _ids(3, 40), rid="b1")
    for r in (a1, b1):
        table.arrive(r)
        table.finish(r)
    # sharing the catalogue does not make them one program; each next call joins its own
    assert program_key(a1) != program_key(b1) and program_key(a1)[2][0] == "lineage"
    a2 = _req(a1.prompt_ids + _ids(4, 30), rid="a2")
    b2 = _req(b1.prompt_ids + _ids(5, 30), rid="b2")
    table.arrive(a2)
    table.arrive(b2)
    assert program_key(a2) == program_key(a1) and program_key(b2) == program_key(b1)
    assert table.get(program_key(a2)).followed == 1  # the gap since a1 finished was learned
    # a call extending a2 joins through a2's prompt (the longest one it extends), not through a1's
    a3 = _req(a2.prompt_ids + _ids(6, 10), rid="a3")
    table.arrive(a3)
    assert program_key(a3) == program_key(a1)
    # a prompt of another tenant, or too short to tell, is its own program
    other = _req(a1.prompt_ids + _ids(7, 5), rid="t", tenant="someone-else")
    table.arrive(other)
    assert program_key(other) != program_key(a1)
    short = _req(_ids(8, MIN_ANCHOR_TOKENS - 1), rid="s")
    table.arrive(short)
    assert program_key(short) is None
    # a request that names its program is never re-assigned
    named = _req(a1.prompt_ids + [1, 2], program="mine", rid="n")
    table.arrive(named)
    assert program_key(named)[2] == ("program", "mine")
    info = table.info()
    assert info["lineage_continued"] == 3 and info["lineage_started"] == 3, info


def test_one_prompt_is_continued_by_at_most_fork_fanout_requests():
    table = ProgramTable(infer=True)
    system = _req(_ids(1, 64), rid="warm-up")
    table.arrive(system)
    followers = [_req(system.prompt_ids + _ids(10 + i, 20), rid=f"f{i}") for i in range(FORK_FANOUT + 3)]
    for r in followers:
        table.arrive(r)
    same = [r for r in followers if program_key(r) == program_key(system)]
    # a fork's sub-agents join; a flood of programs behind one prompt does not
    assert len(same) == FORK_FANOUT


def test_inferred_prompts_are_bounded_and_forgotten():
    table = ProgramTable(infer=True, idle_s=100.0)
    table.lineage.max_anchors = 16
    now = time.monotonic()
    for i in range(100):
        table.arrive(_req(_ids(i, 20 + i % 7), rid=f"r{i}"), now)
    assert len(table.lineage) == 16 and len(table.lineage._lengths) == 16
    late = _req(_ids(99, 20 + 99 % 7) + [5], rid="late")
    table.arrive(late, now + 101)  # every remembered prompt is past idle_s: none is continued
    assert len(table.lineage) == 1 and table.lineage.counts["lineage_continued"] == 0


def test_without_inference_a_request_naming_no_program_is_its_own():
    table = ProgramTable()
    r = _req(_ids(1, 64))
    table.arrive(r)
    assert program_key(r) is None and "lineage_prompts" not in table.info()


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
