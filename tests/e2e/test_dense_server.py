"""A real server on tiny random Gemma 3 and Phi-3 folders (tests/random_dense.py), default attention backend
(the C++ paged op on the CPU): greedy output equals transformers' with chunked prefill and suffix
speculation on, a repeated prompt is served from the radix cache with the same output, a cached prompt
longer than the sliding window and then extended equals transformers' run of the whole, a regex-constrained
request follows its grammar, and no KV slot leaks."""

from __future__ import annotations

import re

import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, assert_no_kv_leak, wait_idle
from tests.random_dense import GEMMA3_CHAT_TEMPLATE, save_random_dense

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


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_dense_server_greedy_cache_window_speculation_grammar(arch, tmp_path, default_tokenizer):
    hf = save_random_dense(tmp_path / arch, arch, default_tokenizer)
    # repetitive (the suffix drafter has something to propose) and longer than both windows; Phi-3's is
    # past LongRoPE's original 64 positions, so the server (context 256) and transformers use the long set
    prompt = [17, 250, 33, 400, 91, 5, 128, 77] * 9 + [300, 12, 9]
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
        assert again["meta_info"].get("spec_verify_steps", 0) > 0, again["meta_info"]
        # the cached prompt, extended past another window: served from the cache, equal to a fresh run
        extended = prompt + first["output_ids"] + [44, 201, 3, 390, 57, 8, 260, 19, 71, 402, 33, 6]
        more = generate(srv.url, {"input_ids": extended, "sampling_params": greedy})
        assert more["meta_info"]["cached_tokens"] >= len(prompt)
        assert more["output_ids"] == hf_greedy(hf, extended, MAX_NEW)
        pattern = "[0-9]{2}-[a-z]{1,3}"
        params = {"max_new_tokens": 16, "temperature": 0, "regex": pattern}
        constrained = generate(srv.url, {"input_ids": prompt[:9], "sampling_params": params})
        assert re.fullmatch(pattern, constrained["text"]), constrained["text"]
        assert_no_kv_leak(wait_idle(srv.url))
    finally:
        code = srv.stop()
    assert code == 0, f"server exited with {code} after SIGTERM; log tail:\n{srv.log_tail()}"


def test_gemma3_chat_template_from_the_folder(tmp_path, default_tokenizer):
    """A Gemma 3 folder whose tokenizer config carries Gemma's chat template: chat completions render with
    it (the system message folded into the first user turn, the assistant turn as "model"), and the answer
    is transformers' greedy continuation of exactly that prompt; a conversation the template refuses (roles
    out of order) is a 400 naming the template."""
    import copy

    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    # the tokenizer's whole vocabulary, so any rendered text is in range
    hf = save_random_dense(tmp_path / "gemma3", "gemma3", tokenizer, vocab_size=len(tokenizer))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<start_of_turn>user\nBe brief.\n\nName a colour.<end_of_turn>\n<start_of_turn>model\n" in text
    ids = tokenizer.encode(text, add_special_tokens=False)
    want = hf_greedy(hf, ids, 8)
    if hf.config.eos_token_id in want:  # generation stops at the end of sequence
        want = want[: want.index(hf.config.eos_token_id)]
    srv = ServerProcess(model=str(tmp_path / "gemma3"), extra_args=["--served-model-name", "m"]).start()
    try:
        body = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0}
        r = requests.post(srv.url + "/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert out["usage"]["completion_tokens"] == len(want)
        assert out["choices"][0]["message"]["content"] == tokenizer.decode(want, skip_special_tokens=True)
        out_of_order = [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "x"}]
        bad = {**body, "messages": out_of_order}
        r = requests.post(srv.url + "/v1/chat/completions", json=bad, timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 400 and "alternate" in r.text, r.text
        assert_no_kv_leak(wait_idle(srv.url))
    finally:
        code = srv.stop()
    assert code == 0, f"server exited with {code} after SIGTERM; log tail:\n{srv.log_tail()}"
