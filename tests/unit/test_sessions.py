"""Session pins: a finished session request's tokens stay in the radix cache for its TTL, under memory
pressure too; TTL expiry, DELETE and the pinned-token limit release them; nothing leaks.

The first tests use a bare RadixCache (fast tier); the last ones the real scheduler on the tiny model."""

from __future__ import annotations

import time

import pytest
import torch

from runtime.managers.scheduler.scheduler import Scheduler
from runtime.managers.scheduler.sessions import SessionPins
from runtime.mem_cache.radix_cache import RadixCache
from runtime.messages import GenerateReq, ReleaseSessionReq, RequestOptions
from runtime.sampling_params import SamplingParams
from tests.scheduler_utils import make_scheduler


def sid(name: str, salt: str | None = None, tenant: str | None = None) -> tuple:
    """A session's key: (tenant, cache salt, id)."""
    return tenant, salt, name


def cached(tokens: list[int]) -> RadixCache:
    cache = RadixCache()
    cache.insert(tokens, torch.arange(len(tokens)))
    return cache


def test_pin_protects_the_path_until_released():
    cache = cached(list(range(10)))
    pins = SessionPins(cache, max_pinned_tokens=100)
    pins.pin(sid("s"), list(range(10)), ttl_s=60)
    assert cache.protected_size() == 10 and cache.evictable_size() == 0
    assert cache.evict(10).numel() == 0  # LRU cannot take it
    assert pins.release(sid("s")) == 10
    assert cache.protected_size() == 0 and cache.evict(10).numel() == 10
    assert pins.release(sid("s")) == 0  # nothing left to release


def test_new_pin_of_a_session_replaces_its_old_one():
    cache = cached(list(range(12)))
    pins = SessionPins(cache, max_pinned_tokens=100)
    pins.pin(sid("s"), list(range(6)), ttl_s=60)
    pins.pin(sid("s"), list(range(12)), ttl_s=60)  # the next turn: a longer path
    assert (len(pins), pins.pinned_tokens, cache.protected_size()) == (1, 12, 12)
    pins.release_all()
    assert cache.protected_size() == 0


@pytest.mark.parametrize(
    "victim,other", [(sid("s", "victim"), sid("s", "other")), (sid("s", tenant="a"), sid("s", tenant="b"))]
)
def test_a_session_is_its_id_within_its_tenant_and_salt(victim, other):
    """Another salt or tenant naming the same session id neither replaces nor releases its pin."""
    cache = cached(list(range(12)))
    pins = SessionPins(cache, max_pinned_tokens=100)
    pins.pin(victim, list(range(12)), ttl_s=60)
    pins.pin(other, list(range(4)), ttl_s=60)  # a second session, not a replacement
    assert (len(pins), pins.pinned_tokens) == (2, 16) and cache.protected_size() == 12
    assert pins.release(sid("s")) == 0 and pins.release(other) == 4
    assert cache.protected_size() == 12  # the victim's path is still pinned
    assert pins.release(victim) == 12 and cache.protected_size() == 0


def test_a_tenant_past_its_token_quota_releases_its_own_oldest_pins():
    """One tenant cycling new session ids pushes out its own pins, never another tenant's."""
    cache = RadixCache()
    for i in range(5):
        cache.insert([i + 1] * 6, torch.arange(6 * i, 6 * i + 6))
    pins = SessionPins(cache, max_pinned_tokens=100, tenant_max_tokens=12)
    pins.pin(sid("b0", tenant="b"), [1] * 6, 60)
    for i in range(4):
        pins.pin(sid(f"a{i}", tenant="a"), [i + 2] * 6, 60)
    assert pins.tenant_tokens["a"] == 12 and pins.counts["evicted_for_tenant_quota"] == 2
    assert pins.release(sid("b0", tenant="b")) == 6  # b's pin survived a's cycling
    assert pins.release(sid("a3", tenant="a")) == 6 and pins.release(sid("a0", tenant="a")) == 0
    assert not pins.pin(sid("long", tenant="a"), list(range(13)), 60)  # longer than the quota: no pin
    assert pins.quota_problem(sid("long", tenant="a"), 13).startswith(
        "tenant quota --tenant-max-pinned-tokens"
    )
    assert pins.quota_problem(sid("long"), 13) is None  # no tenant: not counted


def test_a_tenant_at_its_pin_count_may_renew_but_not_open_a_session():
    cache = RadixCache()
    for i in range(3):
        cache.insert([i + 1] * 4, torch.arange(4 * i, 4 * i + 4))
    pins = SessionPins(cache, max_pinned_tokens=100, tenant_max_pins=2)
    pins.pin(sid("x", tenant="a"), [1] * 4, 60)
    pins.pin(sid("y", tenant="a"), [2] * 4, 60)
    assert pins.quota_problem(sid("x", tenant="a"), 4) is None  # its own session's next turn
    assert "--tenant-max-pins (2)" in pins.quota_problem(sid("z", tenant="a"), 4)
    assert pins.quota_problem(sid("z", tenant="b"), 4) is None
    pins.release_all()
    assert not pins.tenant_pins and not pins.tenant_tokens and cache.protected_size() == 0


def test_expire_scans_only_once_a_pin_is_due():
    cache = cached(list(range(8)))
    pins = SessionPins(cache, max_pinned_tokens=100)
    pins.pin(sid("a"), list(range(4)), ttl_s=5)
    pins.pin(sid("b"), list(range(8)), ttl_s=50)
    now = time.monotonic()
    pins.expire(now=now + 1)
    assert len(pins) == 2
    pins.expire(now=now + 6)
    assert len(pins) == 1 and pins._next_expiry > now + 6
    pins.expire(now=now + 51)
    assert len(pins) == 0 and pins._next_expiry == float("inf")


def test_ttl_expiry_releases():
    cache = cached(list(range(8)))
    pins = SessionPins(cache, max_pinned_tokens=100)
    pins.pin(sid("s"), list(range(8)), ttl_s=5)
    pins.expire(now=time.monotonic() + 1)
    assert cache.protected_size() == 8
    pins.expire(now=time.monotonic() + 6)
    assert cache.protected_size() == 0 and pins.counts["expired"] == 1


def test_limit_releases_the_oldest_pin():
    cache = RadixCache()
    cache.insert([1] * 6, torch.arange(6))
    cache.insert([2] * 6, torch.arange(6, 12))
    cache.insert([3] * 6, torch.arange(12, 18))
    pins = SessionPins(cache, max_pinned_tokens=12)
    pins.pin(sid("a"), [1] * 6, 60)
    pins.pin(sid("b"), [2] * 6, 60)
    pins.pin(sid("c"), [3] * 6, 60)  # 18 > 12: "a" goes
    assert pins.pinned_tokens == 12 and pins.counts["evicted_for_limit"] == 1
    assert cache.match_prefix([1] * 6).last_node.lock_ref == 0
    assert pins.release_oldest() and pins.release(sid("c")) == 6 and not pins.release_oldest()


def test_zero_limit_or_ttl_pins_nothing():
    cache = cached(list(range(4)))
    SessionPins(cache, max_pinned_tokens=0).pin(sid("s"), list(range(4)), ttl_s=60)
    SessionPins(cache, max_pinned_tokens=10).pin(sid("s"), list(range(4)), ttl_s=0)
    assert cache.protected_size() == 0


# ---- the scheduler, tiny model ---------------------------------------------------------------------------
POOL = 512


@pytest.fixture
def sched(tiny_model_dir, default_tokenizer) -> Scheduler:
    return make_scheduler(tiny_model_dir, default_tokenizer, max_total_tokens=POOL, max_pinned_tokens=200)


def msg(
    rid: str, prompt: list[int], session: str | None = None, ttl: float = 60.0, tenant: str | None = None
) -> GenerateReq:
    return GenerateReq(
        rid=rid,
        input_ids=prompt,
        params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
        options=RequestOptions(session_id=session, cache_ttl_s=ttl if session else 0.0, tenant=tenant),
    )


def run(s: Scheduler, msgs: list[GenerateReq]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for m in msgs:
        s.handle(m)
    for _ in range(2000):
        if not s.has_work():
            break
        for o in s.step():
            assert o.error is None, o.error
            out.setdefault(o.rid, []).extend(o.new_token_ids)
        s.check_accounting()
    return out


def flood(s: Scheduler, n: int = 12) -> None:
    """Distinct prompts that together need more than the pool: LRU evicts whatever is not pinned."""
    run(s, [msg(f"flood{i}", [(7 * i + 13 * j) % 490 + 10 for j in range(60)]) for i in range(n)])


def test_scheduler_answers_429_past_a_tenant_pin_quota(tiny_model_dir, default_tokenizer):
    s = make_scheduler(tiny_model_dir, default_tokenizer, max_total_tokens=POOL, tenant_max_pins=1)
    run(s, [msg("a1", [5, 6, 7, 8], "one", tenant="a")])
    errors = {}
    for rid, session, tenant in (("a2", "two", "a"), ("a3", "one", "a"), ("b1", "two", "b")):
        s.handle(msg(rid, [5, 6, 7, 9], session, tenant=tenant))
    while s.has_work():
        for o in s.step():
            if o.error:
                errors[o.rid] = (o.error_status, o.error)
    assert list(errors) == ["a2"] and errors["a2"][0] == 429 and "--tenant-max-pins (1)" in errors["a2"][1]
    assert s.sessions.tenant_pins == {"a": 1, "b": 1}
    s.sessions.release_all()
    s.check_accounting()


@pytest.mark.parametrize("session", [None, "agent-1"])
def test_a_session_history_survives_memory_pressure(sched, session):
    history = [5] + [(11 * j) % 490 + 10 for j in range(99)]  # no flood prompt starts with 5
    first = run(sched, [msg("turn1", history, session)])["turn1"]
    flood(sched)
    nxt = msg("turn2", history + first + [7, 8, 9], session)
    sched.handle(nxt)
    sched.step()  # the extend: its match is decided now
    req = next(r for r in sched.live_requests() if r.rid == "turn2")
    if session:
        assert req.prefix_hit_len == len(history) + len(first) - 1  # the last output token had no KV
    else:
        assert req.prefix_hit_len < 10  # evicted by the flood
    run(sched, [])
    sched.handle(ReleaseSessionReq(session_id="agent-1"))
    sched.sessions.release_all()
    sched.check_accounting()
    assert sched.cm.cache.protected_size() == 0


def test_delete_and_expiry_release_every_slot(sched):
    run(sched, [msg("a", list(range(10, 90)), "s1"), msg("b", list(range(100, 180)), "s2", ttl=0.2)])
    info = sched.server_info()
    assert info["sessions_pinned"] == 2 and sched.cm.cache.protected_size() > 0
    reply = sched.handle(ReleaseSessionReq(session_id="s1"))
    assert reply.released_tokens > 0
    assert sched.handle(ReleaseSessionReq(session_id="s1")).released_tokens == 0
    time.sleep(0.3)
    run(sched, [msg("kick", [5])])  # a step expires "s2"
    assert sched.server_info()["sessions_pinned"] == 0
    assert sched.cm.cache.protected_size() == 0
    sched.check_accounting()


def test_pins_never_stall_admission(tiny_model_dir, default_tokenizer):
    """Pins hold most of a small pool; a request that needs it still runs (the oldest pins are dropped)."""
    s = make_scheduler(tiny_model_dir, default_tokenizer, max_total_tokens=POOL, max_pinned_tokens=POOL)
    run(s, [msg(f"p{i}", [(3 * i + 17 * j) % 480 + 20 for j in range(90)], f"s{i}") for i in range(5)])
    assert s.cm.cache.protected_size() > POOL // 2
    out = run(s, [msg("big", [4] + [(29 * j) % 490 + 15 for j in range(POOL - 41)])])
    assert len(out["big"]) == 4 and s.sessions.counts["evicted_for_memory"] >= 1


# ---- the cache-miss explainer ----------------------------------------------------------------------------
def explainer(tokens: list[int], salt=None, state="pinned", tenant=None) -> SessionPins:
    pins = SessionPins(RadixCache(), max_pinned_tokens=100)
    pins.remember(sid("s", salt, tenant), tokens, pinned=True)
    if state != "pinned":
        pins._records[sid("s", salt, tenant)].state = state
    return pins


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def test_explainer_names_a_diverged_history():
    prev = list(range(100, 140))  # previous prompt + output
    prompt = prev[:25] + [7] + prev[26:] + [1, 2, 3]  # history re-rendered with one token changed
    miss = explainer(prev).explain(sid("s", None), prompt, cached=25, decode=decode)
    assert miss["reason"] == "diverged" and miss["index"] == 25
    assert miss["previous_text"].split()[8] == "125" and miss["new_text"].split()[8] == "7"


def test_explainer_names_eviction_and_expiry():
    prev = list(range(100, 140))
    prompt = prev + [1, 2]
    assert explainer(prev).explain(sid("s", None), prompt, cached=39, decode=decode) is None  # all reused
    miss = explainer(prev).explain(sid("s", None), prompt, cached=10, decode=decode)
    assert (miss["reason"], miss["index"], miss["expected_cached_tokens"]) == ("evicted", 10, 39)
    assert explainer(prev, state="expired").explain(sid("s", None), prompt, 0, decode)["reason"] == "expired"
    # another salt's request naming the same session learns nothing of it (no text, no reason)
    assert explainer(prev, salt="a").explain(sid("s", "b"), prompt, 0, decode) is None
    assert explainer(prev, salt="a").explain(sid("s", None), prompt, 0, decode) is None
    assert explainer(prev, salt="a").explain(sid("s", "a"), prompt, 0, decode)["reason"] == "evicted"
    assert (
        explainer(prev).explain(sid("other", None), prompt, 0, decode) is None
    )  # no history: nothing to say
    # nor does another tenant's request of the same salt and session id
    assert explainer(prev, tenant="a").explain(sid("s", tenant="b"), prompt, 0, decode) is None
    assert explainer(prev, tenant="a").explain(sid("s", tenant="a"), prompt, 0, decode)["reason"] == "evicted"


def test_scheduler_reports_the_divergence_of_a_re_rendered_history(sched):
    history = [5] + [(11 * j) % 490 + 10 for j in range(79)]
    first = run(sched, [msg("t1", history, "sess")])["t1"]
    changed = list(history)
    changed[40] = 3  # one token of the history differs
    sched.handle(msg("t2", changed + first + [9], "sess"))
    outs = []
    while sched.has_work():
        outs += [o for o in sched.step() if o.rid == "t2"]
    miss = next(o.cache_miss for o in outs if o.cache_miss)
    assert miss["reason"] == "diverged" and miss["index"] == 40
    sched.sessions.release_all()
    sched.check_accounting()
