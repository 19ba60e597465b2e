"""`priority` (vLLM's field): waiting requests of a lower value are admitted first, in the policy's order
within a priority, and the starvation bound still puts an overdue request first."""

from __future__ import annotations

import time

import pytest

from runtime.managers.scheduler.schedule_policy import OVERDUE_AFTER_S, order_waiting
from runtime.messages import RequestOptions
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
