"""The live cache dashboard over HTTP (docs/dashboard.md): a real server with two tenants by key and an admin
tenant (--api-keys-file). `/dashboard/state` shows a tenant's shared prompt prefix as one node with the hit
count its requests made and leaves out the other tenant's prefix, requests and misses; the admin sees both;
the page and its assets need no key, the state and the event stream do (401)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess

KEYS = {"A": "dash-tenant-a-5e1c", "B": "dash-tenant-b-77f0", "OPS": "dash-admin-c3a9"}
REPEATS = 4  # requests sharing one prefix: the first computes it, the other three hit it


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> ServerProcess:
    keys_file = Path(tmp_path_factory.mktemp("dashboard")) / "keys"
    keys_file.write_text(f"{KEYS['A']} A\n{KEYS['B']} B\n{KEYS['OPS']} ops admin\n")
    keys_file.chmod(0o600)
    with ServerProcess(extra_args=["--api-keys-file", str(keys_file)]) as server:
        yield server


def shared_prefix(marker: str) -> str:
    words = " ".join(f"{marker}{i}" for i in range(60))
    return f"{marker} notes for the agent: {words}."


def run_shared(srv, who: str, prefix: str, n: int = REPEATS) -> list[dict]:
    """`n` requests, one after the other, sharing `prefix`; their meta_info."""
    metas = []
    for i in range(n):
        body = {"text": f"{prefix} Question {i}: what is item {i}?", "sampling_params": {"max_new_tokens": 3}}
        r = requests.post(srv.url + "/generate", json=body, headers=auth(who), timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200, r.text
        metas.append(r.json()["meta_info"])
    return metas


def state(srv, who: str, **params) -> dict:
    r = requests.get(srv.url + "/dashboard/state", params=params, headers=auth(who), timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def texts(st: dict) -> str:
    return "\n".join(n.get("text", "") for tree in st["trees"].values() for n in tree["nodes"])


@pytest.fixture(scope="module")
def prefixes(srv) -> dict[str, tuple[str, list[dict]]]:
    out = {}
    for who in ("A", "B"):
        marker = f"Z{who}{uuid.uuid4().hex[:6]}"
        out[who] = (marker, run_shared(srv, who, shared_prefix(marker)))
    return out


def test_the_page_is_public_and_the_state_needs_a_key(srv):
    page = requests.get(srv.url + "/dashboard", timeout=HTTP_TIMEOUT_S)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/dashboard/dashboard.js"' in page.text and "http" not in page.text.split("<body>")[1]
    for asset in ("dashboard.js", "dashboard.css"):
        r = requests.get(f"{srv.url}/dashboard/{asset}", timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200 and len(r.text) > 1000, asset
    for path in ("/dashboard/state", "/dashboard/events"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = requests.get(srv.url + path, headers=headers, timeout=HTTP_TIMEOUT_S)
            assert r.status_code == 401, (path, headers, r.text)
    r = requests.get(srv.url + "/dashboard/state", params={"max_nodes": 0}, headers=auth("A"), timeout=30)
    assert r.status_code == 400 and "max_nodes" in r.text


def test_the_shared_prefix_is_one_node_with_the_hit_count(srv, prefixes):
    marker, metas = prefixes["A"]
    assert metas[0]["cached_tokens"] == 0 and all(m["cached_tokens"] > 0 for m in metas[1:]), metas
    st = state(srv, "A")
    assert st["viewer"] == {"tenant": "A", "admin": False}
    top = [n for n in st["trees"]["device"]["nodes"] if n["parent"] == 0 and not n.get("aggregate")]
    assert len(top) == 1, top  # everything A sent starts with its one shared prefix
    node = top[0]
    assert node["hits"] == REPEATS - 1, node
    # the node ends where the second request's match ended: the prompts' common prefix
    assert node["tokens"] == min(m["cached_tokens"] for m in metas[1:]), (node, metas)
    assert marker in node["text"] and node["tier"] == "device"
    assert node["subtree_tokens"] >= node["tokens"] + REPEATS  # each request's own tail hangs below it


def test_a_tenant_never_sees_the_other_tenants_prefix_requests_or_misses(srv, prefixes):
    (a_marker, _), (b_marker, _) = prefixes["A"], prefixes["B"]
    a, b, ops = state(srv, "A"), state(srv, "B"), state(srv, "OPS")
    assert a_marker in texts(a) and b_marker not in texts(a)
    assert b_marker in texts(b) and a_marker not in texts(b)
    assert a_marker in texts(ops) and b_marker in texts(ops) and ops["viewer"]["admin"] is True
    assert a["misses"] and {m["tenant"] for m in a["misses"]} == {"A"}
    assert {m["tenant"] for m in b["misses"]} == {"B"}
    assert {m["tenant"] for m in ops["misses"]} >= {"A", "B"}
    assert all(r["tenant"] == "A" for r in a["requests"])
    # the pool adds up, and its history grows as the state is read
    pool = a["pool"]
    assert pool["used"] + pool["pinned"] + pool["evictable"] + pool["free"] == pool["total"] > 0
    assert len(ops["history"]) >= 1 and {"hit_rate", "tokens_saved", "free"} <= set(ops["history"][-1])
    assert ops["cache"]["tokens_saved"] >= sum(m["cached_tokens"] for _, ms in prefixes.values() for m in ms)


def test_the_event_stream_sends_the_state_about_once_a_second(srv, prefixes):
    with requests.get(srv.url + "/dashboard/events", headers=auth("B"), stream=True, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events, name = [], None
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                if len(events) == 3:
                    break
    assert [n for n, _ in events] == ["state"] * 3
    times = [s["time"] for _, s in events]
    assert 0.5 < times[2] - times[0] < 6, times
    assert all(s["viewer"]["tenant"] == "B" for _, s in events)
    assert prefixes["B"][0] in texts(events[-1][1]) and prefixes["A"][0] not in texts(events[-1][1])


# ---- last: it stops the module's server ----
def test_sigterm_ends_an_open_event_stream_and_the_server_exits(srv):
    """A page left open must not hold a graceful shutdown: on SIGTERM the stream ends and the server exits
    at once, not after the stop's grace period."""
    import threading
    import time

    ended = threading.Event()

    def watch():
        with requests.get(srv.url + "/dashboard/events", headers=auth("A"), stream=True, timeout=60) as r:
            for _ in r.iter_lines():
                pass
        ended.set()

    threading.Thread(target=watch, daemon=True).start()
    time.sleep(2)  # the stream is open and has sent its first state
    t0 = time.monotonic()
    assert srv.stop(grace_s=30) == 0, srv.log_tail()
    assert time.monotonic() - t0 < 15 and ended.wait(5)
