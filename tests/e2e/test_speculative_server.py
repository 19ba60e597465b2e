"""A server with `--speculative-algorithm suffix`: the same greedy text as the plain shared server over HTTP
(native, streaming, OpenAI with n > 1, stop strings, grammar), acceptance reported per request in
`meta_info` and in /metrics, and no KV held by requests once idle after a client disconnects mid-stream."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import requests

from tests.e2e.server_utils import ServerProcess

ITEMS = ["apple_17", "river_42", "stone_88", "cloud_05", "paper_61", "green_33", "delta_90", "omega_12"]
# The list is written as the model writes it back ("1. apple_17."): a plain one ("apple_17" per line) came
# back reformatted, so prompt lookup kept drafting the prompt's form and the acceptance checked below sat at
# 1.5-1.9 tokens per draft, a coin flip against its bound; copied verbatim it is ~4.75.
COPY = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nRepeat this list exactly:\n"
    + "\n".join(f"{i + 1}. {item}." for i, item in enumerate(ITEMS))
    + "<|im_end|>\n<|im_start|>assistant\nThe list is: "
)
FREE = "<|im_start|>user\nWrite one sentence about autumn.<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"max_new_tokens": 40, "temperature": 0}


@pytest.fixture(scope="module")
def spec_url() -> Iterator[str]:
    srv = ServerProcess(
        extra_args=["--max-total-tokens", "20000", "--speculative-algorithm", "suffix"]
    ).start()
    try:
        yield srv.url
    finally:
        assert srv.stop() == 0, srv.log_tail()


def _gen(url: str, body: dict) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_text_same_as_without_speculation(spec_url, server_url):
    for prompt in (COPY, FREE):
        on = _gen(spec_url, {"text": prompt, "sampling_params": GREEDY})
        off = _gen(server_url, {"text": prompt, "sampling_params": GREEDY})
        assert on["text"] == off["text"]
        assert "spec_verify_steps" in on["meta_info"] and "spec_verify_steps" not in off["meta_info"]
    meta = _gen(spec_url, {"text": COPY, "sampling_params": GREEDY})["meta_info"]
    assert meta["spec_verify_steps"] > 0 and meta["spec_accept_len"] > 1.5, meta


def test_streaming_and_stop_string_inside_a_copied_run(spec_url):
    full = _gen(spec_url, {"text": COPY, "sampling_params": GREEDY})["text"]
    r = requests.post(
        spec_url + "/generate",
        json={"text": COPY, "sampling_params": GREEDY, "stream": True},
        stream=True,
        timeout=600,
    )
    chunks = [
        json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data: {")
    ]
    assert chunks[-1]["text"] == full
    # a stop string from the middle of the output (the copied part, drafted and accepted in runs)
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    stopped = _gen(spec_url, {"text": COPY, "sampling_params": {**GREEDY, "stop": [stop]}})
    assert stopped["text"] == full[: full.index(stop)]
    assert stopped["meta_info"]["finish_reason"]["matched"] == stop


def _chat_body(content: str, max_tokens: int, **fields) -> dict:
    """A greedy OpenAI chat completion body with one user message."""
    messages = [{"role": "user", "content": content}]
    return {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}


def test_openai_n2_and_grammar(spec_url):
    body = _chat_body("Repeat exactly: alpha beta gamma delta alpha beta gamma", 24, n=2)
    r = requests.post(spec_url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and choices[0]["message"]["content"] == choices[1]["message"]["content"]
    items = {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8}
    schema = {"type": "object", "properties": {"items": items}, "required": ["items"]}
    out = _gen(
        spec_url,
        {
            "text": COPY,
            "sampling_params": {**GREEDY, "max_new_tokens": 160, "json_schema": json.dumps(schema)},
        },
    )
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    assert isinstance(json.loads(out["text"])["items"], list)


def test_disconnect_mid_stream_leaves_no_kv_and_metrics(spec_url):
    r = requests.post(
        spec_url + "/generate",
        json={
            "text": COPY,
            "sampling_params": {**GREEDY, "max_new_tokens": 200, "ignore_eos": True},
            "stream": True,
        },
        stream=True,
        timeout=600,
    )
    for i, _ in enumerate(r.iter_lines()):
        if i >= 3:
            break
    r.close()
    deadline = time.time() + 120
    while True:
        info = requests.get(spec_url + "/get_server_info", timeout=60).json()
        if info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert info["request_held_tokens"] == 0, info
    assert info["spec_verify_steps"] > 0 and info["spec_accept_length"] > 1.0
    assert _gen(spec_url, {"text": FREE, "sampling_params": GREEDY})["text"]  # still serving
    metrics = requests.get(spec_url + "/metrics", timeout=60).text
    line = next(x for x in metrics.splitlines() if x.startswith("radixlm_spec_accept_length "))
    assert float(line.split()[1]) > 1.0


def test_a_request_turns_its_speculation_off(spec_url):
    on = _gen(spec_url, {"text": COPY, "sampling_params": GREEDY})
    off = _gen(spec_url, {"text": COPY, "sampling_params": {**GREEDY, "speculative_num_draft_tokens": 0}})
    assert off["text"] == on["text"]
    assert on["meta_info"]["spec_verify_steps"] > 0 and "spec_verify_steps" not in off["meta_info"]
    body = _chat_body("Repeat exactly: alpha beta gamma delta", 8, speculative_num_draft_tokens=0)
    r = requests.post(spec_url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    for url, bad in (
        ("/generate", {"text": FREE, "sampling_params": {"speculative_num_draft_tokens": -1}}),
        ("/v1/chat/completions", {**body, "speculative_num_draft_tokens": 33}),
    ):
        r = requests.post(spec_url + url, json=bad, timeout=600)
        assert r.status_code == 400 and "speculative_num_draft_tokens must be in [0, 32]" in r.text, r.text


def test_a_burst_with_clients_leaving_mid_stream_leaves_nothing_per_request(spec_url):
    """60 streaming chat requests at once (bench/burst.py's client), every third client gone after two
    chunks: every request is answered, and once idle the scheduler holds no request, no request's drafting
    state and no KV for one, and reports its memory (RSS, heap, structures within their caps)."""
    import argparse
    import asyncio

    from bench.burst import one_round, prompts, wait_idle

    client = argparse.Namespace(max_new_tokens=16, temperature=0.7, request_timeout=600.0)
    res = asyncio.run(one_round(spec_url, prompts("distinct", 0, 60, seed=3), client, abort_share=1 / 3))
    assert res["failed"] == 0 and res["left_mid_stream"] == 20, res
    assert res["output_tokens"] > 0
    info = wait_idle(spec_url)
    assert info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0
    assert info["request_held_tokens"] == 0, info
    mem = info["memory"]
    parts = mem["structures"]
    assert parts["requests"]["entries"] == 0 and parts["spec_requests"]["entries"] == 0
    assert 0 < parts["spec_shared_index"]["bytes"] <= parts["spec_shared_index"]["cap_bytes"]
    assert mem["rss_mb"] > 100 and mem["guard_sheds"] == 0
