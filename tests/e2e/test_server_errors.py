"""Bad input and misbehaving clients end to end: every error is a 4xx in OpenAI's error object with a message
that names the problem, and the server keeps serving afterwards without leaking KV cache slots.

Uses the shared server, plus one more started here with `--api-key` and a small `--max-request-bytes`.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import openai
import pytest
import requests

from tests.e2e.server_utils import (
    HTTP_TIMEOUT_S,
    ServerProcess,
    ServerStartupError,
    assert_no_kv_leak,
    kick,
    server_info,
    unstick,
    wait_idle,
)

pytestmark = pytest.mark.timeout(600)  # includes a server startup (up to 300 s) for the first test

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "secret"
MAX_REQUEST_BYTES = 4096
LONG_TEXT = "hello " * 9000  # > 8192 tokens, the model's context length


def post(
    url: str,
    path: str,
    body=None,
    data: bytes | str | None = None,
    headers: dict | None = None,
    timeout: float = HTTP_TIMEOUT_S,
) -> requests.Response:
    try:
        return requests.post(url + path, json=body, data=data, headers=headers, timeout=timeout)
    except requests.exceptions.ReadTimeout:
        kick(url, headers)  # the next scheduler step may flush the lost answer: keep later tests clean
        pytest.fail(f"POST {path} got no answer within {timeout:.0f}s (the request hangs)")


def assert_error(r: requests.Response, status: int, *fragments: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["type"], str)
    for f in fragments:
        assert f in err["message"], (f, err["message"])


def assert_serving(url: str, headers: dict | None = None) -> None:
    """A normal request still works after the error."""
    r = post(
        url,
        "/generate",
        {"text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 1


# ---- native /generate -------------------------------------------------------------------------------------
NATIVE_ERRORS = {
    "malformed_json": ('{"text": "hi", ', 400, ["malformed JSON"]),
    "body_not_object": ([1, 2], 400, ["valid dictionary"]),
    "max_new_tokens_str": (
        {"text": "hi", "sampling_params": {"max_new_tokens": "a"}},
        400,
        ["max_new_tokens must be of type int, got str"],
    ),
    "temperature_str": (
        {"text": "hi", "sampling_params": {"temperature": "hot"}},
        400,
        ["temperature must be of type", "got str"],
    ),
    "text_int": ({"text": 5}, 400, ["text", "valid string"]),
    "input_ids_str": ({"input_ids": ["a"]}, 400, ["input_ids"]),
    "no_prompt": ({"sampling_params": {}}, 400, ["exactly one of 'text' or 'input_ids'"]),
    "both_prompts": ({"text": "hi", "input_ids": [1]}, 400, ["exactly one of 'text' or 'input_ids'"]),
    "unknown_sampling_field": (
        {"text": "hi", "sampling_params": {"temprature": 0.5}},
        400,
        ["unknown sampling parameter(s): temprature"],
    ),
    "unknown_field": ({"text": "hi", "bogus": 1}, 400, ["unknown field(s): bogus"]),
    "negative_max_new_tokens": (
        {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
        400,
        ["max_new_tokens must be in [0,", "got -1"],
    ),
    "absurd_max_new_tokens": (
        {"text": "hi", "sampling_params": {"max_new_tokens": 10**12}},
        400,
        ["max_new_tokens must be in [0,"],
    ),
    "output_past_context": (
        {"text": "hi", "sampling_params": {"max_new_tokens": 9000}},
        400,
        ["exceeds the context length (8192)"],
    ),
    "prompt_past_context": (
        {"text": LONG_TEXT, "sampling_params": {"max_new_tokens": 1}},
        400,
        ["exceeds the context length (8192)"],
    ),
    "empty_prompt": ({"text": ""}, 400, ["prompt is empty"]),
    "empty_batch": ({"text": []}, 400, ["must not be empty"]),
    "bad_top_p": ({"text": "hi", "sampling_params": {"top_p": 0}}, 400, ["top_p must be in (0, 1]"]),
    "top_logprobs_too_many": ({"text": "hi", "top_logprobs_num": 100}, 400, ["top_logprobs_num"]),
    "logprob_start_past_prompt": (
        {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5},
        400,
        ["logprob_start_len (5) must be < the prompt length (2)"],
    ),
    "stream_batch": ({"text": ["a", "b"], "stream": True}, 400, ["single prompt"]),
    "stream_n": ({"text": "hi", "stream": True, "sampling_params": {"n": 2}}, 400, ["n > 1"]),
    "invalid_regex": ({"text": "hi", "sampling_params": {"regex": "[0-9"}}, 400, ["invalid regex"]),
    "sampling_list_length": ({"text": ["a", "b"], "sampling_params": [{}]}, 400, ["one entry per prompt"]),
}


@pytest.mark.parametrize("case", sorted(NATIVE_ERRORS))
def test_native_errors(server_url, case):
    body, status, fragments = NATIVE_ERRORS[case]
    if isinstance(body, str):
        r = post(server_url, "/generate", data=body, headers={"Content-Type": "application/json"})
    else:
        r = post(server_url, "/generate", body)
    assert_error(r, status, *fragments)
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert_serving(server_url)


@pytest.mark.parametrize("ids", [[49152], [10**9], [-1]], ids=["vocab_size", "huge", "negative"])
def test_input_ids_out_of_vocabulary(server_url, ids):
    # Rejected by the scheduler, which sees the vocabulary size: the answer must still come back at once.
    r = post(
        server_url,
        "/generate",
        {"input_ids": [1, *ids], "sampling_params": {"max_new_tokens": 1}},
        timeout=30,
    )
    assert_error(r, 400, "input token ids must be in [0, 49152)")
    assert_serving(server_url)


# ---- OpenAI routes ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(server_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", timeout=HTTP_TIMEOUT_S, max_retries=0)


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **kw}


def _completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **kw}


OPENAI_ERRORS = {
    "chat_unknown_model": ("/v1/chat/completions", _chat(model="gpt-9"), 404, ["'gpt-9' does not exist"]),
    "completion_unknown_model": (
        "/v1/completions",
        _completion(model="gpt-9"),
        404,
        ["'gpt-9' does not exist"],
    ),
    "chat_negative_max_tokens": ("/v1/chat/completions", _chat(max_tokens=-5), 400, ["max_tokens"]),
    "completion_negative_max_tokens": ("/v1/completions", _completion(max_tokens=-5), 400, ["max_tokens"]),
    "completion_absurd_max_tokens": (
        "/v1/completions",
        _completion(max_tokens=10**9),
        400,
        ["must be in [0,"],
    ),
    "chat_absurd_max_tokens": ("/v1/chat/completions", _chat(max_tokens=10**9), 400, ["must be in [0,"]),
    "completion_output_past_context": (
        "/v1/completions",
        _completion(max_tokens=9000),
        400,
        ["context length (8192)"],
    ),
    "completion_prompt_past_context": (
        "/v1/completions",
        _completion(prompt=LONG_TEXT),
        400,
        ["+ max_new_tokens (1) exceeds the context length (8192)"],
    ),
    "chat_prompt_past_context": (
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": LONG_TEXT}]),
        400,
        ["+ max_new_tokens (1) exceeds the context length (8192)"],
    ),
    "chat_prompt_past_context_unset_max_tokens": (
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=None),
        400,
        ["+ max_new_tokens (at least 1) exceeds the context length (8192)"],
    ),
    "empty_messages": ("/v1/chat/completions", _chat(messages=[]), 400, ["at least one message"]),
    "wrong_role": (
        "/v1/chat/completions",
        _chat(messages=[{"role": "wizard", "content": "Hi"}]),
        400,
        ["role", "'user'"],
    ),
    "missing_messages": ("/v1/chat/completions", {"model": MODEL}, 400, ["messages", "required"]),
    "temperature_str": ("/v1/chat/completions", _chat(temperature="hot"), 400, ["temperature"]),
    "temperature_range": ("/v1/completions", _completion(temperature=5), 400, ["temperature"]),
    "unknown_field": ("/v1/completions", _completion(bogus=1), 400, ["bogus", "Extra inputs"]),
    "bad_top_k": ("/v1/completions", _completion(top_k=0), 400, ["top_k must be -1 (disabled) or >= 1"]),
    "bad_min_p": ("/v1/chat/completions", _chat(min_p=2.0), 400, ["min_p must be in [0, 1]"]),
    "empty_prompt_list": ("/v1/completions", _completion(prompt=[]), 400, ["prompt"]),
    "stream_many_prompts": (
        "/v1/completions",
        _completion(prompt=["a", "b"], stream=True),
        400,
        ["single prompt"],
    ),
    "tools": (
        "/v1/chat/completions",
        _chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        ["tools[0].function.parameters"],
    ),
}


@pytest.mark.parametrize("case", sorted(OPENAI_ERRORS))
def test_openai_errors(server_url, case):
    path, body, status, fragments = OPENAI_ERRORS[case]
    r = post(server_url, path, body)
    assert_error(r, status, *fragments)
    assert r.json()["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert_serving(server_url)


def test_openai_malformed_json(server_url):
    r = post(
        server_url,
        "/v1/chat/completions",
        data=b'{"model": "x", "messages": [',
        headers={"Content-Type": "application/json"},
    )
    assert_error(r, 400, "malformed JSON")
    assert_serving(server_url)


def test_openai_client_raises_typed_errors(client, server_url):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 404 and "does not exist" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=-1)
    assert e.value.status_code == 400 and "max_tokens" in e.value.message
    # A normal call through the same client still works.
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0)
    assert resp.usage.completion_tokens == 1


# ---- a second server: API key and body size limit ---------------------------------------------------------
@pytest.fixture(scope="module")
def guarded_server() -> Iterator[ServerProcess]:
    srv = ServerProcess(
        extra_args=[
            "--api-key",
            API_KEY,
            "--max-request-bytes",
            str(MAX_REQUEST_BYTES),
            "--max-total-tokens",
            "2048",
        ]
    ).start()
    try:
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, f"server exited with {code} after SIGTERM; log tail:\n{srv.log_tail()}"


def test_bad_cli_arguments_fail_fast():
    """An invalid option stops the server before it loads the model, and the helper reports why."""
    srv = ServerProcess(extra_args=["--tp-size", "0"], startup_timeout=120)
    with pytest.raises(ServerStartupError, match="exited with code 2") as e:
        srv.start()
    assert "--tp-size must be >= 1, got 0" in str(e.value)
    assert not srv.alive() and srv.child_pids() == []


AUTH = {"Authorization": f"Bearer {API_KEY}"}
WRONG = {"Authorization": "Bearer wrong"}


def test_api_key(guarded_server):
    url = guarded_server.url
    r = requests.get(url + "/health", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.text == "ok"  # /health stays open for load balancers
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 1}}
    for headers in (None, WRONG, {"Authorization": API_KEY}):  # none, wrong, missing "Bearer "
        assert_error(post(url, "/generate", body, headers=headers), 401, "API key")
        assert_error(
            requests.get(url + "/v1/models", headers=headers, timeout=HTTP_TIMEOUT_S), 401, "API key"
        )
        assert_error(requests.get(url + "/get_server_info", headers=headers, timeout=HTTP_TIMEOUT_S), 401)
    assert post(url, "/generate", body, headers=WRONG).json()["error"]["type"] == "authentication_error"
    assert requests.get(url + "/v1/models", headers=AUTH, timeout=HTTP_TIMEOUT_S).status_code == 200
    assert_serving(url, headers=AUTH)
    info = requests.get(url + "/get_server_info", headers=AUTH, timeout=HTTP_TIMEOUT_S).json()
    assert info["api_key"] != API_KEY  # never echoed back

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, timeout=HTTP_TIMEOUT_S, max_retries=0)
    assert [m.id for m in good.models.list().data] == [MODEL]


def test_body_too_large(guarded_server):
    url = guarded_server.url
    big = {"text": "x" * (MAX_REQUEST_BYTES + 100), "sampling_params": {"max_new_tokens": 1}}
    assert_error(post(url, "/generate", big, headers=AUTH), 413, "too large", str(MAX_REQUEST_BYTES))
    # Without a Content-Length (chunked upload) the limit still holds.
    payload = json.dumps(big).encode()
    chunks = (payload[i : i + 1000] for i in range(0, len(payload), 1000))
    r = requests.post(
        url + "/generate",
        data=chunks,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert_error(r, 413, "too large")
    # A body just under the limit is fine.
    ok = {"text": "y " * 100, "sampling_params": {"max_new_tokens": 1}}
    r = post(url, "/generate", ok, headers=AUTH)
    assert r.status_code == 200, r.text
    assert_serving(url, headers=AUTH)


def test_request_larger_than_kv_pool(guarded_server):
    """prompt + max_new_tokens above the pool (2048 slots) but within the context: refused at once."""
    url = guarded_server.url
    r = post(
        url,
        "/generate",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 3000}},
        headers=AUTH,
        timeout=30,
    )
    assert_error(r, 400, "KV slots", "2048")
    assert_serving(url, headers=AUTH)


# ---- clients that go away ---------------------------------------------------------------------------------
LONG_GEN = {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}
STREAMS = {
    "native": ("/generate", {"text": "Tell me a story.", "sampling_params": LONG_GEN, "stream": True}),
    "openai_chat": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "A story?"}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        },
    ),
}


def _read_events(sock: socket.socket, n: int) -> bytes:
    """Read the raw (chunk-encoded) SSE response until `n` data events have arrived."""
    buf = b""
    while buf.count(b"data: ") < n:
        part = sock.recv(65536)
        assert part, f"server closed the stream early: {buf[-500:]!r}"
        buf += part
    return buf


def _wait_stable_and_check(url: str, aborted_before: int) -> None:
    try:
        info = wait_idle(url, timeout=30)
    except AssertionError as e:
        unstick(url)  # abort the orphan so it does not run on (to 4000 tokens) under the following tests
        pytest.fail(f"the request of the vanished client was not aborted: {e}")
    assert_no_kv_leak(info)
    assert info["requests_aborted"] > aborted_before
    assert_serving(url)


@pytest.mark.parametrize("kind", sorted(STREAMS))
def test_disconnect_mid_stream_frees_kv(server_url, kind):
    path, body = STREAMS[kind]
    before = wait_idle(server_url)
    u = urlparse(server_url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((u.hostname, u.port), timeout=HTTP_TIMEOUT_S) as sock:
        sock.sendall(head + payload)
        buf = _read_events(sock, 2)
        assert buf.startswith(b"HTTP/1.1 200")
        assert server_info(server_url)["num_running_reqs"] == 1
    _wait_stable_and_check(server_url, before["requests_aborted"])


@pytest.mark.parametrize("kind", ["native", "openai_completion"])
def test_client_timeout_frees_kv(server_url, kind):
    if kind == "native":
        path, body = "/generate", {"text": "Tell me a story.", "sampling_params": LONG_GEN}
    else:
        path, body = (
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": "Once upon a time",
                "max_tokens": 4000,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
    before = wait_idle(server_url)
    with requests.Session() as s:
        t0 = time.monotonic()
        with pytest.raises(requests.exceptions.ReadTimeout):
            s.post(server_url + path, json=body, timeout=(10, 4))
        assert time.monotonic() - t0 < 60
    _wait_stable_and_check(server_url, before["requests_aborted"])
