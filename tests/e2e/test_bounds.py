"""Bounded work per request: each request bound (stop strings, rid, prompts per request, prompt characters)
is a 400 naming its flag on every route, checked before any tokenization, and the server answers /health
right after; tokenization runs off the event loop, so /health answers while a huge prompt is tokenized; n > 1
with a seed at the int64 maximum works.

One server for the module, with small bounds so that every case is cheap.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.e2e.server_utils import ServerProcess

MAX_STOPS, MAX_STOP_CHARS, MAX_RID, MAX_PROMPTS, MAX_CHARS = 4, 64, 32, 8, 3_000_000
G, CHAT, CMPL = "/generate", "/v1/chat/completions", "/v1/completions"
PROMPTS_FLAG, CHARS_FLAG = "--max-prompts-per-request", "--max-prompt-chars"


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess(
        extra_args=[
            "--max-stop-strings",
            str(MAX_STOPS),
            "--max-stop-chars",
            str(MAX_STOP_CHARS),
            "--max-rid-length",
            str(MAX_RID),
            "--max-prompts-per-request",
            str(MAX_PROMPTS),
            "--max-prompt-chars",
            str(MAX_CHARS),
            "--max-total-tokens",
            "4096",
        ]
    ).start()
    yield server
    assert server.stop(grace_s=30) == 0, server.log_tail()


def _native(**kw) -> dict:
    return {"text": "Hello", "sampling_params": {"max_new_tokens": 1}, **kw}


def _native_sp(**sp) -> dict:
    return {"text": "Hello", "sampling_params": {"max_new_tokens": 1, **sp}}


def _cmpl(**kw) -> dict:
    return {"model": "default", "prompt": "Hello", "max_tokens": 1, **kw}


def _chat(**kw) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1, **kw}


STOPS_5 = ["a", "b", "c", "d", "e"]
STOPS_LONG = ["x" * 40, "y" * 25]  # 65 characters together
# fmt: off
CASES = [
    ("stop-count-native", G, _native_sp(stop=STOPS_5), "--max-stop-strings"),
    ("stop-count-cmpl", CMPL, _cmpl(stop=STOPS_5), "--max-stop-strings"),
    ("stop-count-chat", CHAT, _chat(stop=STOPS_5), "--max-stop-strings"),
    ("stop-chars-native", G, _native_sp(stop=STOPS_LONG), "--max-stop-chars"),
    ("stop-chars-native-one", G, _native_sp(stop="z" * 65), "--max-stop-chars"),
    ("stop-chars-cmpl", CMPL, _cmpl(stop=STOPS_LONG), "--max-stop-chars"),
    ("stop-chars-chat", CHAT, _chat(stop="z" * 65), "--max-stop-chars"),
    ("rid-long", G, _native(rid="r" * (MAX_RID + 1)), "--max-rid-length"),
    ("rid-long-in-list", G, {"text": ["a", "b"], "rid": ["ok", "r" * (MAX_RID + 1)],
                             "sampling_params": {"max_new_tokens": 1}}, "--max-rid-length"),
    ("rid-control-char", G, _native(rid="a\nb"), "printable"),
    ("prompts-native-text", G, {"text": ["a"] * (MAX_PROMPTS + 1)}, PROMPTS_FLAG),
    ("prompts-native-ids", G, {"input_ids": [[1, 2]] * (MAX_PROMPTS + 1)}, PROMPTS_FLAG),
    ("prompts-native-n", G, {"text": ["a", "b", "c"], "sampling_params": {"n": 3}}, PROMPTS_FLAG),
    ("prompts-cmpl", CMPL, _cmpl(prompt=["a"] * (MAX_PROMPTS + 1)), PROMPTS_FLAG),
    ("prompts-cmpl-ids", CMPL, _cmpl(prompt=[[1, 2]] * (MAX_PROMPTS + 1)), PROMPTS_FLAG),
    ("prompts-cmpl-n", CMPL, _cmpl(prompt=["a", "b", "c"], n=3), PROMPTS_FLAG),
    ("prompts-chat-n", CHAT, _chat(n=MAX_PROMPTS + 1), PROMPTS_FLAG),
    ("chars-native", G, _native(text="a" * (MAX_CHARS + 1)), CHARS_FLAG),
    ("chars-native-batch", G, _native(text=["a" * (MAX_CHARS // 2), "a" * (MAX_CHARS // 2 + 1)]),
     CHARS_FLAG),
    ("chars-cmpl", CMPL, _cmpl(prompt=["a" * (MAX_CHARS // 2), "b" * (MAX_CHARS // 2 + 1)]), CHARS_FLAG),
    ("chars-chat", CHAT, _chat(messages=[{"role": "system", "content": "a" * (MAX_CHARS // 2)},
                                         {"role": "user", "content": "b" * (MAX_CHARS // 2 + 1)}]),
     CHARS_FLAG),
]
# fmt: on


@pytest.mark.parametrize("path,body,flag", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bound_is_a_400_naming_the_flag(srv, path, body, flag):
    t0 = time.perf_counter()
    r = requests.post(srv.url + path, json=body, timeout=60)
    took = time.perf_counter() - t0
    assert r.status_code == 400, r.text[:500]
    assert flag in r.json()["error"]["message"], r.text[:500]
    assert requests.get(srv.url + "/health", timeout=5).status_code == 200
    if "chars" in flag:  # refused before tokenizing 3 million characters (which takes seconds)
        assert took < 2.0, took


def test_many_one_token_prompts_are_refused_at_once(srv):
    """The reported case: 200,000 one-token prompts kept /health waiting 5.5 s before a 503."""
    t0 = time.perf_counter()
    r = requests.post(srv.url + CMPL, json=_cmpl(prompt=["a"] * 200_000), timeout=60)
    assert r.status_code == 400, r.text[:500]
    assert "--max-prompts-per-request" in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 3.0
    assert requests.get(srv.url + "/health", timeout=5).status_code == 200


def test_requests_at_the_bounds_are_served(srv):
    stops = ["@" * 16] * MAX_STOPS  # exactly --max-stop-chars together
    r = requests.post(
        srv.url + G,
        json={
            "text": ["Hello"] * (MAX_PROMPTS // 2),
            "rid": [f"{i}".rjust(MAX_RID, "r") for i in range(MAX_PROMPTS // 2)],
            "sampling_params": {"max_new_tokens": 1, "n": 2, "stop": stops},
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text[:500]
    assert len(r.json()) == MAX_PROMPTS
    r = requests.post(srv.url + CMPL, json=_cmpl(prompt=["Hi"] * MAX_PROMPTS, stop=stops), timeout=300)
    assert r.status_code == 200, r.text[:500]
    assert len(r.json()["choices"]) == MAX_PROMPTS


@pytest.mark.parametrize("path", [CMPL, G])
def test_health_answers_while_a_huge_prompt_is_tokenized(srv, path):
    """A prompt just under --max-prompt-chars takes seconds to tokenize (then it is a 400: too many tokens
    for the context). /health is polled all the while: every answer within 1 s."""
    text = "hello world " * ((MAX_CHARS - 100) // 12)
    body = _cmpl(prompt=text) if path == CMPL else _native(text=text)
    latencies: list[float] = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            t0 = time.perf_counter()
            assert requests.get(srv.url + "/health", timeout=30).status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.2)
        t0 = time.perf_counter()
        r = requests.post(srv.url + path, json=body, timeout=300)
        took = time.perf_counter() - t0
    finally:
        done.set()
        poller.join()
    assert r.status_code == 400, r.text[:500]
    assert "context length" in r.json()["error"]["message"]
    assert took > 0.5, f"tokenizing took only {took:.2f} s: the test proves nothing"
    assert len(latencies) >= 5, latencies
    assert max(latencies) < 1.0, f"/health took up to {max(latencies):.2f} s while tokenizing ({took:.2f} s)"


@pytest.mark.parametrize("path", [CMPL, G])
def test_n_choices_with_a_seed_at_the_int64_maximum(srv, path):
    seed = 2**63 - 1
    if path == CMPL:
        body = _cmpl(prompt="Once upon a time", max_tokens=4, temperature=1.0, n=4, seed=seed)
    else:
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4, "n": 4, "seed": seed}}

    def texts() -> list[str]:
        r = requests.post(srv.url + path, json=body, timeout=300)
        assert r.status_code == 200, r.text[:500]
        return [c["text"] for c in r.json()["choices"]] if path == CMPL else [c["text"] for c in r.json()]

    first = texts()
    assert len(first) == 4
    assert texts() == first  # reproducible
