"""Overload: with room for 2 running + 2 queued requests, a burst of concurrent requests is partly refused
with 503 + Retry-After (before any work is queued), and every admitted request completes with exactly the
greedy output it gets when run alone. Afterwards the KV pool is fully accounted for.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.server_utils import ServerProcess

MAX_RUNNING, MAX_QUEUED = 2, 2
PROMPTS = [
    "The capital of France is",
    "Three facts about owls:",
    "def fibonacci(n):",
    "Q: What is 7 times 8?\nA:",
]
NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess(
        extra_args=[
            "--max-running-requests",
            str(MAX_RUNNING),
            "--max-queued-requests",
            str(MAX_QUEUED),
            "--max-total-tokens",
            "4096",
        ]
    ).start()
    yield server
    assert server.stop() == 0, server.log_tail()


def _solo(url: str, prompt: str) -> tuple[list[int], str]:
    r = requests.post(url + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["text"]


def _native(url: str, prompt: str) -> tuple[int, Mapping[str, str], dict]:
    r = requests.post(url + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=600)
    return r.status_code, r.headers, r.json()


def _native_stream(url: str, prompt: str) -> tuple[int, Mapping[str, str], dict]:
    with requests.post(
        url + "/generate",
        json={"text": prompt, "sampling_params": GREEDY, "stream": True},
        stream=True,
        timeout=600,
    ) as r:
        if r.status_code != 200:
            return r.status_code, r.headers, r.json()
        events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", events[-2:]
    return 200, r.headers, json.loads(events[-2])


def _openai(url: str, prompt: str) -> tuple[int, Mapping[str, str], dict]:
    r = requests.post(
        url + "/v1/completions",
        timeout=600,
        json={
            "model": "default",
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    return r.status_code, r.headers, r.json()


def _server_info(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=60).json()


def _wait_idle(url: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = _server_info(url)
        if info["requests_in_flight"] == 0 and info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0:
            return info
        assert time.monotonic() < deadline, f"server not idle: {info}"
        time.sleep(0.2)


def test_burst_is_partly_refused_and_admitted_outputs_are_exact(srv):
    solo = {p: _solo(srv.url, p) for p in PROMPTS}  # (output ids, text) of each prompt run alone

    # 14 clients released at once: 10 native, 2 streaming, 2 OpenAI completions.
    kinds = [_native] * 10 + [_native_stream] * 2 + [_openai] * 2
    jobs = [(kind, PROMPTS[i % len(PROMPTS)]) for i, kind in enumerate(kinds)]
    barrier = threading.Barrier(len(jobs))
    peak = {"running": 0, "in_flight": 0}
    sampling = threading.Event()

    def sample() -> None:  # the scheduler must never run more than MAX_RUNNING at once
        while not sampling.is_set():
            info = _server_info(srv.url)
            peak["running"] = max(peak["running"], info["num_running_reqs"])
            peak["in_flight"] = max(peak["in_flight"], info["requests_in_flight"])
            time.sleep(0.05)

    def run(job):
        kind, prompt = job
        barrier.wait()
        return kind, prompt, *kind(srv.url, prompt)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(run, jobs))
    finally:
        sampling.set()
        sampler.join()

    admitted = [r for r in results if r[2] == 200]
    refused = [r for r in results if r[2] == 503]
    assert len(admitted) + len(refused) == len(results), [(r[0].__name__, r[2], r[4]) for r in results]
    assert refused, "a 14-request burst against room for 4 was never refused"
    assert len(admitted) >= MAX_RUNNING, [(r[0].__name__, r[2]) for r in results]
    for _, _, _, headers, body in refused:
        assert int(headers["Retry-After"]) >= 1, headers
        assert body["error"]["type"] == "service_unavailable" and "overloaded" in body["error"]["message"], (
            body
        )
    for kind, prompt, _, _, body in admitted:
        if kind is _openai:
            assert body["choices"][0]["text"] == solo[prompt][1], (prompt, body)
            assert body["usage"]["completion_tokens"] == NEW_TOKENS
        else:
            assert (body["output_ids"], body["text"]) == solo[prompt], (kind.__name__, prompt, body)
    assert peak["running"] <= MAX_RUNNING, peak
    assert peak["in_flight"] <= MAX_RUNNING + MAX_QUEUED, peak

    info = _wait_idle(srv.url)
    assert info["request_held_tokens"] == 0, info
    assert info["free_slots"] + info["cache_tokens"] == info["max_total_tokens"], info
    assert _solo(srv.url, PROMPTS[0]) == solo[PROMPTS[0]]  # recovered: a request after the burst is fine


def test_n_choices_count_against_the_limit(srv):
    """n > 1 expands into n requests: more than the limit is refused up front, not half-run."""
    _wait_idle(srv.url)
    r = requests.post(
        srv.url + "/generate",
        timeout=120,
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 2, "n": MAX_RUNNING + MAX_QUEUED + 1}},
    )
    assert r.status_code == 503, r.text
    assert r.headers.get("Retry-After")
    ok = requests.post(
        srv.url + "/generate",
        timeout=300,
        json={
            "text": "Hello",
            "sampling_params": {"max_new_tokens": 2, "n": MAX_RUNNING, "temperature": 0.7, "seed": 1},
        },
    )
    assert ok.status_code == 200, ok.text
    assert len(ok.json()) == MAX_RUNNING
    info = _wait_idle(srv.url)
    assert info["request_held_tokens"] == 0, info


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_refused_request_is_not_tokenized_first(srv, route):
    """Admission is checked before the prompt is tokenized: a request refused with 503 (n choices above the
    in-flight limit) answers at once, not after the second it takes to tokenize its 1 MB prompt."""
    _wait_idle(srv.url)
    big = "hello world " * 83_000  # just under --max-prompt-chars' default (1,000,000)

    def timed(n: int) -> tuple[requests.Response, float]:
        body = {"model": "default", "max_tokens": 100_000, "n": n}
        if route == "/v1/completions":
            body["prompt"] = big
        else:
            body["messages"] = [{"role": "user", "content": big}]
        t0 = time.perf_counter()
        r = requests.post(srv.url + route, json=body, timeout=300)
        return r, time.perf_counter() - t0

    tokenized, t_tokenized = timed(1)  # admitted, tokenized, then too long for the context
    assert tokenized.status_code == 400, tokenized.text[:300]
    assert "context length" in tokenized.json()["error"]["message"]
    refused, t_refused = timed(MAX_RUNNING + MAX_QUEUED + 1)
    assert refused.status_code == 503, refused.text[:300]
    assert t_refused < t_tokenized / 3, (t_refused, t_tokenized)
