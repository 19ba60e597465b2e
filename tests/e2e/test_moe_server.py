"""A real server on tiny random Qwen3-MoE and Mixtral folders (tests/random_moe.py): greedy output equals
transformers' with chunked prefill and suffix speculation on, a repeated prompt is served from the radix
cache with the same output, a regex-constrained request follows its grammar, and no KV slot leaks."""

from __future__ import annotations

import re

import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, assert_no_kv_leak, wait_idle
from tests.random_moe import save_random_moe

pytestmark = pytest.mark.timeout(900)

MAX_NEW = 10


def generate(url: str, body: dict) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_server_greedy_cache_speculation_grammar(arch, tmp_path, default_tokenizer):
    hf = save_random_moe(tmp_path / arch, arch, default_tokenizer)
    # a repetitive prompt, so the suffix drafter has something to propose
    prompt = [17, 250, 33, 400, 91, 5, 128, 77] * 4 + [300, 12, 9]
    want = hf_greedy(hf, prompt, MAX_NEW)
    args = ["--chunked-prefill-size", "16", "--max-total-tokens", "4096", "--speculative-algorithm", "suffix"]
    srv = ServerProcess(model=str(tmp_path / arch), extra_args=args).start()
    try:
        greedy = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
        first = generate(srv.url, {"input_ids": prompt, "sampling_params": greedy})
        assert first["output_ids"] == want
        again = generate(srv.url, {"input_ids": prompt, "sampling_params": greedy})
        assert again["output_ids"] == want
        assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
        # the first request's continuation is in the suffix index: the repeat verifies drafts of it
        assert again["meta_info"].get("spec_verify_steps", 0) > 0, again["meta_info"]
        # the tiny vocabulary holds the tokenizer's first 512 ids: single characters, so a character regex
        pattern = "[0-9]{2}-[a-z]{1,3}"
        params = {"max_new_tokens": 16, "temperature": 0, "regex": pattern}
        constrained = generate(srv.url, {"input_ids": prompt[:9], "sampling_params": params})
        assert re.fullmatch(pattern, constrained["text"]), constrained["text"]
        assert_no_kv_leak(wait_idle(srv.url))
    finally:
        code = srv.stop()
    assert code == 0, f"server exited with {code} after SIGTERM; log tail:\n{srv.log_tail()}"
