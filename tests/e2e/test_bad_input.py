"""Bad input never becomes a 5xx, a hang or a dead server: a table of hostile requests each gets its 4xx with
an OpenAI-style error message, a normal request still works afterwards, and schemathesis fuzzes every route
of /openapi.json (positive and negative data) without a single server error.

The module runs its own server (not the session one): fuzzing exists to find requests that kill a server.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
import requests

from tests.e2e.server_utils import ServerProcess

MAX_BODY = 1 << 20
TIMEOUT_S = 20  # every case below is rejected before any generation: seconds, not minutes

try:
    from constrained import validate_spec  # noqa: F401

    HAS_GRAMMAR = True
except ImportError:  # constrained decoding not finished yet
    HAS_GRAMMAR = False
needs_grammar = pytest.mark.skipif(not HAS_GRAMMAR, reason="constrained.validate_spec is not importable")


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess(
        extra_args=["--max-request-bytes", str(MAX_BODY), "--max-total-tokens", "4096"]
    ).start()
    yield server
    # A leaked in-flight request (see the last test) blocks the SIGTERM drain: SIGKILL after 30 s, exit -9.
    assert server.stop(grace_s=30) == 0, server.log_tail()


SP1 = {"max_new_tokens": 1}
G, CHAT, CMPL = "/generate", "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


def _sp(**kw) -> dict:
    return {"text": "a", "sampling_params": kw}


def _bug(marks, *case):
    return pytest.param(*case, marks=marks)


# (id, path, body: bytes | JSON value, expected status, substring of the error message)
# fmt: off
CASES = [
    ("malformed-json", G, b'{"text": "a",', 400, "malformed JSON"),
    ("trailing-garbage", G, b'{"text": "a"} x', 400, "JSON"),
    ("empty-body", G, b"", 400, ""),
    ("body-is-list", G, [1, 2], 400, "object"),
    ("body-is-string", G, "hello", 400, "object"),
    ("body-is-null", G, None, 400, "object"),
    ("unknown-field", G, {"text": "a", "foo": 1}, 400, "foo"),
    ("unknown-sampling-param", G, _sp(bogus=1), 400, "bogus"),
    ("no-prompt", G, {"sampling_params": SP1}, 400, "text"),
    ("text-and-ids", G, {"text": "a", "input_ids": [1]}, 400, "exactly one"),
    ("text-wrong-type", G, {"text": 5}, 400, "text"),
    ("empty-text-list", G, {"text": []}, 400, "empty"),
    ("empty-text", G, {"text": ""}, 400, "empty"),
    ("empty-input-ids", G, {"input_ids": []}, 400, "input_ids"),
    ("float-input-ids", G, {"input_ids": [1.5]}, 400, "input_ids"),
    ("input-id-out-of-vocab", G, {"input_ids": [10**9], "sampling_params": SP1}, 400, "token ids"),
    ("negative-input-id", G, {"input_ids": [-1], "sampling_params": SP1}, 400, "[0,"),
    ("max-new-tokens-negative", G, _sp(max_new_tokens=-1), 400, "max_new_tokens"),
    ("max-new-tokens-huge", G, _sp(max_new_tokens=10**12), 400, "max_new_tokens"),
    ("max-new-tokens-past-context", G, _sp(max_new_tokens=100000), 400, "context"),
    ("max-new-tokens-string", G, _sp(max_new_tokens="5"), 400, "max_new_tokens"),
    ("max-new-tokens-bool", G, _sp(max_new_tokens=True), 400, "max_new_tokens"),
    ("temperature-negative", G, _sp(temperature=-1), 400, "temperature"),
    ("temperature-nan", G, b'{"text": "a", "sampling_params": {"temperature": NaN}}', 400, "temperature"),
    ("top-p-infinity", G, b'{"text": "a", "sampling_params": {"top_p": Infinity}}', 400, "top_p"),
    ("top-k-zero", G, _sp(top_k=0), 400, "top_k"),
    ("n-too-big", G, _sp(n=1000), 400, "n must be"),
    ("stop-empty-string", G, _sp(stop=[""]), 400, "stop"),
    ("stop-too-many", G, _sp(stop=[f"s{i}" for i in range(100)]), 400, "stop"),
    ("stop-token-ids-negative", G, _sp(stop_token_ids=[-5]), 400, "stop"),
    ("sampling-params-list-mismatch", G, {"text": ["a", "b"], "sampling_params": [SP1]}, 400, "one entry"),
    ("top-logprobs-too-many", G, {"text": "a", "top_logprobs_num": 100}, 400, "top_logprobs_num"),
    ("logprob-start-past-prompt", G, {"text": "a", "return_logprob": True, "logprob_start_len": 1000,
                                      "sampling_params": SP1}, 400, "logprob_start_len"),
    ("stream-batch", G, {"text": ["a", "b"], "stream": True}, 400, "stream"),
    ("stream-string", G, {"text": "a", "stream": "yes", "sampling_params": SP1}, 400, "stream"),
    ("rid-list-mismatch", G, {"text": ["a", "b"], "rid": ["x", "y", "z"]}, 400, "rid"),
    ("invalid-utf8", G, b'{"text": "\xff\xfe abc"}', 400, "utf-8"),
    ("lone-surrogate", G, b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 1}}', 400, "surrogate"),
    _bug(needs_grammar, "invalid-regex", G, _sp(regex="(unclosed"), 400, "regex"),
    _bug(needs_grammar, "lookahead-regex", G, _sp(regex="(?=a)a"), 400, "regex"),
    ("regex-not-string", G, _sp(regex=5), 400, "regex"),
    ("schema-not-json", G, _sp(json_schema="{nope"), 400, "json_schema"),
    ("schema-not-object", G, _sp(json_schema=False), 400, "json_schema"),
    ("regex-and-schema", G, _sp(regex="a", json_schema={}), 400, "exclusive"),
    _bug(needs_grammar, "unsatisfiable-integer-schema", G,
         _sp(json_schema={"type": "integer", "minimum": 5, "maximum": 1}), 400, "json_schema"),
    _bug(needs_grammar, "unsatisfiable-string-schema", G,
         _sp(json_schema={"type": "string", "minLength": 5, "maxLength": 2}), 400, "json_schema"),
    ("chat-no-messages", CHAT, {"model": "default", "messages": []}, 400, "messages"),
    ("chat-unknown-model", CHAT, {"model": "gpt-9", "messages": HI}, 404, "gpt-9"),
    ("chat-bad-role", CHAT, {"model": "default", "messages": [{"role": "wizard", "content": "x"}]},
     400, "role"),
    ("chat-image-part", CHAT, {"model": "default", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "text content"),
    ("chat-negative-max-tokens", CHAT, {"model": "default", "messages": HI, "max_tokens": -1},
     400, "max_tokens"),
    ("chat-huge-max-tokens", CHAT, {"model": "default", "messages": HI, "max_tokens": 10**9}, 400, "max"),
    ("chat-unknown-field", CHAT, {"model": "default", "messages": HI, "frobnicate": 1}, 400, "frobnicate"),
    ("chat-tools", CHAT, {"model": "default", "messages": HI, "tools": [{"type": "function"}]}, 400, "tool"),
    ("chat-bad-response-format", CHAT,
     {"model": "default", "messages": HI, "response_format": {"type": "xml"}},
     400, "response_format"),
    ("completion-empty-prompt-list", CMPL, {"model": "default", "prompt": []}, 400, "prompt"),
    ("completion-empty-token-list", CMPL, {"model": "default", "prompt": [[]], "max_tokens": 1},
     400, "empty"),
    ("completion-mixed-prompt", CMPL, {"model": "default", "prompt": ["a", 1]}, 400, "prompt"),
    ("completion-token-out-of-vocab", CMPL, {"model": "default", "prompt": [10**9], "max_tokens": 1},
     400, "token ids"),
    ("completion-logprobs-too-many", CMPL, {"model": "default", "prompt": "a", "logprobs": 50},
     400, "logprobs"),
    ("completion-suffix", CMPL, {"model": "default", "prompt": "a", "suffix": "b"}, 400, "suffix"),
    ("abort-rid-wrong-type", "/abort_request", {"rid": 5}, 400, "rid"),
    ("abort-body-not-object", "/abort_request", [], 400, "object"),
]
# fmt: on


def _post(url: str, path: str, body, headers: dict | None = None) -> requests.Response:
    headers = {"Content-Type": "application/json", **(headers or {})}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(url + path, data=data, headers=headers, timeout=TIMEOUT_S)


def _assert_error(r: requests.Response, status: int, fragment: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]  # OpenAI's error object on every endpoint
    assert isinstance(err["message"], str) and err["message"], err
    assert fragment.lower() in err["message"].lower(), err
    assert err["code"] == status


NEIGHBOUR_TOKENS = 24


class Neighbour:
    """Another client with a request always running while the hostile cases go in: each of its requests
    must finish with status 200 and all its tokens."""

    def __init__(self, url: str):
        self.url, self.results, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        body = {
            "text": "Count slowly: one, two, three,",
            "sampling_params": {"max_new_tokens": NEIGHBOUR_TOKENS, "temperature": 0, "ignore_eos": True},
        }
        while not self.stop.is_set():
            try:
                r = requests.post(self.url + "/generate", json=body, timeout=300)
                tokens = r.json()["meta_info"]["completion_tokens"] if r.status_code == 200 else None
                self.results.append((r.status_code, tokens))
            except (requests.RequestException, ValueError) as e:
                self.results.append((0, f"{type(e).__name__}: {e}"[:200]))

    def failures(self) -> list:
        return [res for res in self.results if res != (200, NEIGHBOUR_TOKENS)]


@pytest.fixture(scope="module")
def neighbour(srv):
    n = Neighbour(srv.url)
    n.thread.start()
    yield n
    n.stop.set()
    n.thread.join(timeout=300)


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "fragment"),
    CASES,
    ids=[c.values[0] if hasattr(c, "values") else c[0] for c in CASES],
)
def test_bad_request_is_rejected_with_a_message(srv, neighbour, name, path, body, status, fragment):
    _assert_error(_post(srv.url, path, body), status, fragment)
    assert requests.get(srv.url + "/health", timeout=5).status_code == 200
    assert not neighbour.failures(), neighbour.results


def test_neighbour_finished_every_request_during_the_hostile_cases(neighbour):
    deadline = time.monotonic() + 300
    while len(neighbour.results) < 2 and time.monotonic() < deadline:  # at least one spanning the cases
        time.sleep(0.5)
    neighbour.stop.set()
    neighbour.thread.join(timeout=300)
    assert len(neighbour.results) >= 2 and not neighbour.failures(), neighbour.results


@pytest.mark.parametrize(
    ("name", "path", "method", "status"),
    [("not-found", "/nope", "GET", 404), ("method-not-allowed", "/generate", "GET", 405)],
)
def test_routing_errors_use_the_error_object(srv, name, path, method, status):
    r = requests.request(method, srv.url + path, timeout=TIMEOUT_S)
    _assert_error(r, status, "")


def test_oversized_bodies_get_413(srv):
    big = {"text": "a" * (MAX_BODY + 10)}
    _assert_error(_post(srv.url, "/generate", big), 413, "too large")

    def chunks():  # no Content-Length: the limit holds for chunked uploads too
        yield b'{"text": "'
        for _ in range(MAX_BODY // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    r = requests.post(
        srv.url + "/generate", data=chunks(), headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S
    )
    _assert_error(r, 413, "too large")
    r = requests.post(
        srv.url + "/generate",
        data=b"{}",
        timeout=TIMEOUT_S,
        headers={"Content-Type": "application/json", "Content-Length": "abc"},
    )
    assert 400 <= r.status_code < 500


def test_rejected_batch_leaves_nothing_running(srv):
    """A batch whose second prompt is refused (duplicate rid) must not leave the first one generating."""
    r = _post(
        srv.url,
        "/generate",
        {
            "text": ["a", "b"],
            "rid": ["dup-rid", "dup-rid"],
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
        },
    )
    _assert_error(r, 400, "duplicate")
    deadline = time.monotonic() + 10
    while True:
        info = requests.get(srv.url + "/get_server_info", timeout=60).json()
        if info["requests_in_flight"] == 0 and info["num_running_reqs"] == 0:
            break
        if time.monotonic() > deadline:
            requests.post(srv.url + "/abort_request", json={"abort_all": True}, timeout=30)
            raise AssertionError(f"the accepted half of a rejected batch kept running: {info}")
        time.sleep(0.2)


def test_server_still_serves_after_bad_input(srv):
    r = requests.post(
        srv.url + "/generate",
        timeout=300,
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    )
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text
    info = requests.get(srv.url + "/get_server_info", timeout=60).json()
    assert info["requests_in_flight"] == 0 and info["num_running_reqs"] == 0, info
    assert requests.get(srv.url + "/health", timeout=30).status_code == 200


# ---- schemathesis ------------------------------------------------------------------------------------------
EXAMPLES = {"POST /generate": 40, "POST /v1/completions": 40, "POST /v1/chat/completions": 40}
DEFAULT_EXAMPLES = 8
TOKEN_CAP = 2


def _cap(d: dict, keys: tuple[str, ...], default_key: str | None) -> None:
    """Clamp generation lengths (the fuzzer would otherwise ask for 10^5 tokens on a CPU) without changing
    the type of anything it sent, so negative cases stay negative."""
    for k in keys:
        v = d.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            d[k] = min(v, TOKEN_CAP)
    if default_key and all(d.get(k) is None for k in keys):
        d[default_key] = TOKEN_CAP
    if isinstance(d.get("n"), int) and not isinstance(d["n"], bool):
        d["n"] = min(d["n"], 2)


def _bound_generation(case) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    if case.path == "/generate":
        sp = body.get("sampling_params")
        if sp is None:
            body["sampling_params"] = {"max_new_tokens": TOKEN_CAP}
        for item in sp if isinstance(sp, list) else [sp]:
            if isinstance(item, dict):
                _cap(item, ("max_new_tokens",), "max_new_tokens")
    elif case.path.startswith("/v1/"):
        _cap(body, ("max_tokens", "max_completion_tokens"), "max_tokens")


def test_schemathesis_finds_no_server_errors(srv):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    failures: list[str] = []
    calls: dict[str, int] = {}
    session = requests.Session()

    def fuzzer(op, mode):
        key = f"{op.label} [{mode.value}]"
        calls[key] = 0
        limits = settings(max_examples=EXAMPLES.get(op.label, DEFAULT_EXAMPLES), deadline=None, database=None,
                          derandomize=True, phases=[Phase.explicit, Phase.generate],
                          suppress_health_check=list(HealthCheck))  # fmt: skip

        @limits
        @given(case=op.as_strategy(generation_mode=mode))
        def fuzz(case):
            _bound_generation(case)
            calls[key] += 1
            try:
                resp = case.call(base_url=srv.url, session=session, timeout=120)
            except requests.RequestException as e:
                failures.append(f"{key}: {type(e).__name__} for body {case.body!r:.300}")
                return
            if resp.status_code >= 500:
                failures.append(f"{key}: {resp.status_code} {resp.text[:200]!r} for body {case.body!r:.300}")

        return key, fuzz

    for result in schema.get_all_operations():
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            key, fuzz = fuzzer(result.ok(), mode)
            try:
                fuzz()
            except Exception as e:  # e.g. no negative data exists for a parameterless GET
                print(f"{key}: not generated ({type(e).__name__}: {str(e)[:120]})")
    print(f"schemathesis: {sum(calls.values())} requests: {calls}")
    for label in EXAMPLES:  # the routes that matter were fuzzed with valid and invalid data
        assert calls[f"{label} [positive]"] and calls[f"{label} [negative]"], calls
    assert not failures, "\n".join(failures[:20])
    assert requests.get(srv.url + "/health", timeout=30).status_code == 200


# ---- resource limits of grammars (last: a failure here can leave a compile running) ------------------------
ENORMOUS = [
    (
        "schema-300-required-properties",
        {
            "json_schema": {
                "type": "object",
                "required": [f"p{i}" for i in range(300)],
                "properties": {f"p{i}": {"type": "integer"} for i in range(300)},
            }
        },
    ),
    ("schema-5000-enum", {"json_schema": {"enum": [f"value-{i}" for i in range(5000)]}}),
    ("regex-20000-alternatives", {"regex": "|".join(f"word{i}x" for i in range(20000))}),
]


@needs_grammar
def test_enormous_grammars_are_served_or_refused_quickly(srv):
    """Each either compiles within the capped pool (llguidance takes a 300-property schema in
    milliseconds) or is refused up front by a limit the message names; never a 5xx or a hang."""
    slow = []
    for name, grammar in ENORMOUS:
        rid = f"enormous-{uuid.uuid4().hex}"
        t0 = time.monotonic()
        try:
            r = requests.post(
                srv.url + "/generate",
                timeout=TIMEOUT_S,
                json={"text": "a", "rid": rid, "sampling_params": {"max_new_tokens": 2, **grammar}},
            )
            if r.status_code >= 500:
                slow.append(f"{name}: {r.status_code}")
            elif r.status_code != 200:  # refused up front by a size limit that the message names, or
                # compiled, with a shortest output longer than the 2-token budget (test_closing_budget.py)
                message = r.json()["error"]["message"]
                refused = "limit" in message or "cannot hold" in message
                assert r.status_code == 400 and refused, (name, message)
        except requests.Timeout:
            slow.append(f"{name}: no answer in {time.monotonic() - t0:.0f}s")
            requests.post(srv.url + "/abort_request", json={"rid": rid}, timeout=30)
    assert not slow, slow


# ---- last: a failure here leaks in-flight state that no API clears (and the SIGTERM drain waits on) ----
def test_integers_beyond_64_bits_are_rejected_without_leaking(srv):
    before = requests.get(srv.url + "/get_server_info", timeout=60).json()["requests_in_flight"]
    cases = [
        ({"input_ids": [2**70], "sampling_params": SP1}, "input"),
        (_sp(max_new_tokens=1, top_k=2**70), "top_k"),
        (_sp(max_new_tokens=1, seed=2**70), "seed"),
        (_sp(max_new_tokens=1, stop_token_ids=[2**70]), "stop"),
    ]
    responses = [_post(srv.url, G, body) for body, _ in cases]
    after = requests.get(srv.url + "/get_server_info", timeout=60).json()["requests_in_flight"]
    assert after == before, f"{after - before} request(s) left in flight"
    for r, (_, fragment) in zip(responses, cases):
        _assert_error(r, 400, fragment)
