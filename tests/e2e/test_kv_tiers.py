"""The host KV tier end to end: a server whose KV pool holds ~1.5 prompts (--max-total-tokens 512) serves a
prompt evicted from the pool out of host memory (--kv-host-tier-gb), reports the split of its cached tokens
in meta_info and in OpenAI usage, and shows the tier in /get_server_info and /metrics."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, assert_no_kv_leak, server_info, wait_idle

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess(
        extra_args=["--max-total-tokens", "512", "--kv-host-tier-gb", "0.05", "--chunked-prefill-size", "0"]
    ).start()
    yield server
    assert server.stop(grace_s=30) == 0, server.log_tail()


# Distinct first words: prompts that share no leading token, so a partial match never locks another's node.
FIRST_WORDS = iter(["Apples", "Rivers", "Engines", "Castles", "Planets", "Violins", "Tigers", "Oceans"])


def long_prompt(words: int) -> str:
    return f"{next(FIRST_WORDS)} [{uuid.uuid4().hex}] " + " ".join(f"item{i}" for i in range(words))


def generate(url: str, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    r = requests.post(url + "/generate", json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def test_a_prompt_evicted_from_the_pool_is_served_from_the_host_tier(srv):
    a, b = long_prompt(90), long_prompt(120)
    first = generate(srv.url, a)
    assert first["cached_tokens_by_tier"] == {"device": first["cached_tokens"], "host": 0, "disk": 0}
    generate(srv.url, b)  # a's KV no longer fits beside b's: evicted to the host tier
    generate(srv.url, long_prompt(120))
    again = generate(srv.url, a)
    tiers = again["cached_tokens_by_tier"]
    assert again["cached_tokens"] == again["prompt_tokens"] - 1, again
    assert tiers["host"] > 0 and tiers["device"] + tiers["host"] + tiers["disk"] == again["cached_tokens"]
    wait_idle(srv.url)
    info = server_info(srv.url)
    assert info["host_tier_tokens"] > 512 and info["host_tier_used_tokens"] > 0
    assert info["host_saved_tokens"] > 0 and info["host_loaded_tokens"] >= tiers["host"]
    assert_no_kv_leak(info)
    metrics = requests.get(srv.url + "/metrics", timeout=HTTP_TIMEOUT_S).text
    assert "radixlm_host_tier_used_tokens" in metrics and "radixlm_cached_tokens_host_total" in metrics


def test_openai_usage_splits_cached_tokens_by_tier(srv):
    a = long_prompt(90)
    body = {"model": "default", "prompt": a, "max_tokens": 1, "temperature": 0}
    url = srv.url + "/v1/completions"
    assert requests.post(url, json=body, timeout=HTTP_TIMEOUT_S).status_code == 200
    generate(srv.url, long_prompt(120))
    generate(srv.url, long_prompt(120))
    r = requests.post(url, json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["prompt_tokens_details"]
    assert details["cached_tokens_by_tier"]["host"] > 0
    assert sum(details["cached_tokens_by_tier"].values()) == details["cached_tokens"]


def test_a_restart_with_the_same_disk_dir_serves_from_disk(tmp_path):
    """Stop (SIGTERM) a server with --kv-disk-dir, start another on the same directory: a prompt cached by
    the first is loaded from disk by the second; a server in another dtype refuses those entries.

    The second server and the other-dtype one start side by side (their startups overlap on the second
    core): both start after the first has stopped and flushed its files, and the other dtype's blocks have
    other names (the dtype is hashed into each name, runtime/mem_cache/disk_tier.py), so whatever it writes
    cannot stand in for the prompt's float32 blocks that the second must find."""
    disk = ["--kv-disk-dir", str(tmp_path / "kv"), "--max-total-tokens", "2048"]
    prompt = long_prompt(100)
    first = ServerProcess(extra_args=disk).start()
    try:
        assert generate(first.url, prompt)["cached_tokens"] < 8
    finally:
        assert first.stop(grace_s=60) == 0, first.log_tail()
    assert any(n.endswith(".kv") for n in os.listdir(tmp_path / "kv"))
    second = ServerProcess(extra_args=disk)
    other = ServerProcess(extra_args=[*disk, "--dtype", "bfloat16"])
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(s.start) for s in (second, other)]
    try:
        for started in starts:
            started.result()  # raises the startup error of either
        meta = generate(second.url, prompt)
        tiers = meta["cached_tokens_by_tier"]
        assert tiers["disk"] >= 64 and tiers["disk"] + tiers["device"] == meta["cached_tokens"], meta
        assert server_info(second.url)["disk_loaded_tokens"] >= tiers["disk"]
        meta = generate(other.url, prompt)
        assert meta["cached_tokens_by_tier"]["disk"] == 0, meta  # another dtype's entries: never used
    finally:
        codes = [s.stop(grace_s=60) for s in (second, other)]
    assert codes == [0, 0], (second.log_tail(), other.log_tail())
