"""Tenants cannot observe each other (--api-keys-file): a real server with two tenants by key (A and B), an
admin tenant, and an untenanted --api-key. For every front end, B repeating A's prompt finds none of A's
cached tokens; B gets no explanation of A's session, cannot release A's pins, read, continue or delete A's
stored responses, or abort A's requests; tenants' requests never teach the shared speculative index; and
each quota answers 429 naming it while the other tenant's requests go on."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess
from tests.e2e.test_request_options import FRONT_ENDS

KEYS = {"A": "tenant-a-key-1f3e", "B": "tenant-b-key-8c21", "OPS": "ops-admin-key-55d0"}
PLAIN_KEY = "untenanted-key-0b9a"  # --api-key: no tenant
MAX_CONCURRENT, MAX_PINS, MAX_STORED = 2, 2, 2


def auth(who: str, header: str = "bearer") -> dict[str, str]:
    key = PLAIN_KEY if who == "plain" else KEYS[who]
    return {"Authorization": f"Bearer {key}"} if header == "bearer" else {"x-api-key": key}


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> ServerProcess:
    keys_file = Path(tmp_path_factory.mktemp("tenants")) / "keys"
    keys_file.write_text(f"# key tenant [admin]\n{KEYS['A']} A\n{KEYS['B']} B\n{KEYS['OPS']} ops admin\n")
    keys_file.chmod(0o600)
    args = [
        "--api-keys-file", str(keys_file),
        "--api-key", PLAIN_KEY,
        "--speculative-algorithm", "suffix",
        "--tenant-max-concurrent-requests", str(MAX_CONCURRENT),
        "--tenant-max-pins", str(MAX_PINS),
        "--tenant-max-stored-responses", str(MAX_STORED),
    ]  # fmt: skip
    with ServerProcess(extra_args=args) as server:
        yield server


def post(srv, who: str, path: str, body: dict, header: str = "bearer") -> requests.Response:
    return requests.post(srv.url + path, json=body, headers=auth(who, header), timeout=HTTP_TIMEOUT_S)


def cached_tokens(front: str, data: dict) -> tuple[int, int]:
    """(cached, prompt) tokens of a response of front end `front`."""
    if front == "native":
        return data["meta_info"]["cached_tokens"], data["meta_info"]["prompt_tokens"]
    u = data["usage"]
    if front == "responses":
        return u["input_tokens_details"]["cached_tokens"], u["input_tokens"]
    if front == "messages":
        return u["cache_read_input_tokens"], u["input_tokens"] + u["cache_read_input_tokens"]
    return u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]


def long_prompt() -> str:
    words = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(120))
    return f"Summarise these notes in one word: {words}"


@pytest.mark.parametrize("header", ["bearer", "x-api-key"])
def test_a_tenant_key_is_accepted_in_either_header_and_a_wrong_key_is_not(srv, header):
    path, body = FRONT_ENDS["native"]({})
    assert post(srv, "A", path, body, header).status_code == 200
    bad = requests.post(srv.url + path, json=body, headers={"x-api-key": "nope"}, timeout=HTTP_TIMEOUT_S)
    assert bad.status_code == 401


@pytest.mark.parametrize("front", list(FRONT_ENDS))
def test_another_tenant_finds_none_of_a_tenants_cached_prompt(srv, front):
    text = long_prompt()
    path, body = FRONT_ENDS[front]({})
    if front == "native":
        body["text"] = text
    elif front in ("completions",):
        body["prompt"] = text
    elif front == "responses":
        body.update(input=text, store=False)  # the stored-responses quota is tested on its own
    else:
        body["messages"] = [{"role": "user", "content": text}]
    first = post(srv, "A", path, body)
    assert first.status_code == 200, first.text
    again = post(srv, "A", path, body)
    hit, prompt = cached_tokens(front, again.json())
    assert hit >= prompt - 8, (hit, prompt)  # A reuses its own prompt
    other = post(srv, "B", path, body)
    assert other.status_code == 200, other.text
    hit_b, prompt_b = cached_tokens(front, other.json())
    # at most what B's own earlier requests share with it (the chat template's head), none of A's words
    assert hit_b < 40 and prompt_b > 150, (hit_b, prompt_b)
    hit_plain, _ = cached_tokens(front, post(srv, "plain", path, body).json())
    assert hit_plain < 40  # nor does a client without a tenant


def test_sessions_pins_and_explanations_are_a_tenants_own(srv):
    sid = f"agent-{uuid.uuid4().hex[:6]}"
    text = long_prompt()
    gen = {"sampling_params": {"max_new_tokens": 4, "temperature": 0}, "session_id": sid}
    assert post(srv, "A", "/generate", {"text": text, **gen}).status_code == 200
    # A's next turn re-renders its history with an edit: A is told where it diverged ...
    edited = text.replace("notes", "memos")
    miss_a = post(srv, "A", "/generate", {"text": edited, **gen}).json()["meta_info"].get("cache_miss")
    assert miss_a is not None and miss_a["reason"] == "diverged"
    # ... B naming the same session id with A's edited prompt learns nothing of A's session
    meta_b = post(srv, "B", "/generate", {"text": edited + " more", **gen}).json()["meta_info"]
    assert "cache_miss" not in meta_b
    # B's DELETE neither releases A's pin nor says it exists (B's own session of that id answers)
    released_b = requests.delete(f"{srv.url}/v1/sessions/{sid}", headers=auth("B"), timeout=HTTP_TIMEOUT_S)
    assert released_b.status_code == 200  # B's own session of the same id (pinned just above)
    again_b = requests.delete(f"{srv.url}/v1/sessions/{sid}", headers=auth("B"), timeout=HTTP_TIMEOUT_S)
    assert again_b.status_code == 404
    released_a = requests.delete(f"{srv.url}/v1/sessions/{sid}", headers=auth("A"), timeout=HTTP_TIMEOUT_S)
    assert released_a.status_code == 200 and released_a.json()["released_tokens"] > 100


def test_cache_salts_subdivide_a_tenant(srv):
    body = {"text": long_prompt(), "sampling_params": {"max_new_tokens": 1}}

    def cached(salt: str | None) -> int:
        r = post(srv, "A", "/generate", {**body, **({"cache_salt": salt} if salt else {})})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    cached("x")
    assert cached("x") > 150  # its own salt's prefix
    assert cached("y") < 40 and cached(None) < 40  # another salt, or none, of the same tenant
    assert post(srv, "B", "/generate", {**body, "cache_salt": "x"}).json()["meta_info"]["cached_tokens"] < 40


def test_the_chat_explainer_is_a_tenants_own(srv):
    sid = f"chat-{uuid.uuid4().hex[:6]}"
    text = long_prompt()

    def turn(who: str, content: str) -> dict:
        body = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
        r = post(srv, who, "/v1/chat/completions", {**body, "session_id": sid, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]

    turn("A", text)
    assert turn("A", text.replace("notes", "memos")).get("cache_miss", {}).get("reason") == "diverged"
    assert "cache_miss" not in turn("B", text.replace("notes", "memos"))  # nothing of A's session
    for who in ("A", "B"):
        requests.delete(f"{srv.url}/v1/sessions/{sid}", headers=auth(who), timeout=HTTP_TIMEOUT_S)


def test_a_tenants_requests_never_teach_the_shared_draft_index(srv):
    def shared_entries() -> int:
        info = requests.get(srv.url + "/get_server_info", headers=auth("OPS"), timeout=HTTP_TIMEOUT_S).json()
        return info["memory"]["structures"]["spec_shared_index"]["entries"]

    body = {"text": "Count from one to thirty in words:", "sampling_params": {"max_new_tokens": 48}}
    before = shared_entries()
    for who in ("A", "B"):
        assert post(srv, who, "/generate", body).status_code == 200
    assert shared_entries() == before  # salted by their tenants: neither teaches (so neither reads) it
    assert post(srv, "plain", "/generate", body).status_code == 200
    assert shared_entries() > before  # the mechanism works for an untenanted, unsalted client


def test_stored_responses_belong_to_their_tenant(srv):
    r = post(srv, "A", "/v1/responses", {"model": "default", "input": "Hi", "max_output_tokens": 2})
    rid = r.json()["id"]
    url = f"{srv.url}/v1/responses/{rid}"
    assert requests.get(url, headers=auth("B"), timeout=HTTP_TIMEOUT_S).status_code == 404
    assert requests.delete(url, headers=auth("B"), timeout=HTTP_TIMEOUT_S).status_code == 404
    cont = {"model": "default", "input": "And?", "previous_response_id": rid, "max_output_tokens": 2}
    missing = {**cont, "previous_response_id": "resp_" + uuid.uuid4().hex}
    refused, unknown = post(srv, "B", "/v1/responses", cont), post(srv, "B", "/v1/responses", missing)
    assert refused.status_code == unknown.status_code == 400  # as for an id that never existed
    assert refused.json()["error"]["message"].replace(rid, "X") == unknown.json()["error"]["message"].replace(
        missing["previous_response_id"], "X"
    )
    assert requests.get(url, headers=auth("A"), timeout=HTTP_TIMEOUT_S).status_code == 200
    assert requests.delete(url, headers=auth("A"), timeout=HTTP_TIMEOUT_S).status_code == 200


def test_a_tenant_cannot_abort_another_tenants_request(srv):
    rid = f"shared-rid-{uuid.uuid4().hex[:6]}"
    body = {
        "text": "Tell a long story.",
        "rid": rid,
        "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
    }
    result = {}
    t = threading.Thread(target=lambda: result.update(r=post(srv, "A", "/generate", body)))
    t.start()
    for _ in range(20):
        post(srv, "B", "/abort_request", {"rid": rid})
    t.join()
    meta = result["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 64


def test_admin_routes_need_an_admin_tenant(srv):
    assert post(srv, "A", "/flush_cache", {}).status_code == 403
    assert post(srv, "OPS", "/flush_cache", {}).status_code in (200, 400)  # 400: requests were running


def test_the_concurrency_quota_is_per_tenant(srv):
    slow = {"text": "Tell a long story.", "sampling_params": {"max_new_tokens": 160, "ignore_eos": True}}
    held = []
    threads = [
        threading.Thread(target=lambda: held.append(post(srv, "A", "/generate", slow)))
        for _ in range(MAX_CONCURRENT)
    ]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until both of A's requests are in flight (no probe meanwhile:
            info = requests.get(srv.url + "/get_server_info", headers=auth("OPS"), timeout=HTTP_TIMEOUT_S)
            if info.json()["requests_in_flight"] >= MAX_CONCURRENT:  # it would take one of A's places)
                break
            time.sleep(0.05)
        refused = post(srv, "A", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
        assert refused.status_code == 429, refused.text
        assert "--tenant-max-concurrent-requests (2)" in refused.json()["error"]["message"]
        other = post(srv, "B", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
        assert other.status_code == 200, other.text
    finally:
        for t in threads:
            t.join()
    assert [r.status_code for r in held] == [200] * MAX_CONCURRENT


def test_the_pin_quota_is_per_tenant(srv):
    def turn(who: str, sid: str) -> requests.Response:
        return post(
            srv, who, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1}, "session_id": sid}
        )

    sids = [f"q-{uuid.uuid4().hex[:6]}" for _ in range(MAX_PINS + 1)]
    try:
        for sid in sids[:MAX_PINS]:
            assert turn("A", sid).status_code == 200
        assert turn("A", sids[0]).status_code == 200  # a session's next turn renews its own pin
        refused = turn("A", sids[-1])
        assert (
            refused.status_code == 429
            and f"--tenant-max-pins ({MAX_PINS})" in refused.json()["error"]["message"]
        )
        assert turn("B", sids[-1]).status_code == 200  # B's pins are its own
    finally:
        for who in ("A", "B"):
            for sid in sids:
                requests.delete(f"{srv.url}/v1/sessions/{sid}", headers=auth(who), timeout=HTTP_TIMEOUT_S)


def test_the_stored_responses_quota_is_per_tenant(srv):
    body = {"model": "default", "input": "Hi", "max_output_tokens": 1}
    ids = []
    try:
        for _ in range(MAX_STORED):
            r = post(srv, "B", "/v1/responses", body)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        refused = post(srv, "B", "/v1/responses", body)
        assert (
            refused.status_code == 429
            and "--tenant-max-stored-responses" in refused.json()["error"]["message"]
        )
        assert post(srv, "B", "/v1/responses", {**body, "store": False}).status_code == 200
        r = post(srv, "A", "/v1/responses", body)
        assert r.status_code == 200
        requests.delete(f"{srv.url}/v1/responses/{r.json()['id']}", headers=auth("A"), timeout=HTTP_TIMEOUT_S)
    finally:
        for rid in ids:
            requests.delete(f"{srv.url}/v1/responses/{rid}", headers=auth("B"), timeout=HTTP_TIMEOUT_S)
