"""Automatic retention (`--kv-retention auto`, runtime/managers/scheduler/retention.py): a program's finished
request is pinned on the device for a TTL learned from the program's own gaps when the expected reuse pays
for the memory, pinned in the host tier when memory is wanted now, left to LRU when reuse is unlikely; an
explicit `cache_ttl_s` wins; a flood of one-shot programs leaves it no worse than LRU; and a program's
path that went to the host or disk tier is prefetched into free device slots before its next call."""

from __future__ import annotations

import random
import time

import pytest
import torch

from runtime.managers.scheduler.programs import ProgramTable
from runtime.managers.scheduler.retention import (
    FIRST_GAP_S,
    MIN_REUSE,
    TTL_MARGIN,
    PathMap,
    Retention,
    load_from_disk,
    load_from_host,
)
from runtime.managers.scheduler.sessions import SessionPins
from runtime.messages import GenerateReq, RequestOptions
from runtime.sampling_params import SamplingParams
from tests.scheduler_utils import make_scheduler
from tests.unit.test_host_tier import assert_kv_names, cache_tokens, make_cm, make_req


def _setup(pool=64, host=64, with_host=True):
    cm = make_cm(pool=pool, host=host)
    if not with_host:
        cm.host = None
        cm.cache.on_evict = None
    pins = SessionPins(cm.cache, max_pinned_tokens=pool, host=cm.host)
    table = ProgramTable()
    return cm, pins, table, Retention(table, pins, cm, max_ttl_s=3600.0)


def _call(table, ret, prompt, program, rid, now):
    r = make_req(prompt)
    r.rid, r.options = rid, RequestOptions(program_id=program)
    ret.arrived(r, table.arrive(r, now))
    return r


def _finish(table, r, now):
    table.finish(r, now)


def test_the_ttl_is_learned_from_the_programs_own_gaps():
    cm, pins, table, ret = _setup()
    now = 1000.0
    r = _call(table, ret, [1, 2], "p", "a", now)
    prog = table.finish(r, now)
    assert ret.ttl(prog) == TTL_MARGIN * FIRST_GAP_S  # no gap seen anywhere yet
    for k, gap in enumerate([2.0, 2.0, 3.0, 2.0]):
        now += gap
        r = _call(table, ret, [1, 2], "p", f"b{k}", now)
        table.finish(r, now)
    assert list(prog.gaps) == [2.0, 2.0, 3.0, 2.0]
    assert ret.ttl(prog) == pytest.approx(TTL_MARGIN * 3.0)
    # a new program with no gaps of its own borrows the pooled ones
    q = _call(table, ret, [3], "q", "c", now)
    assert ret.ttl(table.finish(q, now)) == pytest.approx(TTL_MARGIN * 3.0)


def _returning_program(table, ret, calls=4):
    now = 1000.0
    for k in range(calls):
        r = _call(table, ret, [1, 2, 3], "agent", f"a{k}", now)
        prog = table.finish(r, now + 0.5)
        now += 2.0
    return prog


def test_pins_on_the_device_when_reuse_pays_and_memory_is_free():
    cm, pins, table, ret = _setup()
    prog = _returning_program(table, ret)
    d = ret.decide(prog, tokens=10, demand=0, available=64)
    assert d.action == "device" and d.pressure == 0.0 and d.reuse > MIN_REUSE


def test_demotes_to_the_host_under_pressure_and_pins_on_the_device_without_a_lower_tier():
    cm, pins, table, ret = _setup()
    prog = _returning_program(table, ret)
    d = ret.decide(prog, tokens=10, demand=60, available=64)  # waiting requests want the whole pool
    assert d.pressure == 1.0 and d.action == "host"
    # no tier to demote to: pinned on the device, held against the waiting requests only as `relieve` allows
    cm2, pins2, table2, ret2 = _setup(with_host=False)
    prog2 = _returning_program(table2, ret2)
    assert ret2.decide(prog2, tokens=10, demand=60, available=64).action == "device"
    prog2.followed = 0  # a program that never came back: not pinned at all
    prog2.finished = 50
    assert ret2.decide(prog2, tokens=10, demand=60, available=64).action == "lru"


def test_a_pin_holds_against_waiting_requests_until_the_wait_is_worth_its_prefill():
    """Ski rental: a waiting request that cannot be admitted waits while an automatic pin is expected to save
    more prefill than it has waited (p x tokens / the measured prefill rate); then the pin is released."""
    cm, pins, table, ret = _setup(pool=64, host=64)
    key = list(range(100, 120))
    cache_tokens(cm, key)
    cm.host = pins.host = cm.cache.on_evict = None  # no lower tier from here on
    _returning_program(table, ret)
    r = _call(table, ret, key, "agent", "last", 2000.0)
    table.finish(r, 2000.5)
    d = ret.retain(r, key, demand=60)
    assert d.action == "device" and d.pressure == 1.0
    ret.observe_prefill(10, 0.001)  # too short a batch to time: not counted
    assert ret.prefill_rate is None
    ret.observe_prefill(200, 20.0)  # 10 tokens/s
    worth = ret.worth_s(pin_key := (None, None, ("program", "agent")))
    assert worth == pytest.approx(d.reuse * 20 / 10.0)
    assert not ret.relieve(waited_s=0.5 * worth) and ret.holding() and pin_key in pins._pins
    assert ret.relieve(waited_s=worth) and not ret.holding() and pin_key not in pins._pins
    assert cm.cache.protected_size() == 0 and ret.counts["retain_relieved"] == 1
    cm.check_accounting([])


def test_retain_pins_demotes_or_leaves_the_path_and_keeps_the_accounting():
    cm, pins, table, ret = _setup(pool=64, host=64)
    key = list(range(100, 120))
    cache_tokens(cm, key)
    prog = _returning_program(table, ret)
    r = _call(table, ret, key, "agent", "last", 2000.0)
    table.finish(r, 2000.5)
    d = ret.retain(r, key, demand=0)
    assert d.action == "device" and cm.cache.protected_size() == 20 and len(pins) == 1
    assert d.ttl_s == pytest.approx(TTL_MARGIN * max(prog.gaps))
    cm.check_accounting([])
    r = _call(table, ret, key, "agent", "last2", 2002.0)
    table.finish(r, 2002.5)
    d = ret.retain(r, key, demand=60)  # now memory is wanted: the pin moves to the host tier
    assert d.action == "host"
    assert cm.cache.protected_size() == 0 and cm.host.tree.protected_size() == 20
    assert pins.host_pinned_tokens == 20 and pins.pinned_tokens == 0
    cm.check_accounting([])


def test_relieve_releases_the_automatic_pin_of_least_reuse_first_and_never_explicit_ones():
    cm, pins, table, ret = _setup(pool=64, host=64)
    explicit = list(range(200, 210))
    cache_tokens(cm, explicit)
    assert pins.pin((None, None, "client"), explicit, 60.0)  # a client's own TTL
    _returning_program(table, ret)
    keys = [list(range(100 + 20 * i, 110 + 20 * i)) for i in range(2)]
    for i, key in enumerate(keys):
        cache_tokens(cm, key)
        r = _call(table, ret, key, f"agent{i}", f"x{i}", 3000.0)
        prog = table.finish(r, 3000.0)
        prog.followed, prog.finished = (5, 6) if i == 0 else (3, 6)  # both return, the newer one less often
        assert ret.retain(r, key, demand=0).action == "device"
    assert cm.cache.protected_size() == 30
    assert ret.relieve() and cm.cache.match_prefix(keys[1]).last_node.lock_ref == 0  # the newer: less reuse
    assert cm.cache.match_prefix(keys[0]).last_node.lock_ref > 0
    assert ret.relieve() and cm.cache.protected_size() == 10  # the client's pin stays
    assert not ret.relieve()
    cm.check_accounting([])


def _tool_history(table, ret, program: str, tools_and_gaps, now: float = 1000.0) -> float:
    """A program whose answers called these tools, each followed by its gap: the tools' gap histories."""
    for k, (tool, gap) in enumerate(tools_and_gaps):
        r = _call(table, ret, [1, 2, 3], program, f"{program}-{k}", now)
        table.finish(r, now)
        ret.retain(r, [1, 2, 3], demand=0)  # (not cached: nothing is pinned)
        assert ret.tool_calls(r.rid, [tool], demand=0) is not None
        now += gap
    return now


def test_a_tool_call_times_the_pin_by_that_tools_own_pauses():
    """A program that alternates a slow tool (8 s) and a fast one (1 s): its own gaps say 8 s after either,
    but once the front end names the tool the answer called, the pin lasts for that tool's pause."""
    cm, pins, table, ret = _setup(pool=64, host=64)
    now = _tool_history(table, ret, "agent", [("search", 8.0), ("read", 1.0)] * 3)
    assert ret.info()["retain_tools_known"] == 2 and ret.counts["retain_tool_timed"] == 6
    key = list(range(100, 120))
    cache_tokens(cm, key)
    for tool, pause in (("read", 1.0), ("search", 8.0)):
        r = _call(table, ret, key, "agent", f"last-{tool}", now)
        prog = table.finish(r, now)
        d = ret.retain(r, key, demand=0)
        assert d.action == "device" and d.ttl_s == pytest.approx(TTL_MARGIN * 8.0)  # its own gaps
        t = ret.tool_calls(r.rid, [tool], demand=0)
        assert t.action == "device" and t.ttl_s == pytest.approx(TTL_MARGIN * pause)
        pin = pins._pins[(None, None, ("program", "agent"))]
        assert pin.expires_at - time.monotonic() == pytest.approx(TTL_MARGIN * pause, abs=0.5)
        assert ret.ttl(prog) == pytest.approx(TTL_MARGIN * pause)
        assert ret.tool_calls(r.rid, [tool], demand=0) is None  # decided once
        now += pause
    cm.check_accounting([])
    # parallel calls: the slowest tool's pause decides; a tool never seen before adds nothing
    r = _call(table, ret, key, "agent", "parallel", now)
    table.finish(r, now)
    ret.retain(r, key, demand=0)
    assert ret.tool_calls(r.rid, ["read", "search", "new"], demand=0).ttl_s == pytest.approx(TTL_MARGIN * 8.0)


def test_a_tool_slower_than_the_longest_ttl_is_not_pinned_and_stale_names_change_nothing():
    cm, pins, table, ret = _setup(pool=64, host=64)
    ret.max_ttl_s = 5.0
    now = _tool_history(table, ret, "agent", [("build", 30.0), ("read", 1.0)] * 3)
    key = list(range(100, 120))
    cache_tokens(cm, key)
    r = _call(table, ret, key, "agent", "last", now)
    table.finish(r, now)
    assert ret.retain(r, key, demand=0).action == "device"  # its own gaps: half of them are short
    assert cm.cache.protected_size() == 20
    d = ret.tool_calls(r.rid, ["build"], demand=0)  # a build outlasts any pin: reuse within it is 0
    assert d.action == "lru" and d.reuse == 0.0 and cm.cache.protected_size() == 0 and not pins._pins
    assert ret.counts["retain_device"] == 0 and ret.counts["retain_lru"] == 7
    cm.check_accounting([])
    # a name for a request whose program already moved on, or for a request never decided here: nothing
    r2 = _call(table, ret, key, "agent", "next", now + 40.0)
    assert ret.tool_calls("last", ["read"], demand=0) is None and ret.tool_calls("nobody", ["x"], 0) is None
    table.finish(r2, now + 41.0)
    assert ret.retain(r2, key, demand=0).action == "device"
    assert ret.tool_calls("last", ["read"], demand=0) is None  # not the program's last finish


def test_tool_histories_are_per_tenant_and_bounded(monkeypatch):
    import runtime.managers.scheduler.retention as retention

    cm, pins, table, ret = _setup()
    now = _tool_history(table, ret, "agent", [("search", 8.0)] * 3)
    r = make_req([1, 2, 3])
    r.rid, r.options = "other", RequestOptions(program_id="agent", tenant="bob")  # another tenant's agent
    ret.arrived(r, table.arrive(r, now))
    table.finish(r, now)
    ret.retain(r, [1, 2, 3], demand=0)
    ret.tool_calls(r.rid, ["search"], demand=0)
    assert table.get(("bob", None, ("program", "agent"))).tools == (("bob", "search"),)
    assert ret.gaps(table.get(("bob", None, ("program", "agent")))) is ret.pooled  # not alice's search
    monkeypatch.setattr(retention, "MAX_TOOLS", 3)
    _tool_history(table, ret, "many", [(f"t{i}" + "x" * 500, 1.0) for i in range(6)], now=now)
    assert len(ret.tool_gaps) == 3
    assert all(len(name) == retention.MAX_TOOL_NAME_CHARS for _, name in ret.tool_gaps)
    assert len(ret._finished) == 0 and ret._finished.tokens == 0  # each was taken by its tool call


def test_prefetch_loads_a_programs_host_path_into_free_slots():
    cm, pins, table, ret = _setup(pool=64, host=64)
    key = list(range(100, 130))
    cache_tokens(cm, key)
    _returning_program(table, ret)
    r = _call(table, ret, key, "agent", "last", 2000.0)
    table.finish(r, 2000.5)
    assert ret.retain(r, key, demand=60).action == "host"  # pinned on the host, expected back
    held = cm.alloc_slots(64)  # another request takes the whole pool: the device copy is evicted
    assert cm.cache.match_prefix(key).indices.numel() == 0
    assert ret.prefetch() == 0  # no free slots: nothing is taken from anyone
    cm.allocator.free(held)
    assert ret.prefetch() == 30
    hit = cm.cache.match_prefix(key)
    assert hit.indices.numel() == 30
    assert_kv_names(cm, hit.indices, key)  # the KV the host kept, in the device slots now
    assert ret.counts["prefetched_tokens"] == 30 and ret.prefetch() == 0  # done once
    cm.check_accounting([])
    # loading needs the headroom too, and stops at the budget
    assert load_from_host(cm, key, budget=100, headroom=0) == 0  # all on the device already


def test_a_path_demoted_to_disk_is_read_back_during_the_tool_pause(tmp_path):
    """Disk tier only: a program's finished call under memory pressure is demoted to the disk; another
    request evicts its device copy; while the program's tool runs (no request waits) `prefetch` reads the
    blocks back into free device slots, so its next call matches them on the device; no slot is lost."""
    from tests.unit.test_disk_tier import BLOCK, POOL, fill
    from tests.unit.test_disk_tier import make_cm as make_disk_cm

    cm = make_disk_cm(tmp_path)
    pins = SessionPins(cm.cache, max_pinned_tokens=POOL, host=None)
    table = ProgramTable()
    ret = Retention(table, pins, cm, max_ttl_s=3600.0)
    _returning_program(table, ret)
    prompt = [1000 + i for i in range(2 * BLOCK + 5)]
    r = fill(cm, prompt)
    r.rid, r.options = "last", RequestOptions(program_id="agent")
    ret.arrived(r, table.arrive(r, 2000.0))
    table.finish(r, 2000.5)
    key = r.cache_key(r.kv_len)
    cm.release(r)  # its full blocks are offered to the disk as it leaves
    assert cm.disk.flush()
    d = ret.retain(r, key, demand=POOL)  # others want the whole pool: demoted, not pinned
    assert d.action == "disk" and ret.counts["retain_disk"] == 1 and not pins._pins
    held = cm.alloc_slots(POOL)  # another request takes the whole pool: the device copy is evicted
    assert cm.cache.match_prefix(key).indices.numel() == 0
    assert ret.prefetch() == 0  # no room: nothing is taken from anyone
    cm.allocator.free(held)
    cm.check_accounting([])
    assert ret.prefetch() == 2 * BLOCK  # the tool pause: the full blocks come back
    hit = cm.cache.match_prefix(key).indices
    assert hit.numel() == 2 * BLOCK
    kv = cm.disk.device_pool
    want = torch.tensor(prompt[: 2 * BLOCK], dtype=torch.float32)
    for layer in range(kv.num_layers):
        assert torch.equal(kv.k[layer][hit][:, 0, 0], want + layer)
        assert torch.equal(kv.v[layer][hit][:, 1, 3], want - layer)
    assert ret.counts["prefetches"] == 1 and ret.prefetch() == 0  # done once
    cm.check_accounting([])
    nxt = fill(cm, key + [7, 8, 9])  # the program's next call: its history is on the device already
    assert nxt.cache_owned_len == 2 * BLOCK and cm.disk.counts["disk_loaded_tokens"] == 2 * BLOCK
    cm.release(nxt)
    cm.check_accounting([])
    assert load_from_disk(cm, key, cm.disk.block_names(key), budget=1000, headroom=0) == 0  # all there


def _gen(rid, prompt, max_new=2, **options):
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return GenerateReq(rid=rid, input_ids=prompt, params=params, options=RequestOptions(**options))


def _run(s, msg, ids: list[int] | None = None):
    """Run `msg` to its end; its last output (and its generated ids appended to `ids`)."""
    s.handle(msg)
    last = None
    while s.has_work():
        for o in s.step():
            assert o.error is None, o.error
            if ids is not None and o.rid == msg.rid:
                ids.extend(o.new_token_ids)
            last = o
        s.check_accounting()
    return last


def test_an_explicit_ttl_wins_and_a_program_without_one_is_retained(tiny_model_dir, default_tokenizer):
    s = make_scheduler(tiny_model_dir, default_tokenizer, kv_retention="auto", max_total_tokens=1024)
    _run(s, _gen("a", [3, 4, 5, 6], session_id="s1", cache_ttl_s=7.0))
    pin = s.sessions._pins[(None, None, "s1")]
    assert pin.expires_at - time.monotonic() == pytest.approx(7.0, abs=1.0)  # the client's TTL
    info = s.server_info()
    assert info["retain_device"] + info["retain_host"] + info["retain_lru"] == 0
    _run(s, _gen("b", [7, 8, 9, 10], program_id="p1"))
    info = s.server_info()
    assert info["retain_device"] == 1, {
        k: v for k, v in info.items() if "retain" in k or "program" in k
    }  # memory free, a first call: pinned
    assert (None, None, ("program", "p1")) in s.sessions._pins


def test_a_client_naming_no_program_keeps_its_history_where_lru_loses_it(tiny_model_dir, default_tokenizer):
    """An agent that sends no program or session field: its calls are one program by their prompts (each
    resends the last one's), so its history stays pinned while one-shot requests pass; under LRU (`ttl`) the
    one-shots evict it, being newer."""
    rng = random.Random(3)
    agent = [rng.randrange(10, 500) for _ in range(60)]
    found = {}
    for mode in ("ttl", "auto"):
        # the default --max-pinned-tokens (a quarter of the pool, 64) is below the agent's history: automatic
        # pins have their own cap (three quarters of the pool)
        s = make_scheduler(tiny_model_dir, default_tokenizer, kv_retention=mode, max_total_tokens=256)
        history = list(agent)
        for turn in range(3):  # the agent's calls and tool results: it comes back, and the server learns it
            out: list[int] = []
            _run(s, _gen(f"{mode}-a{turn}", history, max_new=2), out)
            history = history + out + [rng.randrange(10, 500) for _ in range(10)]
        _run(s, _gen(f"{mode}-x", [rng.randrange(10, 500) for _ in range(60)]))  # one-shots of others
        _run(s, _gen(f"{mode}-y", [rng.randrange(10, 500) for _ in range(150)]))  # needs evictions
        found[mode] = _run(s, _gen(f"{mode}-a3", history, max_new=2)).cached_tokens
        info = s.server_info()
        if mode == "auto":
            # the agent's calls joined one program, and the one-shot's pin went first
            assert info["lineage_continued"] == 3 and info["retain_relieved"] == 1, info
    assert found["ttl"] < 60 <= found["auto"], found


def test_a_hold_is_charged_every_waiting_requests_wait(tiny_model_dir, default_tokenizer):
    """What holding an automatic pin costs is the delay of every request it keeps waiting: four waiting
    requests run up the wait `relieve` weighs four times as fast as one, and an admission starts it again."""
    s = make_scheduler(tiny_model_dir, default_tokenizer, kv_retention="auto", max_total_tokens=256)
    waiting = [make_req(list(range(10, 40))) for _ in range(4)]
    s.waiting.extend(waiting)
    try:
        assert s._count_blocked_wait(False, now=100.0) == 0.0  # the block starts
        assert s._count_blocked_wait(False, now=100.5) == pytest.approx(2.0)  # 4 requests x 0.5 s
        s.waiting.remove(waiting[0])
        assert s._count_blocked_wait(False, now=101.5) == pytest.approx(6.0)  # + 4 x 1 s (as counted)
        s.waiting.append(waiting[0])  # an arrival: it waits from now on
        assert s._count_blocked_wait(False, now=102.0) == pytest.approx(7.5)  # + 3 x 0.5 s
        assert s._count_blocked_wait(True, now=102.5) == 0.0  # one was admitted: the block ended
        assert s._count_blocked_wait(False, now=103.0) == 0.0
    finally:
        s.waiting.clear()


def test_four_waiting_requests_release_a_pin_sooner_than_one(tiny_model_dir, default_tokenizer, monkeypatch):
    """Through the scheduler's step: a program's pin worth 10 s of prefill holds for 5 s against one waiting
    request that needs its memory (5 request-seconds), and gives way to four (20)."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    sid = (None, None, ("program", "agent"))
    for n, released in ((1, False), (4, True)):
        s = make_scheduler(tiny_model_dir, default_tokenizer, kv_retention="auto", max_total_tokens=256)
        _run(s, _gen(f"agent{n}", list(range(20, 170)), program_id="agent"))  # 150 tokens, then pinned
        assert sid in s.sessions._pins and s.server_info()["retain_device"] == 1
        s.retention.prefill_rate = s.retention._auto[sid] * s.sessions._pins[sid].tokens / 10.0
        assert s.retention.worth_s(sid) == pytest.approx(10.0)
        for i in range(n):  # each needs more than the 105 slots the pin leaves
            s.handle(_gen(f"w{n}-{i}", [300 + i] + list(range(200, 319))))
        s.step()  # the block starts
        assert sid in s.sessions._pins and not s.can_run()  # held: the loop polls, nothing to run
        clock[0] += 5.0
        s.step()
        assert (sid not in s.sessions._pins) is released, n
        while s.has_work():  # released or not, every request finishes (the unreleased pin expires)
            clock[0] += 1.0
            s.step()
            s.check_accounting()


def test_automatic_pins_have_their_own_cap_and_zero_disables_them(tiny_model_dir, default_tokenizer):
    prompt = list(range(20, 120))  # 100 tokens: above a quarter of the pool, within three quarters
    for cap, pinned in ((-1, True), (0, False)):
        s = make_scheduler(
            tiny_model_dir,
            default_tokenizer,
            kv_retention="auto",
            max_total_tokens=256,
            max_pinned_tokens=cap,
        )
        assert s.retention.device_limit() == (192 if cap else 0)
        _run(s, _gen(f"p{cap}", prompt, program_id="agent"))
        assert ((None, None, ("program", "agent")) in s.sessions._pins) is pinned
        assert s.server_info()["retain_device"] == int(pinned)
        # an explicit session's pin is still held to --max-pinned-tokens
        _run(s, _gen(f"s{cap}", [3] + prompt, session_id="chat", cache_ttl_s=30.0))
        assert (None, None, "chat") not in s.sessions._pins


def _flood_trace(seed=5):
    """A shared system prompt; one-shot programs (a fresh program id each) and, every 8th call, the next
    turn of one returning agent whose prompt extends its previous one."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 500) for _ in range(48)]
    agent = list(system)
    trace = []
    for i in range(64):
        if i % 8 == 7:
            agent = agent + [rng.randrange(10, 500) for _ in range(16)]
            trace.append(("agent", list(agent)))
        else:
            trace.append((f"one{i}", system + [rng.randrange(10, 500) for _ in range(40)]))
    return trace


@pytest.mark.parametrize("with_host,named", [(False, True), (True, True), (False, False)])
def test_a_flood_of_one_shot_programs_is_never_worse_than_lru(
    tiny_model_dir, default_tokenizer, with_host, named
):
    """The same trace under LRU (`ttl`, no sessions: nothing pinned) and `auto`: automatic retention finds
    at least as many cached tokens, and learns to stop pinning programs that never come back; also when
    the client names no programs (`named` False: they are inferred from the prompts)."""
    cached = {}
    for mode in ("ttl", "auto"):
        s = make_scheduler(
            tiny_model_dir,
            default_tokenizer,
            kv_retention=mode,
            max_total_tokens=256,
            max_pinned_tokens=192,
            kv_host_tier_gb=0.01 if with_host else 0.0,
        )
        total = 0
        for k, (program, prompt) in enumerate(_flood_trace()):
            options = {"program_id": program} if named else {}
            out = _run(s, _gen(f"{mode}{k}", prompt, max_new=2, **options))
            total += out.cached_tokens
        cached[mode] = total
        if mode == "auto":
            info = s.server_info()
            assert info["retain_lru"] + info["retain_host"] > info["retain_device"], info
    assert cached["auto"] >= cached["ttl"], cached


def test_the_scheduler_prefetches_a_programs_history_from_the_host_when_idle(
    tiny_model_dir, default_tokenizer
):
    """A program's history is pushed to the host tier by another request; while the server idles it is
    loaded back, so the program's next call finds it on the device (under `ttl` it is loaded at admission)."""
    rng = random.Random(4)
    history = [4] + [rng.randrange(10, 500) for _ in range(99)]
    other = [5] + [rng.randrange(10, 500) for _ in range(199)]
    hits = {}
    for mode in ("ttl", "auto"):
        s = make_scheduler(
            tiny_model_dir, default_tokenizer, kv_retention=mode, max_total_tokens=256, kv_host_tier_gb=0.01
        )
        output: list[int] = []
        _run(s, _gen(f"{mode}-a0", history, program_id="agent"), output)
        _run(s, _gen(f"{mode}-b", other))  # needs the pool: the agent's history goes to the host tier
        s.prefetch()  # what the process loop does while idle (steps with nothing waiting do it too)
        s.check_accounting()
        on_device = s.cm.cache.match_prefix(history).indices.numel()
        if mode == "auto":
            assert on_device == 100 and s.server_info()["prefetched_tokens"] > 0
        else:
            assert on_device < 99
        nxt = history + output + [7, 8, 9]
        out = _run(s, _gen(f"{mode}-a1", nxt, program_id="agent"))
        hits[mode] = (out.cached_tokens, out.cached_tokens_host)
    assert hits["auto"][0] >= 100 and hits["auto"][1] == 0  # on the device already
    assert hits["ttl"][0] >= 100 and hits["ttl"][1] > 0  # loaded from the host at admission


def test_a_path_map_drops_its_oldest_entries_past_either_bound():
    m = PathMap(max_entries=3, max_tokens=10)
    m.put("a", [1] * 4, "A")
    m.put("b", [2] * 4, "B")
    assert len(m) == 2 and m.tokens == 8
    m.put("c", [3] * 4, "C")  # 12 tokens: the oldest goes
    assert "a" not in m and m.tokens == 8 and m.oldest() == ("b", [2] * 4, "B")
    m.move_to_end("b")
    m.put("d", [4], "D")
    m.put("e", [5], "E")  # 4 entries: the oldest, now "c", goes
    assert "c" not in m and len(m) == 3 and m.tokens == 6
    m.put("d", [6] * 2, "D2")  # the same key again: replaced, counted once
    assert len(m) == 3 and m.tokens == 7 and m.pop("d") == ([6] * 2, "D2") and m.tokens == 5
    m.put("x", [7] * 11, "X")  # longer than the token bound: not kept, nothing else dropped
    assert "x" not in m and len(m) == 2 and m.pop("x") is None and m.pop(None) is None
