"""`--dp-size 2`: two real replicas behind a real sglang-router (`cache_aware`), on the default model.

Requests that share a long prefix must all land on one replica and report the prefix as cached; the router
must pass our worker contract (native and OpenAI routes, SSE ending in `data: [DONE]`, /flush_cache); after
one replica is killed, later requests must succeed on the other; and when the router dies, the server exits
1 with no process left behind. The tests run in file order on one server (the last two end it). Skipped
only when sglang-router (the `router` extra) is not installed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, descendants, free_port

pytest.importorskip(
    "sglang_router", reason="the router extra is not installed: pip install 'radixlm[router]'"
)
pytestmark = pytest.mark.timeout(900)  # two replicas load the model at once on a loaded 2-core CPU

# ~400 tokens of text shared by a group of requests, then a distinct question each.
PREFIX = " ".join(
    f"Fact {i}: the warehouse in city number {i} stores {7 * i} crates of apples." for i in range(25)
)
GREEDY = {"max_new_tokens": 2, "temperature": 0}


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def two_free_ports() -> int:
    """A port p with p and p + 1 both free (the replicas' --dp-base-port)."""
    for _ in range(50):
        p = free_port()
        if p < 65000 and _port_free(p + 1):
            return p
    raise RuntimeError("no two consecutive free ports found")


@pytest.fixture(scope="module")
def dp_server() -> Iterator[tuple[ServerProcess, list[str]]]:
    """The server and its replicas' URLs. Stopped with SIGTERM (exit 0) unless a test already ended it."""
    base = two_free_ports()
    srv = ServerProcess(
        extra_args=["--dp-size", "2", "--dp-base-port", str(base), "--max-total-tokens", "4000"],
        log_level="info",
        startup_timeout=600,
    ).start()
    replicas = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    try:
        _wait_router_workers(srv.url, 2)
        yield srv, replicas
    finally:
        ended_by_test = not srv.alive()
        code = srv.stop()  # also asserts that no child outlived the server
    if not ended_by_test:
        assert code == 0, f"dp server exited with {code} after SIGTERM; log tail:\n{srv.log_tail()}"


def _wait_router_workers(url: str, n: int, timeout: float = 60.0) -> None:
    """Until the router lists exactly `n` healthy workers."""
    deadline = time.monotonic() + timeout
    while True:
        workers = requests.get(url + "/workers", timeout=10).json()["workers"]
        if len(workers) == n and all(w["is_healthy"] for w in workers):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"router lists {workers}, wanted {n} healthy worker(s)")
        time.sleep(0.25)


def _prompt_tokens(replica: str) -> int:
    return requests.get(replica + "/get_server_info", timeout=HTTP_TIMEOUT_S).json()["prompt_tokens"]


def _generate(url: str, text: str) -> dict:
    r = requests.post(
        url + "/generate", json={"text": text, "sampling_params": GREEDY}, timeout=HTTP_TIMEOUT_S
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_shared_prefix_goes_to_one_replica_and_hits_its_cache(dp_server):
    srv, replicas = dp_server
    before = [_prompt_tokens(r) for r in replicas]
    first = _generate(srv.url, PREFIX + " Question: which city has the most crates?")
    prefix_len = first["meta_info"]["prompt_tokens"] - 12
    assert prefix_len > 300
    for q in ("the fewest crates?", "exactly 70 crates?", "any pears?"):
        meta = _generate(srv.url, PREFIX + " Question: which city has " + q)["meta_info"]
        assert meta["cached_tokens"] >= prefix_len, meta
    # The OpenAI route reports the hit too, in usage.prompt_tokens_details.
    body = {
        "model": "default",
        "prompt": PREFIX + " Question: what fruit?",
        "max_tokens": 2,
        "temperature": 0,
    }
    r = requests.post(srv.url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= prefix_len
    grew = [_prompt_tokens(r) - b for r, b in zip(replicas, before)]
    assert sorted(g > 0 for g in grew) == [False, True], f"prompt tokens per replica grew by {grew}"


def _sse_events(resp: requests.Response) -> list[str]:
    return [
        line[len("data: ") :] for line in resp.iter_lines(decode_unicode=True) if line.startswith("data: ")
    ]


def test_worker_contract_through_the_router(dp_server):
    srv, _ = dp_server
    models = requests.get(srv.url + "/v1/models", timeout=HTTP_TIMEOUT_S).json()
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
    body = {"text": "Hello", "sampling_params": GREEDY, "stream": True}
    with requests.post(srv.url + "/generate", json=body, stream=True, timeout=HTTP_TIMEOUT_S) as resp:
        events = _sse_events(resp)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["meta_info"]["completion_tokens"] == 2
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with requests.post(
        srv.url + "/v1/chat/completions", json=body, stream=True, timeout=HTTP_TIMEOUT_S
    ) as resp:
        assert resp.status_code == 200
        events = _sse_events(resp)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 2
    # A bad request still gets our 400 naming the field, through the router.
    r = requests.post(srv.url + "/generate", json={"text": "x", "sampling_params": {"top_p": 5}}, timeout=60)
    assert r.status_code == 400 and "top_p" in r.text
    r = requests.post(srv.url + "/flush_cache", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["workers_flushed"] == 2, r.text


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # gone meanwhile
        return [b""]


def _replica_pid(front_pid: int, port: int) -> int:
    for pid in descendants(front_pid):
        argv = _argv(pid)
        if b"runtime.launch_server" in argv and str(port).encode() in argv:
            return pid
    raise AssertionError(f"no replica process on port {port} under pid {front_pid}")


def test_killed_replica_leaves_the_other_serving(dp_server):
    """Leaves one replica."""
    srv, replicas = dp_server
    _generate(srv.url, PREFIX + " Question: warm up?")
    busy = max(replicas, key=_prompt_tokens)  # the one cache_aware sends PREFIX requests to
    os.kill(_replica_pid(srv.proc.pid, int(busy.rsplit(":", 1)[1])), signal.SIGKILL)
    _wait_router_workers(srv.url, 1, timeout=15)  # the front removed it from the router
    survivor = next(r for r in replicas if r != busy)
    before = _prompt_tokens(survivor)
    for q in ("one?", "two?", "three?"):
        _generate(srv.url, PREFIX + " Question: " + q)
    assert _prompt_tokens(survivor) > before
    assert srv.alive()
    assert "exited with code -9; routing to the 1 other(s)" in srv.log()


def test_router_death_stops_the_server(dp_server):
    """Ends the server: a dead router exits it with 1, its replicas stopped (the fixture checks no orphan)."""
    srv, _ = dp_server
    router = [p for p in descendants(srv.proc.pid) if _argv(p)[0].startswith(b"sglang::router")]
    assert len(router) == 1, "expected one sglang::router process"
    os.kill(router[0], signal.SIGKILL)
    assert srv.proc.wait(timeout=30) == 1
    assert "sglang-router exited with code -9: stopping the replicas" in srv.log()
