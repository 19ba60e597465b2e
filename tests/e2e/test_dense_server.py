"""A Gemma 3 folder's own chat template through a real server (the architectures' greedy, cache, window and
grammar checks through a server are tests/e2e/test_architectures_server.py)."""

from __future__ import annotations

import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, assert_no_kv_leak, wait_idle
from tests.random_dense import GEMMA3_CHAT_TEMPLATE, save_random_dense
from tests.unit.test_model_parity import hf_greedy

pytestmark = pytest.mark.timeout(900)


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
