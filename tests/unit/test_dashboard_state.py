"""The dashboard's state in the scheduler process (`managers/scheduler/dashboard_state.py`): the radix tree
reduced to a bounded number of rows with its tokens and hits conserved, the walk's budget on a 100k-node tree,
and the tenant filter over prefixes (salted keys), requests and misses."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from runtime.managers.scheduler import dashboard_state as ds
from runtime.managers.scheduler.req import Req
from runtime.mem_cache.radix_cache import RadixCache
from runtime.messages import RequestOptions
from runtime.sampling_params import SamplingParams
from runtime.tenants import scoped_salt

SHARED = list(range(1000, 1200))  # a 200-token "system prompt"


def req_of(prompt: list[int], tenant: str | None = None, salt: str | None = None, rid: str = "r") -> Req:
    options = RequestOptions(tenant=tenant, cache_salt=scoped_salt(tenant, salt))
    return Req(rid=rid, prompt_ids=list(prompt), params=SamplingParams(max_new_tokens=8), options=options)


def insert(cache: RadixCache, req: Req) -> None:
    key = req.cache_key(len(req.prompt_ids))
    cache.insert(key, torch.arange(len(key)))


def admit(cache: RadixCache, tracker: ds.DashboardTracker, req: Req) -> None:
    """What the scheduler does at a first admission: match, lock the match's end, tell the tracker."""
    key = req.cache_key(len(req.prompt_ids))
    m = cache.match_prefix(key[:-1])
    node = cache.exact_node(m.last_node, len(m.indices)) if len(m.indices) else cache.root
    req.locked_node, req.prefix_hit_len = node, len(m.indices)
    tracker.admitted(req)


def rows_of(cache, tracker, tenant=None, admin=True, max_nodes=ds.MAX_NODES, max_visit=ds.MAX_VISIT):
    walk, complete = ds.walk_tree(cache.root, tracker.sees(tenant, admin), tracker.hits, max_visit)
    rows = ds.aggregate_tree(walk, max_nodes, lambda node: {"text": str(node.key[0] & ds.TOKEN_MASK)})
    return rows, walk, complete


def test_the_shared_prefix_is_one_node_with_its_hit_count_and_the_rest_is_folded():
    cache, tracker = RadixCache(), ds.DashboardTracker()
    for i in range(300):  # one shared prefix, then 300 small distinct suffixes: 299 hit the prefix
        req = req_of(SHARED + [5000 + i, 6000 + i, 7000 + i], rid=f"r{i}")
        admit(cache, tracker, req)
        insert(cache, req)
    for i in range(50):  # unrelated prompts beside it
        insert(cache, req_of([20000 + 10 * i + j for j in range(4)]))
    rows, stats, complete = rows_of(cache, tracker, max_nodes=12)
    assert complete and len(stats) == cache.num_nodes()
    assert len(rows) <= 12
    ids = {r["id"] for r in rows} | {0}
    assert all(r["parent"] in ids for r in rows)  # every row's parent is a row (or the root)
    seen = set()
    for r in rows:  # parents come before children
        assert r["parent"] == 0 or r["parent"] in seen
        seen.add(r["id"])
    shared = max((r for r in rows if r["parent"] == 0), key=lambda r: r["subtree_tokens"])
    assert shared["tokens"] == len(SHARED) and shared["hits"] == 299
    assert shared["subtree_tokens"] == len(SHARED) + 300 * 3
    # tokens and hits are conserved by the folding: the top rows add up to the whole cache
    top = [r for r in rows if r["parent"] == 0]
    assert sum(r["subtree_tokens"] for r in top) == cache.total_size()
    assert sum(r["hits"] for r in top) == 299
    folded = [r for r in rows if r.get("aggregate")]
    assert folded and all(r["id"] < 0 for r in folded)
    under_shared = [r for r in rows if r["parent"] == shared["id"]]
    assert sum(r["subtree_tokens"] for r in under_shared) == 300 * 3
    assert sum(r.get("aggregate", 1) for r in under_shared) == 300


def test_hits_follow_splits_and_are_forgotten_with_their_nodes():
    cache, tracker = RadixCache(), ds.DashboardTracker()
    first = req_of(SHARED + [1, 2, 3])
    admit(cache, tracker, first)  # a cold miss: no hit
    insert(cache, first)
    assert tracker.misses[-1]["reason"] == "cold" and not tracker.hits
    second = req_of(SHARED + [1, 9, 9])  # ends inside the first's node: the match's end is split off
    admit(cache, tracker, second)
    insert(cache, second)
    third = req_of(SHARED[:100] + [7])  # a shorter prefix: one more split above
    admit(cache, tracker, third)
    insert(cache, third)
    rows, _, _ = rows_of(cache, tracker)
    by_tokens = {r["tokens"]: r for r in rows}
    assert by_tokens[100]["hits"] == 2  # both later requests read the first 100 tokens
    assert by_tokens[101]["hits"] == 1  # the rest of SHARED + [1]: the second request only
    cache.evict(cache.total_size())
    _, stats, complete = rows_of(cache, tracker)
    assert complete and not stats
    tracker.prune({n.id for n in stats.nodes})
    assert tracker.hits == {}


def test_hit_records_of_evicted_nodes_are_dropped_past_the_cap(monkeypatch):
    monkeypatch.setattr(ds, "MAX_HIT_NODES", 8)
    cache = RadixCache()
    tracker = ds.DashboardTracker(cache)
    for i in range(40):  # each round: a prefix, a request that hits it, then all of it evicted
        stem = [50_000 + i] * 4
        insert(cache, req_of(stem + [1]))
        admit(cache, tracker, req_of(stem + [2]))
        assert len(tracker.hits) <= 2 * 8 + 1
        cache.evict(cache.total_size())
    assert tracker.hits and all(isinstance(k, int) for k in tracker.hits)


def test_a_tenant_sees_only_its_own_prefixes_and_the_admin_sees_all():
    cache, tracker = RadixCache(), ds.DashboardTracker()
    a = req_of(SHARED + [1], tenant="A", rid="a1")
    a_salted = req_of(SHARED + [2], tenant="A", salt="s", rid="a2")  # a client salt within A's scope
    b = req_of(SHARED + [3], tenant="B", rid="b1")
    plain = req_of(SHARED + [4], rid="p1")  # no tenant (--api-key): unsalted
    for req in (a, a_salted, b, plain):
        admit(cache, tracker, req)
        insert(cache, req)
    assert len(cache.root.children) == 4  # the same text, four scopes: no node is shared

    def tops(tenant, admin):
        rows, _, _ = rows_of(cache, tracker, tenant, admin)
        return sorted(ds.scope_of(_node_key(cache, r["id"])) for r in rows if r["parent"] == 0)

    scope = {r.rid: ds.scope_of(r.cache_key(1)[0]) for r in (a, a_salted, b, plain)}
    assert tops("A", False) == sorted([scope["a1"], scope["a2"]])
    assert tops("B", False) == [scope["b1"]]
    assert tops(None, False) == [scope["p1"]] == [0]
    assert tops("C", False) == []  # a tenant that sent nothing sees nothing
    assert tops("B", True) == sorted(scope.values())
    # a scope the tracker never heard of (its record dropped, or a disk-tier load) is the admin's alone
    tracker.scopes.clear()
    assert tops("A", False) == [] and len(tops(None, True)) == 4


def _node_key(cache: RadixCache, node_id: int) -> int:
    return next(n.key[0] for n in cache._nodes() if n.id == node_id)


def test_requests_and_misses_are_filtered_by_tenant():
    cache, tracker = RadixCache(), ds.DashboardTracker()
    reqs = [req_of([1, 2, 3], tenant=t, rid=f"{t}-{i}") for i, t in enumerate(["A", "B", "A", None])]
    for req in reqs:
        admit(cache, tracker, req)
    sched = SimpleNamespace(running=reqs[:2], reextend=[], waiting=reqs[2:], grammar_wait=[])
    rows, counts = ds.request_rows(sched, "A", False)
    assert [r["rid"] for r in rows] == ["A-0", "A-2"] and counts == dict(
        running=1, prefill=0, waiting=1, grammar=0
    )
    assert rows[0]["max_tokens"] == 8 and rows[0]["output_tokens"] == 0
    rows, counts = ds.request_rows(sched, None, True)
    assert len(rows) == 4 and counts["running"] == 2 and counts["waiting"] == 2
    misses = [m for m in tracker.misses if m["tenant"] == "B"]
    assert [m["rid"] for m in misses] == ["B-1"]


def test_the_walk_of_a_100k_node_tree_is_bounded():
    cache, tracker = RadixCache(), ds.DashboardTracker()
    for i in range(400):  # 400 prompts x 250 branches: about 100k nodes
        stem = [100_000 + i, 200_000 + i]
        insert(cache, req_of(stem))
        for j in range(250):
            insert(cache, req_of(stem + [300_000 + j]))
    assert cache.num_nodes() >= 100_000
    t0 = time.perf_counter()
    rows, stats, complete = rows_of(cache, tracker, max_nodes=ds.MAX_NODES)
    elapsed = time.perf_counter() - t0
    assert not complete and len(stats) == ds.MAX_VISIT and len(rows) <= ds.MAX_NODES
    assert sum(stats.unexplored) > 0  # the budget's edge is reported, not hidden
    print(f"100k-node tree: {len(stats)} nodes walked, {len(rows)} rows in {elapsed * 1000:.1f} ms")
