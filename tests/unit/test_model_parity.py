"""Logits of our paged-KV decoder equal transformers' on the same weights, for every supported architecture.

Tiny random models are built from configs and saved as HF folders; each test drives the real ModelRunner
through extend batches over cached prefixes of different lengths and through mixed-length decode batches.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from runtime.mem_cache.memory_pool import ReqToTokenPool
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.model_runner import ModelRunner

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

ARCHS = {
    "llama3-rope-scaled": lambda: LlamaConfig(
        **COMMON,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "smollm2-tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama-mha-head128": lambda: LlamaConfig(
        **{**COMMON, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2}, head_dim=128
    ),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    # every layer windowed (shorter than the tests' sequences), as Mistral v0.1 is
    "mistral-sliding-window": lambda: MistralConfig(**COMMON, sliding_window=6),
    # Qwen2's use_sliding_window: layers from max_window_layers on are windowed (its layer_types)
    "qwen2-sliding-layers": lambda: Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1
    ),
    "qwen2-qkv-bias": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3-qk-norm": lambda: Qwen3Config(**COMMON, head_dim=32),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def models(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg = ARCHS[request.param]()
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases/norm weights so those code paths matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    runner = ModelRunner(
        str(path),
        dtype="float32",
        device="cpu",
        max_total_tokens=2048,
        max_running_requests=8,
        attention_backend="torch_native",
    )
    return hf, runner


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [len, vocab]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, `n` tokens (the reference every architecture meets)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt) :]


class Harness:
    """Minimal request bookkeeping: a req_to_token row and KV slots per sequence."""

    def __init__(self, runner: ModelRunner):
        self.r = runner
        self.rows: dict[int, int] = {}
        self.lens: dict[int, int] = {}

    def extend(self, new_tokens: dict[int, list[int]], all_logits: bool = False) -> torch.Tensor:
        keys = list(new_tokens)
        for k in keys:
            if k not in self.rows:
                self.rows[k], self.lens[k] = self.r.req_to_token_pool.alloc(), 0
        prefix = [self.lens[k] for k in keys]
        slots = self.r.allocator.alloc(sum(len(new_tokens[k]) for k in keys))
        off = 0
        for k, p in zip(keys, prefix):
            n = len(new_tokens[k])
            self.r.req_to_token_pool.write(self.rows[k], p, slots[off : off + n])
            self.lens[k] += n
            off += n
        idx = list(range(off)) if all_logits else None
        batch = ForwardBatch.build_extend(
            [new_tokens[k] for k in keys], prefix, [self.rows[k] for k in keys], slots, logits_indices=idx
        )
        return self.r.forward(batch)

    def decode(self, tokens: dict[int, int]) -> torch.Tensor:
        keys = list(tokens)
        slots = self.r.allocator.alloc(len(keys))
        for i, k in enumerate(keys):
            self.r.req_to_token_pool.write(self.rows[k], self.lens[k], slots[i : i + 1])
            self.lens[k] += 1
        batch = ForwardBatch.build_decode(
            [tokens[k] for k in keys], [self.lens[k] for k in keys], [self.rows[k] for k in keys], slots
        )
        return self.r.forward(batch)


def check_against_transformers(
    hf, h: Harness, seqs: dict[int, list[int]], prefix: dict[int, int], steps: int, **tol
):
    """Cache each sequence's first `prefix[k]` tokens, extend the rest in one batch, then `steps` greedy
    decode steps of the mixed-length batch: every logit row equals transformers' within `tol` (`seqs` grow by
    the decoded tokens)."""
    h.extend({k: seqs[k][:p] for k, p in prefix.items() if p})
    logits = h.extend({k: seqs[k][prefix[k] :] for k in seqs}, all_logits=True)
    off = 0
    for k in seqs:
        ref = hf_logits(hf, seqs[k])[prefix[k] :]
        torch.testing.assert_close(logits[off : off + len(ref)], ref, **tol)
        off += len(ref)
    nxt = {k: int(hf_logits(hf, seqs[k])[-1].argmax()) for k in seqs}
    for _ in range(steps):
        logits = h.decode(nxt)
        for i, k in enumerate(seqs):
            seqs[k].append(nxt[k])
            torch.testing.assert_close(logits[i], hf_logits(hf, seqs[k])[-1], **tol)
        nxt = {k: int(logits[i].argmax()) for i, k in enumerate(seqs)}


def test_extend_over_cached_prefixes_and_mixed_decode(models):
    hf, runner = models
    g = torch.Generator().manual_seed(1)
    seqs = {i: torch.randint(0, 256, (n,), generator=g).tolist() for i, n in enumerate([7, 12, 20, 3])}
    # prefixes of different lengths cached first (request 0 has none), then 4 decode steps
    check_against_transformers(hf, Harness(runner), seqs, {0: 0, 1: 5, 2: 13, 3: 1}, 4, atol=2e-4, rtol=1e-4)


def test_decode_only_subset_of_requests(models):
    """A decode batch need not contain every live request, and rows need not be contiguous."""
    hf, runner = models
    h = Harness(runner)
    seqs = {0: list(range(10, 30)), 1: list(range(40, 45)), 2: list(range(1, 9))}
    h.extend(seqs)
    logits = h.decode({2: 7, 0: 3})
    torch.testing.assert_close(logits[0], hf_logits(hf, seqs[2] + [7])[-1], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], hf_logits(hf, seqs[0] + [3])[-1], atol=2e-4, rtol=1e-4)


@pytest.mark.slow  # builds the C++ kernels on first use (the fast tier needs no compiler)
@pytest.mark.parametrize("backend_name", ["torch_native", "cpu"])
def test_fused_cpu_ops_match_the_unfused_path(models, backend_name):
    """float32 on the CPU runs the fused C++ layer ops (the residual carried beside the normed activations,
    rope's cos/sin from a table; with the cpu backend the KV write inside the attention op): the logits of
    an extend over a cached prefix and of decode steps stay within float32 rounding of the eager layers."""
    from radixlm_kernels import create_backend
    from runtime.models.native_kernels import FUSED_LAYERS, PAGED_ATTENTION
    from tests.kernels.native import load_native_or_skip

    for library in (FUSED_LAYERS, PAGED_ATTENTION):
        load_native_or_skip(library)
    hf, runner = models
    assert runner.model.fused_cpu_ops  # the path under test is the one a float32 CPU runner takes
    saved = runner.backend, runner.req_to_token_pool
    rows = runner.req_to_token_pool.req_to_token.shape  # a fresh table: the other tests keep their rows
    runner.req_to_token_pool = ReqToTokenPool(rows[0], rows[1])
    runner.backend = create_backend(backend_name, runner.kv_pool, runner.req_to_token_pool)
    seqs = {0: list(range(3, 40)), 1: list(range(50, 55)), 2: [9]}
    results = []
    try:
        for fused in (True, False):
            runner.model.use_fused_cpu_ops(fused)
            h = Harness(runner)
            h.extend({k: s[:-2] for k, s in seqs.items() if len(s) > 2})
            got = [h.extend({k: s[-2:] if len(s) > 2 else s for k, s in seqs.items()}, all_logits=True)]
            for step in range(3):
                got.append(h.decode({k: 7 + step for k in seqs}))
            results.append(got)
            for k, row in h.rows.items():  # give the module's other tests their rows and slots back
                runner.allocator.free(runner.req_to_token_pool.read(row, h.lens[k]).clone())
                runner.req_to_token_pool.free(row)
    finally:
        runner.model.use_fused_cpu_ops(True)
        runner.backend, runner.req_to_token_pool = saved
    for fused, eager in zip(*results, strict=True):
        torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)
    # and the fused path still matches transformers on the extend's last token of request 0
    torch.testing.assert_close(results[0][0][1], hf_logits(hf, seqs[0])[-1], atol=2e-4, rtol=1e-4)
