"""The native HTTP API end to end: /generate (single, batch, logprobs, stop, streaming, n) and the admin
endpoints, against the shared real server on the default model (SmolLM2-135M-Instruct).

Decode is slow on the shared CPU machine, so every request asks for a handful of tokens; greedy requests
reuse one reference prompt so their outputs can be compared with each other.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import uuid

import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, assert_no_kv_leak, generate, kick, server_info, wait_idle

pytestmark = pytest.mark.timeout(
    600
)  # includes the session server's startup (up to 300 s) for the first test

PROMPT = "The capital of France is"
MAX_NEW = 6
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}


@pytest.fixture(scope="module")
def reference(server_url) -> dict:
    """The greedy completion of PROMPT, computed once and compared against by several tests."""
    out = generate(
        server_url,
        {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0},
    )
    assert out["text"] and out["meta_info"]["completion_tokens"] == len(out["output_ids"]) > 0
    return out


def prompt_ids(ref: dict) -> list[int]:
    return [tid for _lp, tid, _text in ref["meta_info"]["input_token_logprobs"]]


def unique_prompt(words: int = 40) -> str:
    """A prompt no earlier request shares a prefix with (starts with a fresh random token string)."""
    return f"[{uuid.uuid4().hex}] " + " ".join(f"item{i}" for i in range(words))


# ---- /generate --------------------------------------------------------------------------------------------
def test_text_and_input_ids_agree(server_url, reference):
    meta = reference["meta_info"]
    ids = prompt_ids(reference)
    assert meta["prompt_tokens"] == len(ids) == 5
    assert meta["completion_tokens"] <= MAX_NEW
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert meta["id"] and meta["e2e_latency"] > 0
    assert "Paris" in reference["text"]  # the model knows this one
    by_ids = generate(server_url, {"input_ids": ids, "sampling_params": GREEDY})
    assert by_ids["output_ids"] == reference["output_ids"]
    assert by_ids["text"] == reference["text"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)


def test_greedy_is_deterministic_and_uses_cache(server_url, reference):
    again = generate(server_url, {"text": PROMPT, "sampling_params": GREEDY})
    assert again["text"] == reference["text"]
    assert again["output_ids"] == reference["output_ids"]
    # The prompt was computed before: all but the last token (whose logits must be recomputed) are cached.
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1


def test_batch_list_input(server_url, reference):
    second = "One, two, three,"
    out = generate(
        server_url,
        {"text": [PROMPT, second], "sampling_params": [GREEDY, {"max_new_tokens": 3, "temperature": 0}]},
    )
    assert isinstance(out, list) and len(out) == 2
    # Greedy output does not depend on batch composition.
    assert out[0]["text"] == reference["text"] and out[0]["output_ids"] == reference["output_ids"]
    assert out[1]["meta_info"]["completion_tokens"] == len(out[1]["output_ids"]) <= 3
    assert out[1]["text"].strip()
    assert out[0]["meta_info"]["id"] != out[1]["meta_info"]["id"]
    # A one-element list is still a batch: the answer is a list.
    single = generate(
        server_url, {"text": [second], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    )
    assert isinstance(single, list) and single[0]["text"] == out[1]["text"]


def test_prefill_only_warms_the_cache(server_url):
    prompt = unique_prompt()
    warm = generate(server_url, {"text": prompt, "sampling_params": {"max_new_tokens": 0}})
    meta = warm["meta_info"]
    assert warm["text"] == "" and warm["output_ids"] == []
    assert meta["completion_tokens"] == 0
    assert meta["cached_tokens"] < 4  # at most a leading token or two shared with earlier prompts
    assert meta["finish_reason"]["type"] == "length"
    assert meta["prompt_tokens"] > 40
    hit = generate(server_url, {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert hit["meta_info"]["cached_tokens"] == meta["prompt_tokens"] - 1
    assert hit["meta_info"]["completion_tokens"] == 1


def test_cache_salt_isolates_cached_prefixes(server_url):
    """`cache_salt`: the same prompt hits the cache only under the salt it was cached with; the output does
    not depend on the salt (greedy)."""
    prompt = unique_prompt()
    sp = {"max_new_tokens": 2, "temperature": 0}

    def run(salt=None):
        body = {"text": prompt, "sampling_params": sp, **({"cache_salt": salt} if salt else {})}
        return generate(server_url, body)

    plain = run()
    n = plain["meta_info"]["prompt_tokens"]
    first_a = run("tenant-a")
    assert first_a["meta_info"]["cached_tokens"] == 0  # the unsalted copy is invisible to a salt
    assert run("tenant-a")["meta_info"]["cached_tokens"] == n - 1
    assert run("tenant-b")["meta_info"]["cached_tokens"] == 0
    assert run()["meta_info"]["cached_tokens"] == n - 1
    assert first_a["output_ids"] == plain["output_ids"]
    for bad in ("", 7, "x" * 1025):
        err = generate(server_url, {"text": prompt, "cache_salt": bad}, status=400)
        assert "cache_salt" in json.dumps(err)
    assert_no_kv_leak(wait_idle(server_url))


def test_session_pin_and_delete(server_url):
    """A session's finished request stays pinned (server info counts it) until DELETE /v1/sessions/{id};
    the X-Session-Id header names the session too; bad session fields are 400s; nothing leaks."""
    sid = f"agent-{uuid.uuid4().hex[:8]}"
    body = {"text": unique_prompt(), "sampling_params": {"max_new_tokens": 2}}
    generate(server_url, {**body, "session_id": sid, "cache_ttl_s": 600})
    info = wait_idle(server_url)
    assert info["sessions_pinned"] >= 1 and info["cache_protected_tokens"] > 0
    r = requests.delete(f"{server_url}/v1/sessions/{sid}", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["released_tokens"] > 0, r.text
    r = requests.delete(f"{server_url}/v1/sessions/{sid}", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 404 and sid in r.text
    hdr = requests.post(
        server_url + "/generate", json=body, headers={"X-Session-Id": sid}, timeout=HTTP_TIMEOUT_S
    )
    assert hdr.status_code == 200, hdr.text
    r = requests.delete(f"{server_url}/v1/sessions/{sid}", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    bad_fields = [
        ({"cache_ttl_s": 5}, "session_id"),
        ({"session_id": sid, "cache_ttl_s": -1}, "cache_ttl_s"),
        ({"session_id": sid, "cache_ttl_s": 10**7}, "max-session-ttl-s"),
        ({"session_id": ""}, "session_id"),
    ]
    for bad, field in bad_fields:
        err = generate(server_url, {**body, **bad}, status=400)
        assert field in json.dumps(err), (bad, err)
    info = wait_idle(server_url)
    assert info["cache_protected_tokens"] == 0
    assert_no_kv_leak(info)


def _check_entry(entry, token_id: int, with_text: bool) -> None:
    lp, tid, text = entry
    assert tid == token_id
    assert isinstance(lp, float) and lp <= 0.0 and math.isfinite(lp)
    assert (text is not None) == with_text


def _check_top(top: list, k: int, chosen: int | None = None) -> None:
    assert len(top) == k
    lps = [e[0] for e in top]
    assert lps == sorted(lps, reverse=True) and all(x <= 0 for x in lps)
    assert len({e[1] for e in top}) == k
    if chosen is not None:  # greedy: the sampled token is the most likely one
        assert top[0][1] == chosen


def test_logprobs_full_prompt(server_url, reference):
    ids = prompt_ids(reference)
    out = generate(
        server_url,
        {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 3,
            "return_text_in_logprobs": True,
        },
    )
    meta = out["meta_info"]
    inp, inp_top = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(inp) == len(inp_top) == len(ids)
    # The first prompt token has no context: its logprob and top list are null, its id and text are given.
    assert inp[0][0] is None and inp[0][1] == ids[0] and inp[0][2] == "The"
    assert inp_top[0] is None
    for pos in range(1, len(ids)):
        _check_entry(inp[pos], ids[pos], with_text=True)
        _check_top(inp_top[pos], 3)
        # The actual token is either in the top 3 with the same logprob or less likely than all of them.
        top_ids = [e[1] for e in inp_top[pos]]
        if ids[pos] in top_ids:
            assert inp_top[pos][top_ids.index(ids[pos])][0] == pytest.approx(inp[pos][0], abs=1e-4)
        else:
            assert inp[pos][0] <= inp_top[pos][-1][0] + 1e-4
    assert "".join(e[2] for e in inp) == PROMPT
    outp, out_top = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(outp) == len(out_top) == meta["completion_tokens"] == len(out["output_ids"]) == 3
    for entry, top, tid in zip(outp, out_top, out["output_ids"], strict=True):
        _check_entry(entry, tid, with_text=True)
        _check_top(top, 3, chosen=tid)
        assert top[0][0] == pytest.approx(entry[0], abs=1e-5)
    assert "".join(e[2] for e in outp) == out["text"]
    assert out["output_ids"] == reference["output_ids"][:3]


def test_logprobs_start_len_and_no_text(server_url, reference):
    ids = prompt_ids(reference)
    start = 2
    out = generate(
        server_url,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": start,
        },
    )
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert [e[1] for e in inp] == ids[start:]
    for entry, tid in zip(inp, ids[start:], strict=True):  # positions >= 1 all have a logprob, first included
        _check_entry(entry, tid, with_text=False)
    # Same numbers as the full-prompt reference, whatever part of the prompt came from the cache.
    ref = reference["meta_info"]["input_token_logprobs"][start:]
    assert [e[0] for e in inp] == pytest.approx([e[0] for e in ref], abs=1e-3)
    assert len(meta["output_token_logprobs"]) == 2
    assert meta["output_top_logprobs"] == [None, None]  # top_logprobs_num defaults to 0
    # The default start (-1) asks for output logprobs only.
    out = generate(
        server_url,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
        },
    )
    assert out["meta_info"]["input_token_logprobs"] == []
    assert len(out["meta_info"]["output_token_logprobs"]) == 1


def test_stop_string_is_trimmed(server_url, reference):
    full = reference["text"]
    assert "." in full, full  # " Paris. ..." -- the test relies on a '.' in the greedy output
    out = generate(server_url, {"text": PROMPT, "sampling_params": {**GREEDY, "stop": ["zzz", "."]}})
    assert out["text"] == full[: full.index(".")]
    assert not out["text"].endswith(".")
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "."}
    kept = generate(
        server_url, {"text": PROMPT, "sampling_params": {**GREEDY, "stop": ".", "no_stop_trim": True}}
    )
    assert kept["text"] == full[: full.index(".") + 1]
    assert kept["meta_info"]["finish_reason"]["matched"] == "."


def test_stream_sse(server_url, reference):
    with requests.post(
        server_url + "/generate",
        json={"text": PROMPT, "sampling_params": GREEDY, "stream": True},
        stream=True,
        timeout=HTTP_TIMEOUT_S,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    for prev, cur in zip(
        texts[:-1], texts[1:], strict=True
    ):  # cumulative: every chunk extends the previous one
        assert cur.startswith(prev)
    ntoks = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert ntoks == sorted(ntoks) and ntoks[-1] == len(reference["output_ids"])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == reference["meta_info"]["finish_reason"]
    assert texts[-1] == reference["text"]
    assert chunks[-1]["output_ids"] == reference["output_ids"]
    assert len({c["meta_info"]["id"] for c in chunks}) == 1


def test_n_samples_with_seed(server_url):
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "n": 2, "seed": 1234},
    }
    first = generate(server_url, body)
    assert isinstance(first, list) and len(first) == 2
    for out in first:
        assert 0 < out["meta_info"]["completion_tokens"] <= 5
        # The prompt is prefilled once before the samples fork, so both samples find it cached.
        assert out["meta_info"]["cached_tokens"] == out["meta_info"]["prompt_tokens"] - 1
    assert first[0]["output_ids"] != first[1]["output_ids"]  # distinct seeds per sample
    second = generate(server_url, body)
    assert [o["output_ids"] for o in second] == [o["output_ids"] for o in first]  # reproducible


def test_regex_request_and_grammar_stats(server_url):
    out = generate(
        server_url,
        {
            "text": "My favourite number is",
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "regex": "[0-9]{3}"},
        },
    )
    assert re.fullmatch("[0-9]{3}", out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    # The scheduler reports grammar compile statistics (and survives doing so).
    grammar = server_info(server_url)["grammar"]
    assert grammar["misses"] + grammar["hits"] >= 1


def test_rid_is_echoed(server_url):
    rid = f"test-rid-{uuid.uuid4().hex}"
    out = generate(server_url, {"text": "Hi", "rid": rid, "sampling_params": {"max_new_tokens": 1}})
    assert out["meta_info"]["id"] == rid
    rids = [f"{rid}-a", f"{rid}-b"]
    out = generate(server_url, {"text": ["Hi", "Yo"], "rid": rids, "sampling_params": {"max_new_tokens": 1}})
    assert [o["meta_info"]["id"] for o in out] == rids


# ---- admin endpoints --------------------------------------------------------------------------------------
def test_health_endpoints(server_url):
    r = requests.get(server_url + "/health", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.text == "ok"
    r = requests.get(server_url + "/health_generate", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.text == "ok"


def test_get_model_info(server_url):
    info = requests.get(server_url + "/get_model_info", timeout=HTTP_TIMEOUT_S).json()
    assert info["served_model_name"] == "SmolLM2-135M-Instruct"
    assert info["is_generation"] is True
    assert "<|im_start|>" in info["chat_template"] and "add_generation_prompt" in info["chat_template"]
    assert info["eos_token"] == "<|im_end|>"
    assert info["context_length"] == 8192
    assert info["vocab_size"] == 49152


def test_get_server_info_when_idle(server_url, reference):
    info = wait_idle(server_url)
    assert info["max_total_tokens"] == 20000
    assert info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0
    assert info["free_slots"] + info["cache_tokens"] + info["request_held_tokens"] == info["max_total_tokens"]
    assert_no_kv_leak(info)
    assert info["radix_cache_enabled"] is True
    assert 0.0 <= info["token_usage"] <= 1.0 and 0.0 <= info["cache_hit_rate"] <= 1.0
    assert info["requests_finished"] > 0 and info["generated_tokens"] > 0  # the reference request at least
    assert info["gc_frozen_objects"] > 10_000  # start-up objects moved out of the GC's full collections
    # the scheduler's memory: its RSS, what it has grown since start-up, its budget, and each structure
    mem = info["memory"]
    assert mem["rss_bytes"] > mem["baseline_rss_bytes"] / 2 > 0 and mem["budget_bytes"] >= 1 << 30
    assert mem["heap"]["heap_free_bytes"] >= 0 and mem["guard_sheds"] == 0
    parts = mem["structures"]
    assert parts["radix_tree"]["entries"] > 0 and parts["radix_tree"]["tokens"] == info["cache_tokens"]
    assert parts["requests"] == {"entries": 0, "tokens": 0, "bytes": 0}  # idle: no request is held
    # Server args are part of the answer.
    assert info["chunked_prefill_size"] == 512 and info["schedule_policy"] == "lpm"


def test_flush_cache(server_url):
    prompt = unique_prompt(20)
    generate(server_url, {"text": prompt, "sampling_params": {"max_new_tokens": 0}})
    before = wait_idle(server_url)
    assert before["cache_tokens"] > 20
    r = requests.post(server_url + "/flush_cache", timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and "flushed" in r.text.lower()
    after = server_info(server_url)
    assert after["cache_tokens"] == 0 and after["free_slots"] == after["max_total_tokens"]
    out = generate(server_url, {"text": prompt, "sampling_params": {"max_new_tokens": 0}})
    assert out["meta_info"]["cached_tokens"] == 0  # nothing left to reuse


def test_abort_request(server_url):
    rid = f"abort-{uuid.uuid4().hex}"
    result: dict = {}
    aborted_before = wait_idle(server_url)["requests_aborted"]

    def run():
        body = {
            "text": "Tell me a long story.",
            "rid": rid,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0},
        }
        r = requests.post(server_url + "/generate", json=body, timeout=HTTP_TIMEOUT_S)
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while server_info(server_url)["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.2)
    r = requests.post(server_url + "/abort_request", json={"rid": rid}, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200 and r.json() == {"success": True}
    t.join(timeout=30)
    if t.is_alive():  # diagnose, and do not leave the request hanging for the following tests
        kick(server_url)
        t.join(timeout=60)
        pytest.fail(
            "the aborted request did not return within 30 s"
            + (
                " -- it returned only when another request made the scheduler step: outputs of requests that "
                "finish while the scheduler is otherwise idle are not flushed"
                if not t.is_alive()
                else ""
            )
        )
    assert result["status"] == 200, result
    meta = result["body"]["meta_info"]
    assert meta["id"] == rid and meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < 2000
    info = wait_idle(server_url)
    assert info["requests_aborted"] == aborted_before + 1
    assert_no_kv_leak(info)


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def test_metrics_count_requests(server_url, reference):
    def scrape() -> str:
        r = requests.get(server_url + "/metrics", timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return r.text

    wait_idle(server_url)  # nothing from earlier tests may finish between the two scrapes
    before = scrape()
    assert "# TYPE radixlm_requests_total counter" in before
    assert "# TYPE radixlm_e2e_request_latency_seconds histogram" in before
    finished = _metric(before, "radixlm_requests_total", '{outcome="finished"}')
    gen_tokens = _metric(before, "radixlm_generation_tokens_total")
    e2e_count = _metric(before, "radixlm_e2e_request_latency_seconds_count")
    out = generate(
        server_url, {"text": "Count: 1, 2,", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    )
    after = scrape()
    assert _metric(after, "radixlm_requests_total", '{outcome="finished"}') == finished + 1
    assert (
        _metric(after, "radixlm_generation_tokens_total")
        == gen_tokens + out["meta_info"]["completion_tokens"]
    )
    assert _metric(after, "radixlm_e2e_request_latency_seconds_count") == e2e_count + 1
    assert _metric(after, "radixlm_num_running_reqs") == 0
    assert _metric(after, "radixlm_scheduler_rss_bytes") > 100e6
    assert _metric(after, "radixlm_scheduler_memory_entries", '{structure="radix_tree"}') > 0
    assert _metric(after, "radixlm_scheduler_memory_bytes", '{structure="requests"}') == 0
