"""The live cache dashboard's state (`GET /dashboard/state`), built in the scheduler process.

`DashboardTracker` keeps what the scheduler would otherwise forget: per radix node, the admitted requests
whose cached prefix ended there (a node's hit count is the sum over its subtree), which tenants used each
cache scope (a salted key's high 32 bits), the last cache misses, and a short history of the KV pool, sampled
when the state is read (at most every `SAMPLE_EVERY_S`), so the dashboard costs the scheduler nothing while
nobody watches. Per admitted request it costs one dict update.

`state(scheduler, tenant, admin)` answers one viewer: the radix tree reduced to at most `max_nodes` nodes
(`aggregate_tree`: the largest subtrees by tokens first, the rest of a node's children folded into one
"others" node), walking at most `MAX_VISIT` nodes per call however large the tree is (the rest of the tree is
reported as unexplored); requests, misses and prefixes of other tenants are left out unless `admin`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from runtime.mem_cache.radix_cache import TreeNode

MAX_VISIT = 8192  # radix nodes walked per state call, at most (per tree)
MAX_NODES = 160  # nodes sent per tree, at most (the page's picture), "others" nodes included
MAX_REQUESTS = 64  # request rows sent, at most
MAX_MISSES = 32  # cache misses remembered (each tenant sees its own among them)
MAX_SCOPES = 4096  # cache scopes whose tenants are remembered (least recently used dropped)
MAX_HIT_NODES = 1 << 16  # past this many hit records, those of nodes gone from the tree are dropped
HISTORY = 120  # pool samples kept: two minutes at one a second
SAMPLE_EVERY_S = 0.9
SNIPPET_TOKENS = 16  # tokens of a node's own key decoded for its label
SNIPPET_CHARS = 48
TOKEN_MASK = 0xFFFFFFFF  # a salted key element is token id + (salt hash + 1) << 32 (`Req.cache_key`)


def scope_of(key_element: int) -> int:
    """The cache scope of a radix key element: 0 unsalted, else the salt's hash + 1."""
    return key_element >> 32


class Walk:
    """The visited part of a tree, breadth-first, as parallel lists (index i: one node). A node's children
    are the contiguous indices first[i] .. first[i] + kids[i] - 1; the root's children are 0 .. top - 1."""

    __slots__ = (
        "nodes",
        "parent",
        "first",
        "kids",
        "unexplored",
        "sub_tokens",
        "sub_nodes",
        "sub_hits",
        "top",
    )

    def __init__(self) -> None:
        self.nodes: list[TreeNode] = []
        self.parent: list[int] = []  # -1: a child of the root
        self.first: list[int] = []
        self.kids: list[int] = []
        self.unexplored: list[int] = []  # children (and their subtrees) the budget left unvisited
        self.sub_tokens: list[int] = []
        self.sub_nodes: list[int] = []
        self.sub_hits: list[int] = []
        self.top = 0

    def __len__(self) -> int:
        return len(self.nodes)

    def children(self, i: int) -> range:
        return range(self.first[i], self.first[i] + self.kids[i])


def walk_tree(
    root: TreeNode, visible: Callable[[TreeNode], bool], hits: dict[int, int], max_visit: int = MAX_VISIT
) -> tuple[Walk, bool]:
    """Breadth-first over at most `max_visit` nodes under `root` whose top node is `visible`; subtree sums
    bottom-up. Returns the walk and whether every visible node was visited."""
    w = Walk()
    nodes, parent = w.nodes, w.parent
    complete = True
    for child in root.children.values():
        if visible(child):
            if len(nodes) >= max_visit:
                complete = False  # more visible tops than the budget: the rest is unexplored
                break
            nodes.append(child)
            parent.append(-1)
    w.top = len(nodes)
    first, kids, unexplored = w.first, w.kids, w.unexplored
    i = 0
    while i < len(nodes):
        children = nodes[i].children
        room = max_visit - len(nodes)
        first.append(len(nodes))
        if len(children) > room:  # the budget's edge: count what is left unvisited, without walking it
            taken = list(itertools.islice(children.values(), max(room, 0)))
            unexplored.append(len(children) - len(taken))
            complete = False
        else:
            taken = children.values()
            unexplored.append(0)
        before = len(nodes)
        nodes.extend(taken)
        kids.append(len(nodes) - before)
        parent.extend(itertools.repeat(i, len(nodes) - before))
        i += 1
    tokens = w.sub_tokens = [len(n.key) for n in nodes]
    counts = w.sub_nodes = [1] * len(nodes)
    get = hits.get
    sub_hits = w.sub_hits = [get(n.id, 0) for n in nodes] if hits else [0] * len(nodes)
    for j in range(len(nodes) - 1, w.top - 1, -1):  # children come after their parent in BFS order
        p = parent[j]
        tokens[p] += tokens[j]
        counts[p] += counts[j]
        sub_hits[p] += sub_hits[j]
    return w, complete


def aggregate_tree(
    w: Walk, max_nodes: int, describe: Callable[[TreeNode], dict[str, Any]]
) -> list[dict[str, Any]]:
    """At most `max_nodes` rows of the walked tree: the largest subtrees (by tokens) first, each shown node's
    remaining children folded into one row {"aggregate": n nodes}. Rows are parents before children; a row's
    `parent` is another row's `id` (0: the root). `describe(node)` adds the label fields of a shown node."""
    rows: list[dict[str, Any]] = []
    shown: set[int] = set()
    size, nodes, parent = w.sub_tokens, w.nodes, w.parent
    # rows so far: the shown nodes, plus one "others" row per parent (the root: -1) with a child not shown
    unshown = {-1: w.top}
    count = 1 if w.top else 0
    ranked: dict[int, list[int]] = {-1: sorted(range(w.top), key=size.__getitem__, reverse=True)}
    # candidates: each parent's largest child not yet taken (its successor is pushed when it is popped)
    heap = [(-size[ranked[-1][0]], nodes[ranked[-1][0]].id, -1, 0)] if w.top else []
    skips = 0
    while heap and count < max_nodes and skips < 64:
        _, _, up, k = heapq.heappop(heap)
        siblings = ranked[up]
        i = siblings[k]
        if k + 1 < len(siblings):
            nxt = siblings[k + 1]
            heapq.heappush(heap, (-size[nxt], nodes[nxt].id, up, k + 1))
        # showing it: one row, one more "others" row for its children, one fewer if it was its parent's last
        delta = 1 + (1 if w.kids[i] else 0) - (1 if unshown[up] == 1 else 0)
        if count + delta > max_nodes:
            skips += 1
            continue  # stays folded; a smaller candidate may still fit
        count += delta
        unshown[up] -= 1
        shown.add(i)
        unshown[i] = w.kids[i]
        if w.kids[i]:
            ranked[i] = sorted(w.children(i), key=size.__getitem__, reverse=True)
            heapq.heappush(heap, (-size[ranked[i][0]], nodes[ranked[i][0]].id, i, 0))
    folded: dict[int, dict[str, Any]] = {}  # parent index (-1: root) -> its "others" row
    candidates = sorted(shown)  # BFS order: parents first
    for i in candidates:
        p = parent[i]
        rows.append(
            {
                "id": nodes[i].id,
                "parent": 0 if p < 0 else nodes[p].id,
                "tokens": len(nodes[i].key),
                "subtree_tokens": size[i],
                "subtree_nodes": w.sub_nodes[i],
                "hits": w.sub_hits[i],
                "unexplored_children": w.unexplored[i],
                **describe(nodes[i]),
            }
        )
    # an "others" row holds what its parent's children hold, less its shown children: O(rows), not O(walk)
    rest: dict[int, list[int]] = {}  # parent index -> [tokens, nodes, hits] of its children
    top = w.top
    rest[-1] = [sum(size[:top]), sum(w.sub_nodes[:top]), sum(w.sub_hits[:top])]
    for i in candidates:
        own_hits = w.sub_hits[i] - sum(w.sub_hits[j] for j in w.children(i)) if w.kids[i] else w.sub_hits[i]
        rest[i] = [size[i] - len(nodes[i].key), w.sub_nodes[i] - 1, w.sub_hits[i] - own_hits]
    for i in candidates:
        r = rest[parent[i]]
        r[0] -= size[i]
        r[1] -= w.sub_nodes[i]
        r[2] -= w.sub_hits[i]
    for up in [-1, *candidates]:
        if unshown.get(up, 0) <= 0:
            continue
        parent_id = 0 if up < 0 else nodes[up].id
        tokens, count_nodes, hits = rest[up]
        folded[up] = {
            "id": -(parent_id + 1),  # one "others" row per parent; negative ids never clash
            "parent": parent_id,
            "aggregate": unshown[up],
            "tokens": tokens,
            "subtree_tokens": tokens,
            "subtree_nodes": count_nodes,
            "hits": hits,
        }
    rows.extend(folded.values())
    return rows


class DashboardTracker:
    def __init__(self, cache=None) -> None:
        self.cache = cache  # the device radix cache: its live node ids bound `hits` (None: unbounded, tests)
        self.hits: dict[int, int] = {}  # radix node id -> admitted requests whose cached prefix ended there
        self._prune_at = MAX_HIT_NODES
        self.scopes: OrderedDict[int, set[str | None]] = OrderedDict()  # cache scope -> tenants that used it
        self.misses: deque[dict[str, Any]] = deque(maxlen=MAX_MISSES)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self._last_sample = 0.0
        self._last_counts = (0, 0)  # (prompt tokens, cached tokens) at the last sample

    # ---- fed by the scheduler -------------------------------------------------------------------------
    def admitted(self, req) -> None:
        """A first admission: its hit (where its cached prefix ends), its scope's tenant, its miss."""
        tenant = req.options.tenant
        scope = scope_of(req.cache_key(1)[0]) if req.prompt_ids else 0
        users = self.scopes.get(scope)
        if users is None:
            users = self.scopes[scope] = set()
            if len(self.scopes) > MAX_SCOPES:
                self.scopes.popitem(last=False)
        else:
            self.scopes.move_to_end(scope)
        if len(users) < 64:
            users.add(tenant)
        node = req.locked_node
        if req.prefix_hit_len > 0 and node is not None and node.parent is not None:
            self.hits[node.id] = self.hits.get(node.id, 0) + 1
            if len(self.hits) > self._prune_at and self.cache is not None:
                # evicted nodes' records go: one walk of the tree each time the records double, at most
                self.prune({n.id for n in self.cache._nodes()})
                self._prune_at = max(MAX_HIT_NODES, 2 * len(self.hits))
        miss = req.cache_miss
        if miss is not None or req.prefix_hit_len == 0:
            self.misses.append(
                {
                    "time": time.time(),
                    "rid": req.rid[:64],
                    "tenant": tenant,
                    "session_id": (req.session_id or "")[:64] or None,
                    "prompt_tokens": len(req.prompt_ids),
                    "cached_tokens": req.prefix_hit_len,
                    # the explainer's (`sessions.explain`): expired, evicted, diverged; "cold": nothing cached
                    # and no session record to explain it
                    "reason": miss["reason"] if miss is not None else "cold",
                    **({"explanation": miss} if miss is not None else {}),
                }
            )

    def prune(self, live_ids: set[int]) -> None:
        """Forget the hits of nodes gone from the tree (after a walk that saw all of it)."""
        if len(self.hits) > len(live_ids):
            self.hits = {k: v for k, v in self.hits.items() if k in live_ids}

    # ---- read by a viewer -----------------------------------------------------------------------------
    def sees(self, tenant: str | None, admin: bool) -> Callable[[TreeNode], bool]:
        if admin:
            return lambda node: True
        scopes = self.scopes

        def visible(node: TreeNode) -> bool:
            users = scopes.get(scope_of(node.key[0])) if node.key else None
            return users is not None and tenant in users

        return visible

    def sample(self, scheduler, now: float | None = None) -> None:
        """One point of the pool history, at most every SAMPLE_EVERY_S."""
        now = time.monotonic() if now is None else now
        if self.history and now - self._last_sample < SAMPLE_EVERY_S:
            return
        self._last_sample = now
        self.history.append({"time": time.time(), **pool_usage(scheduler), **self._rates(scheduler.stats)})

    def _rates(self, stats) -> dict[str, Any]:
        prompt, cached = stats["prompt_tokens"], stats["cached_tokens"]
        dp, dc = prompt - self._last_counts[0], cached - self._last_counts[1]
        self._last_counts = (prompt, cached)
        return {
            "hit_rate": cached / prompt if prompt else 0.0,  # since start
            "hit_rate_recent": dc / dp if dp > 0 else None,  # since the previous point (None: no prompts)
            "tokens_saved": cached,  # prompt tokens served from the cache since start
        }


def pool_usage(scheduler) -> dict[str, int]:
    """The device KV pool split four ways that add up to its size: held by requests, pinned by sessions,
    cached and evictable, free."""
    cm = scheduler.cm
    size, free = cm.allocator.size, cm.allocator.available()
    evictable = cm.cache.evictable_size()
    pinned = min(scheduler.sessions.pinned_tokens, cm.cache.protected_size())
    return {
        "total": size,
        "used": max(0, size - free - evictable - pinned),
        "evictable": evictable,
        "pinned": pinned,
        "free": free,
    }


def _grammar_kind(params) -> str | None:
    for kind in ("regex", "json_schema", "lark"):
        if getattr(params, kind, None) is not None:
            return kind
    return None


def request_rows(scheduler, tenant: str | None, admin: bool) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The live requests a viewer may see (at most MAX_REQUESTS rows) and how many there are per state."""
    rows: list[dict[str, Any]] = []
    counts = {"running": 0, "prefill": 0, "waiting": 0, "grammar": 0}
    now = time.monotonic()
    queues = (
        ("running", scheduler.running),
        ("prefill", scheduler.reextend),
        ("waiting", scheduler.waiting),
        ("grammar", scheduler.grammar_wait),
    )
    for state, queue in queues:
        for req in queue:
            if not admin and req.options.tenant != tenant:
                continue
            counts[state] += 1
            if len(rows) >= MAX_REQUESTS:
                continue
            spec = req.spec
            rows.append(
                {
                    "rid": req.rid[:64],
                    "state": state,
                    "tenant": req.options.tenant,
                    "session_id": (req.session_id or "")[:64] or None,
                    "prompt_tokens": len(req.prompt_ids),
                    "output_tokens": len(req.output_ids),
                    "max_tokens": req.params.max_new_tokens,
                    "cached_tokens": req.prefix_hit_len,
                    "age_s": round(now - req.arrival, 3),
                    "grammar": _grammar_kind(req.params),
                    # steering to the grammar's end within max_tokens (`GrammarManager.closing_token`)
                    "grammar_closing": bool(getattr(req.closing, "steering", False)),
                    "spec": None
                    if spec is None
                    else {"verify_steps": spec.verify_steps, "accepted": spec.accepted, "draft_len": spec.k},
                }
            )
    return rows, counts


def _describer(decode: Callable[[list[int]], str], pinned: set[int], tier: str):
    def describe(node: TreeNode) -> dict[str, Any]:
        ids = [k & TOKEN_MASK for k in node.key[:SNIPPET_TOKENS]]
        try:
            text = decode(ids)
        except Exception:  # an id the tokenizer cannot decode: show none rather than fail the state
            text = ""
        if len(text) > SNIPPET_CHARS:
            text = text[:SNIPPET_CHARS] + "…"
        return {
            "text": text,
            "tier": tier,
            "pinned": node.id in pinned,
            "locked": node.lock_ref > 0,
            "salted": bool(node.key) and scope_of(node.key[0]) != 0,
        }

    return describe


def _pinned_ids(scheduler, host: bool) -> set[int]:
    """Ids of the nodes on the session pins' paths (device pins, or host-tier pins with `host`)."""
    out: set[int] = set()
    for pin in list(scheduler.sessions._pins.values())[:1024]:
        if pin.on_host != host:
            continue
        node = pin.node
        while node is not None and node.parent is not None and node.id not in out:
            out.add(node.id)
            node = node.parent
    return out


def tree_state(
    tracker: DashboardTracker,
    root: TreeNode,
    visible,
    decode,
    pinned: set[int],
    tier: str,
    max_nodes: int,
    prune: bool = False,
) -> dict[str, Any]:
    walk, complete = walk_tree(root, visible, tracker.hits if tier == "device" else {})
    if prune and complete:
        tracker.prune({n.id for n in walk.nodes})
    rows = aggregate_tree(walk, max_nodes, _describer(decode, pinned, tier))
    return {
        "nodes": rows,
        "visited_nodes": len(walk),
        "complete": complete,
        "tokens": sum(walk.sub_tokens[: walk.top]),
    }


def dashboard_state(
    scheduler, tracker: DashboardTracker, tenant: str | None, admin: bool, max_nodes: int = MAX_NODES
) -> dict[str, Any]:
    """The state one viewer sees (docs/dashboard.md describes every field)."""
    t0 = time.perf_counter()
    tracker.sample(scheduler)
    decode = scheduler.tokenizer.decode
    visible = tracker.sees(tenant, admin)
    max_nodes = max(1, min(max_nodes, 1000))
    cm = scheduler.cm
    trees = {
        "device": tree_state(
            tracker, cm.cache.root, visible, decode, _pinned_ids(scheduler, False), "device", max_nodes, admin
        )
    }
    if cm.host is not None:
        trees["host"] = tree_state(
            tracker, cm.host.tree.root, visible, decode, _pinned_ids(scheduler, True), "host", max_nodes
        )
    requests, counts = request_rows(scheduler, tenant, admin)
    stats = scheduler.stats
    prompt = stats["prompt_tokens"]
    grammar = scheduler.grammars.stats()
    return {
        "time": time.time(),
        "viewer": {"tenant": tenant, "admin": admin},
        "pool": pool_usage(scheduler),
        "history": list(tracker.history),
        "cache": {
            "hit_rate": stats["cached_tokens"] / prompt if prompt else 0.0,
            "prompt_tokens": prompt,
            "tokens_saved": stats["cached_tokens"],
            "radix_nodes": cm.cache.num_nodes(),
            "host_tier_tokens": cm.host.tree.total_size() if cm.host is not None else 0,
            "sessions_pinned": len(scheduler.sessions),
            "session_pinned_tokens": scheduler.sessions.pinned_tokens,
        },
        "trees": trees,
        "requests": requests,
        "request_counts": counts,
        "misses": [m for m in reversed(tracker.misses) if admin or m["tenant"] == tenant],
        "grammar": {
            "waiting_requests": counts["grammar"],
            "queued": grammar.get("queued", 0),
            "running": grammar.get("running", 0),
            "backend": grammar.get("backend"),
            "stats": grammar,
        },
        "speculative": None
        if scheduler.spec is None
        else {
            "algorithm": scheduler.args.speculative_algorithm,
            "draft_steps": stats["spec_draft_steps"],
            "verified_drafts": stats["spec_verified_drafts"],
            "accepted_tokens": stats["spec_accepted_tokens"],
        },
        "build_ms": round((time.perf_counter() - t0) * 1000, 3),
    }
