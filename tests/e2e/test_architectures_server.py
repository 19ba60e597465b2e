"""A real server on each architecture's tiny random folder (tests/random_moe.py, tests/random_dense.py), the
default attention backend (the C++ paged op on the CPU): greedy output equals transformers' with chunked
prefill and suffix speculation on, a repeated prompt is served from the radix cache with the same output, a
cached prompt longer than the sliding windows and then extended equals transformers' run of the whole, a
regex-constrained request follows its grammar, and no KV slot leaks."""

from __future__ import annotations

import re

import pytest

from tests.e2e.server_utils import ServerProcess, assert_no_kv_leak, generate, wait_idle
from tests.random_dense import save_random_dense
from tests.random_moe import save_random_moe
from tests.unit.test_model_parity import hf_greedy

pytestmark = pytest.mark.timeout(900)

MAX_NEW = 10
BUILDERS = {"qwen3_moe": save_random_moe, "mixtral": save_random_moe, "gemma2": save_random_dense,
            "gemma3": save_random_dense, "phi3": save_random_dense}  # fmt: skip


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_server_greedy_cache_window_speculation_grammar(arch, tmp_path, default_tokenizer):
    hf = BUILDERS[arch](tmp_path / arch, arch, default_tokenizer)
    # repetitive (the suffix drafter has something to propose) and longer than the dense models' windows;
    # Phi-3's is past LongRoPE's original 64 positions, so the server (context 256) and transformers use
    # the long set
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
        # the first request's continuation is in the suffix index: the repeat verifies drafts of it
        assert again["meta_info"].get("spec_verify_steps", 0) > 0, again["meta_info"]
        # the cached prompt, extended past another window: served from the cache, equal to a fresh run
        extended = prompt + first["output_ids"] + [44, 201, 3, 390, 57, 8, 260, 19, 71, 402, 33, 6]
        more = generate(srv.url, {"input_ids": extended, "sampling_params": greedy})
        assert more["meta_info"]["cached_tokens"] >= len(prompt)
        assert more["output_ids"] == hf_greedy(hf, extended, MAX_NEW)
        # the tiny vocabulary holds the tokenizer's first 512 ids: single characters, so a character regex
        pattern = "[0-9]{2}-[a-z]{1,3}"
        params = {"max_new_tokens": 16, "temperature": 0, "regex": pattern}
        constrained = generate(srv.url, {"input_ids": prompt[:9], "sampling_params": params})
        assert re.fullmatch(pattern, constrained["text"]), constrained["text"]
        assert_no_kv_leak(wait_idle(srv.url))
    finally:
        code = srv.stop()
    assert code == 0, f"server exited with {code} after SIGTERM; log tail:\n{srv.log_tail()}"
