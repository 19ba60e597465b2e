"""Gemma 2, Gemma 3 and Phi-3 (tests/random_dense.py) against transformers in float32: the config's mapping
(sliding windows per layer, soft-capping, LongRoPE's set per context length), logits of extends over cached
prefixes and of mixed-length decode steps on both CPU attention backends, the scheduler's greedy output with
the radix cache and chunked prefill, and sliding-window prefix reuse: a prompt longer than the window,
cached, then extended, gives what a fresh run gives."""

from __future__ import annotations

import random

import pytest
import torch

from tests.random_dense import (
    GEMMA2_ATTN_SOFTCAP,
    GEMMA2_WINDOW,
    GEMMA3_WINDOW,
    PHI3_ORIGINAL_MAX,
    PHI3_WINDOW,
    save_random_dense,
)
from tests.scheduler_utils import make_scheduler
from tests.unit.test_model_parity import Harness, check_against_transformers, hf_greedy, hf_logits
from tests.unit.test_scheduler import assert_all_free, run

ARCHS = ["gemma2", "gemma3", "phi3"]
WINDOWS = {"gemma2": GEMMA2_WINDOW, "gemma3": GEMMA3_WINDOW, "phi3": PHI3_WINDOW}
TOL = dict(atol=3e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=ARCHS)
def dense_model(request, tmp_path_factory, default_tokenizer):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_dense(path, request.param, default_tokenizer)
    return request.param, str(path), hf


def runner_for(path: str, backend: str, context_length: int | None = None, dtype: str = "float32"):
    from runtime.model_executor.model_runner import ModelRunner

    if backend == "cpu":
        from runtime.models.native_kernels import PAGED_ATTENTION
        from tests.kernels.native import load_native_or_skip

        load_native_or_skip(PAGED_ATTENTION)
    return ModelRunner(
        path,
        dtype=dtype,
        device="cpu",
        max_total_tokens=4096,
        max_running_requests=8,
        attention_backend=backend,
        context_length=context_length,
    )


def test_config_windows_and_long_rope(dense_model):
    from runtime.models.model_config import ModelConfig

    arch, _, hf = dense_model
    cfg = ModelConfig.from_hf(hf.config)
    if arch == "gemma2":
        assert cfg.sliding_windows == (GEMMA2_WINDOW, 0, GEMMA2_WINDOW, 0)
        assert cfg.attn_logit_softcap == GEMMA2_ATTN_SOFTCAP
        assert not cfg.qk_norm and cfg.tie_word_embeddings and cfg.long_rope is None
    elif arch == "gemma3":
        assert cfg.sliding_windows == (GEMMA3_WINDOW, GEMMA3_WINDOW, 0, GEMMA3_WINDOW)
        assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.long_rope is None
        assert cfg.attn_logit_softcap == 0.0
    else:
        assert cfg.sliding_windows == (PHI3_WINDOW,) * 3
        assert cfg.long_rope is not None and cfg.inv_freq.shape == (6,)  # partial rotary: 12 of 16 dims
        assert cfg.for_context_length(PHI3_ORIGINAL_MAX) is cfg  # the short set
        long = cfg.for_context_length(PHI3_ORIGINAL_MAX + 1)
        assert torch.equal(long.inv_freq, cfg.long_rope.long_inv_freq)
        assert not torch.equal(long.inv_freq, cfg.inv_freq)


def regimes(arch: str) -> list[tuple[int | None, list[int]]]:
    """(server context length, sequence lengths before decoding): Phi-3 once in each LongRoPE regime, with
    sequences that stay inside it (transformers switches sets by the sequence's own length)."""
    if arch == "phi3":
        return [(PHI3_ORIGINAL_MAX, [9, 30, 1, 50]), (None, [70, 90, 66, 120])]
    return [(None, [9, 30, 1, 50])]


@pytest.mark.slow  # whole models through the runner or scheduler (the full suite)
@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_logits_match_transformers(dense_model, backend):
    """Extends over cached prefixes longer and shorter than the window, then mixed-length decode steps:
    every logit row equals transformers' (the fused float32 CPU layers when they load, and eager)."""
    arch, path, hf = dense_model
    g = torch.Generator().manual_seed(1)
    for context_length, lens in regimes(arch):
        runner = runner_for(path, backend, context_length)
        for fused in (True, False) if runner.model.fused_cpu_ops else (False,):
            runner.model.use_fused_cpu_ops(fused)
            seqs = {i: torch.randint(3, 512, (n,), generator=g).tolist() for i, n in enumerate(lens)}
            h = Harness(runner)
            prefix = {0: 0, 1: n1 - 4 if (n1 := lens[1]) > 4 else 0, 2: 0, 3: lens[3] - 33}
            check_against_transformers(hf, h, seqs, prefix, 3, **TOL)
            for k, row in h.rows.items():
                runner.allocator.free(runner.req_to_token_pool.read(row, h.lens[k]).clone())
                runner.req_to_token_pool.free(row)


def shared_prompts(n: int, system_len: int, seed: int = 0) -> list[list[int]]:
    """Prompts that share a system part longer than every window, then few-shot parts, then a question."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 512) for _ in range(system_len)]
    shots = [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    return [
        system + shots[i % 3] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 25))] for i in range(n)
    ]


@pytest.mark.slow  # whole models through the runner or scheduler (the full suite)
@pytest.mark.parametrize("chunk", [0, 16])
def test_scheduler_greedy_equals_transformers(dense_model, default_tokenizer, chunk):
    """10 requests sharing prefixes longer than the window, 4 running at a time, the radix cache on (and
    chunked prefill, whose chunks cut across windows): every output is transformers' greedy continuation."""
    arch, path, hf = dense_model
    reqs = shared_prompts(10, 70 if arch == "phi3" else 40)  # Phi-3: every sequence in the long regime
    sched = make_scheduler(path, default_tokenizer, chunked_prefill_size=chunk, max_running_requests=4)
    res = run(sched, reqs, max_new=8, arrive_every=2)
    for i, p in enumerate(reqs):
        assert res["outs"][f"r{i}"] == hf_greedy(hf, p, 8), f"request {i}"
    assert res["stats"]["cached_tokens"] > 0
    assert_all_free(sched)


@pytest.mark.slow  # whole models through the runner or scheduler (the full suite)
@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_sliding_window_prefix_reuse_equals_a_fresh_run(dense_model, default_tokenizer, backend):
    """A prompt several windows long is served and cached; the same prompt extended is then served from the
    cache (every cached token reused: the pool holds the whole prefix, so the windows of the new positions
    are all there) and gives exactly what a fresh scheduler gives it, and what transformers gives."""
    arch, path, hf = dense_model
    if backend == "cpu":
        from runtime.models.native_kernels import PAGED_ATTENTION
        from tests.kernels.native import load_native_or_skip

        load_native_or_skip(PAGED_ATTENTION)
    rng = random.Random(7)
    window = WINDOWS[arch]
    first = [rng.randrange(3, 512) for _ in range(80 if arch == "phi3" else 3 * window + 5)]
    extended = first + [rng.randrange(3, 512) for _ in range(window + 3)]
    kw = dict(attention_backend=backend, chunked_prefill_size=16)
    warm = make_scheduler(path, default_tokenizer, **kw)
    run(warm, [first], max_new=4)
    reused = run(warm, [extended], max_new=8)
    assert reused["stats"]["cached_tokens"] >= len(first)
    fresh = run(make_scheduler(path, default_tokenizer, **kw), [extended], max_new=8)
    assert fresh["stats"]["cached_tokens"] == 0
    assert reused["outs"]["r0"] == fresh["outs"]["r0"] == hf_greedy(hf, extended, 8)
    assert_all_free(warm)


@pytest.mark.slow  # whole models through the runner or scheduler (the full suite)
def test_two_tensor_parallel_ranks_equal_one_process(dense_model):
    """--tp-size 2 on gloo: each rank holds half the heads (Phi-3: its slices of the split fused tensors) and
    half the MLP; the logits of a prefix extend, an extend and decode steps equal one process's."""
    from tests.unit.test_tensor_parallel import assert_tp2_equals_one_process

    _, path, _ = dense_model
    assert_tp2_equals_one_process(path)


@pytest.mark.slow  # whole models through the runner or scheduler (the full suite)
@pytest.mark.parametrize("backend", ["torch_native", "cpu"])
def test_bfloat16_follows_transformers_bfloat16(dense_model, backend):
    """Under --dtype bfloat16 the logits follow transformers' own bfloat16 run (its casts: Gemma's norms in
    float32 then cast, the embedding scale rounded to bfloat16), far closer than bfloat16 is to float32.
    Gemma's soft-capping is applied to radixlm's float32 logits, so the reference caps in float32 too.
    Gemma 2's attention soft-capping is float32 arithmetic in radixlm and three bfloat16 roundings of every
    score in transformers (its eager attention), which moves the two runs apart: there radixlm's bfloat16
    must be no farther from float32 than transformers' bfloat16 is."""
    from transformers import AutoModelForCausalLM

    arch, path, hf32 = dense_model
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    cap = getattr(hf16.config, "final_logit_softcapping", None)
    hf16.config.final_logit_softcapping = None
    seq = torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    want = hf_logits(hf16, seq)
    if cap:
        want = torch.tanh(want / cap) * cap
    got = Harness(runner_for(path, backend, dtype="bfloat16")).extend({0: seq}, all_logits=True)
    want32 = hf_logits(hf32, seq)
    gap = float((want - want32).abs().max())  # bfloat16 against float32
    assert gap > 0.1
    if arch == "gemma2":
        assert float((got - want32).abs().max()) <= gap
    else:
        torch.testing.assert_close(got, want, atol=gap / 10, rtol=0)
