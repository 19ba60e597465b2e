"""`priority` (vLLM's field): waiting requests of a lower value are admitted first, in the policy's order
within a priority, and the starvation bound still puts an overdue request first; a waiting request that
cannot start preempts a running one of a higher value."""

from __future__ import annotations

import time

import pytest

from runtime.managers.scheduler.schedule_policy import OVERDUE_AFTER_S, order_waiting
from runtime.messages import GenerateReq, RequestOptions
from runtime.sampling_params import SamplingParams
from tests.scheduler_utils import make_scheduler
from tests.unit.test_host_tier import cache_tokens, make_cm, make_req


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
def test_lower_priority_values_come_first_in_the_policys_order(policy):
    cm = make_cm(pool=64, host=32)
    cached = list(range(100, 110))
    cache_tokens(cm, cached)
    hit, cold, urgent_cold, urgent_hit = (
        make_req(cached + [1]),
        make_req([7, 8, 9]),
        make_req([5, 6]),
        make_req(cached + [2]),
    )
    now = time.monotonic()
    for k, r in enumerate((hit, cold, urgent_cold, urgent_hit)):
        r.arrival = now + k
    urgent_cold.options = urgent_hit.options = RequestOptions(priority=-1)
    ordered, _ = order_waiting(policy, [hit, cold, urgent_cold, urgent_hit], cm)
    ids = [id(r) for r in ordered]
    assert set(ids[:2]) == {id(urgent_cold), id(urgent_hit)} and set(ids[2:]) == {id(hit), id(cold)}
    if policy == "lpm":  # the longest cached prefix first within each priority
        assert ordered == [urgent_hit, urgent_cold, hit, cold]
    if policy == "fcfs":
        assert ordered == [urgent_cold, urgent_hit, hit, cold]


def test_an_overdue_request_goes_first_whatever_its_priority():
    cm = make_cm(pool=64, host=32)
    old, urgent = make_req([1, 2, 3]), make_req([4, 5, 6])
    old.arrival, urgent.arrival = time.monotonic() - OVERDUE_AFTER_S - 1, time.monotonic()
    old.options, urgent.options = RequestOptions(priority=5), RequestOptions(priority=-5)
    assert order_waiting("lpm", [urgent, old], cm)[0] == [old, urgent]
    assert order_waiting("fcfs", [urgent, old], cm)[0] == [urgent, old]  # fcfs has no starvation rule


# ---- the scheduler, tiny model -----------------------------------------------------------------------------
def _msg(rid: str, prompt: list[int], max_new: int, priority: int) -> GenerateReq:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return GenerateReq(rid=rid, input_ids=prompt, params=params, options=RequestOptions(priority=priority))


def test_a_waiting_request_of_lower_priority_value_preempts_running_ones(tiny_model_dir, default_tokenizer):
    """Two background requests fill the running rows; an urgent one arrives: one background request is
    retracted (its output kept), the urgent one finishes first, and both background ones still finish."""
    s = make_scheduler(tiny_model_dir, default_tokenizer, max_running_requests=2, max_total_tokens=1024)
    for i in range(2):
        s.handle(_msg(f"bg{i}", [10 + i, 11, 12, 13], max_new=40, priority=5))
    for _ in range(3):
        s.step()
    assert len(s.running) == 2
    s.handle(_msg("urgent", [20, 21, 22], max_new=4, priority=-1))
    finished: list[str] = []
    tokens: dict[str, int] = {}
    for _ in range(500):
        if not s.has_work():
            break
        for o in s.step():
            assert o.error is None, o.error
            tokens[o.rid] = tokens.get(o.rid, 0) + len(o.new_token_ids)
            if o.finished_reason is not None:
                finished.append(o.rid)
        s.check_accounting()
    assert finished[0] == "urgent" and sorted(finished) == ["bg0", "bg1", "urgent"]
    assert tokens == {"bg0": 40, "bg1": 40, "urgent": 4}  # the retracted one lost no output
    info = s.server_info()
    assert info["priority_preemptions"] == 1 and info["retractions"] >= 1


def test_equal_priorities_never_preempt(tiny_model_dir, default_tokenizer):
    s = make_scheduler(tiny_model_dir, default_tokenizer, max_running_requests=1, max_total_tokens=1024)
    s.handle(_msg("first", [10, 11, 12], max_new=20, priority=0))
    s.step()
    s.handle(_msg("second", [20, 21, 22], max_new=2, priority=0))
    while s.has_work():
        s.step()
    assert s.server_info()["priority_preemptions"] == 0
