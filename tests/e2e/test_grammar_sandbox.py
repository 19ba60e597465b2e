"""The grammar sandbox through a real server: a schema nested thousands deep is a 400 naming the depth limit
(not a 500 from a RecursionError), and an aborted request whose grammar waits behind a slow compile leaves the
compile queue at once (its compile is dropped, the queue drains) while the server keeps serving.

One compile worker, so a slow compile (``[a-z ]{0,N}`` over the 49152-token vocabulary: seconds, a few hundred
MB) holds it and the next grammar has to queue.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, server_info

DEPTH_LIMIT = 64  # constrained.spec.MAX_SCHEMA_DEPTH, as the message states it


@pytest.fixture(scope="module")
def srv():
    s = ServerProcess(extra_args=["--max-total-tokens", "4096", "--grammar-workers", "1"]).start()
    try:
        yield s
    finally:
        code = s.stop()
    assert code == 0, f"server exited with {code}; log tail:\n{s.log_tail()}"


def _generate(url: str, params: dict, **extra) -> requests.Response:
    body = {"text": "Write:", "sampling_params": {"max_new_tokens": 8, "temperature": 0, **params}, **extra}
    return requests.post(url + "/generate", json=body, timeout=HTTP_TIMEOUT_S * 4)


def _grammar(url: str) -> dict:
    return server_info(url)["grammar"]


def _until(cond, what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_schema_nested_thousands_deep_is_a_400_naming_the_depth_limit(srv):
    deep = '{"items":' * 5000 + '{"type": "integer"}' + "}" * 5000  # 50 KB: under the size limit
    r = _generate(srv.url, {"json_schema": deep})
    assert r.status_code == 400, r.text
    assert "nested too deeply" in r.text and f"limit of {DEPTH_LIMIT} levels" in r.text

    moderately = '{"items":' * 200 + '{"type": "integer"}' + "}" * 200  # parses, past the limit
    r = _generate(srv.url, {"json_schema": moderately})
    assert r.status_code == 400 and f"limit of {DEPTH_LIMIT} levels" in r.text, r.text

    # the same as a JSON object in the body, spelled by hand (json.dumps cannot nest 5000 deep either):
    # refused however it is parsed, never a 500
    nested = '{"type": "object", "properties": {"a": ' * 5000 + '{"type": "string"}' + "}}" * 5000
    for path, body in (
        ("/generate", '{"text": "Write:", "sampling_params": {"max_new_tokens": 2, "json_schema": %s}}'),
        (
            "/v1/chat/completions",
            '{"model": "default", "messages": [{"role": "user", "content": "Hi"}], "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}',
        ),
    ):
        r = requests.post(
            srv.url + path,
            data=(body % nested).encode(),
            headers={"Content-Type": "application/json"},
            timeout=HTTP_TIMEOUT_S,
        )
        assert r.status_code == 400, (path, r.status_code, r.text[:300])

    ok = _generate(srv.url, {"regex": "[0-9]{3}"})
    assert ok.status_code == 200, ok.text
    assert requests.get(srv.url + "/health", timeout=HTTP_TIMEOUT_S).status_code == 200


def test_aborting_a_request_that_waits_for_a_compile_drops_its_compile(srv):
    assert _generate(srv.url, {"regex": "[0-9]{2}"}).status_code == 200  # the compile worker is up
    results: dict[str, requests.Response] = {}

    def send(name: str, params: dict, **extra) -> threading.Thread:
        t = threading.Thread(target=lambda: results.__setitem__(name, _generate(srv.url, params, **extra)))
        t.start()
        return t

    slow = send("slow", {"regex": "[a-z ]{0,700}"})
    _until(lambda: _grammar(srv.url).get("running") == 1, "the slow compile to start")
    waiting = send("waiting", {"regex": "[a-z ]{0,701}"}, rid="grammar-waiter")
    _until(lambda: _grammar(srv.url)["queued"] == 1, "the second compile to queue")
    before = _grammar(srv.url)

    r = requests.post(srv.url + "/abort_request", json={"rid": "grammar-waiter"}, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200
    waiting.join(timeout=60)
    assert not waiting.is_alive(), "the aborted request did not return"
    after = _grammar(srv.url)
    assert after["queued"] == 0 and after["cancelled"] == before["cancelled"] + 1, after
    assert "slow" not in results  # still compiling: the queue drained by the abort, not by a finished compile
    assert results["waiting"].status_code == 200, results["waiting"].text
    assert results["waiting"].json()["meta_info"]["finish_reason"]["type"] == "abort"

    slow.join(timeout=HTTP_TIMEOUT_S * 4)
    assert results["slow"].status_code == 200, results["slow"].text
    done = _grammar(srv.url)
    assert done["queued"] == 0 and done["running"] == 0 and done["inflight"] == 0
    assert _generate(srv.url, {}).status_code == 200
