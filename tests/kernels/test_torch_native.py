"""torch_native (the oracle of the other backends) against a plain masked-softmax attention written here."""

import pytest
import torch

from radixlm_kernels.torch_native import (
    TorchNativeBackend,
    attend_prefix_then_causal,
    math_attention_with_lse,
)


def masked_softmax_attention(case) -> torch.Tensor:
    """Per request: softmax(q k^T * scale + causal mask over prefix + new tokens) v, in float64."""
    layer, batch = case.layer, case.batch
    group = layer.num_heads // layer.num_kv_heads
    outs, start = [], 0
    for row, prefix, ext in zip(
        batch.req_pool_indices.tolist(), batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True
    ):
        slots = case.req_pool.req_to_token[row, : prefix + ext]
        k = case.kv_pool.k[layer.layer_id][slots].double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = case.kv_pool.v[layer.layer_id][slots].double().repeat_interleave(group, dim=1)
        q = case.q[start : start + ext].double()  # [ext, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * layer.scaling
        allowed = torch.arange(prefix + ext)[None, :] <= torch.arange(prefix, prefix + ext)[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += ext
    return torch.cat(outs).float()


@pytest.mark.parametrize(
    "prefixes,extends,group",
    [
        ([0], [9], 1),
        ([1], [7], 3),  # a one-token prefix
        ([13], [1], 3),  # odd prefix, a single new token
        ([37, 0, 1], [5, 11, 2], 3),  # mixed batch: odd prefix, none, one
        ([64], [33], 4),
    ],
)
def test_extend_matches_masked_softmax(prefixes, extends, group, make_case, run_backend):
    case = make_case(prefixes, extends, group=group, head_dim=64, seed=sum(prefixes) + group)
    out = run_backend(TorchNativeBackend(case.kv_pool, case.req_pool), case)
    torch.testing.assert_close(out, masked_softmax_attention(case), atol=2e-5, rtol=2e-5)


def test_prefix_merge_equals_one_masked_call():
    """The log-sum-exp merge against a single masked SDPA call (what torch_native did before)."""
    torch.manual_seed(0)
    prefix, ext, h, hkv, d = 29, 17, 6, 2, 32
    q = torch.randn(1, h, ext, d)
    k, v = torch.randn(1, hkv, prefix + ext, d), torch.randn(1, hkv, prefix + ext, d)
    mask = torch.arange(prefix + ext)[None, :] <= torch.arange(prefix, prefix + ext)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True
    )
    torch.testing.assert_close(attend_prefix_then_causal(q, k, v, prefix, 0.2), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefixes,group", [([12], 3), ([5, 40, 17], 3), ([33, 33], 1)])
def test_low_precision_decode_matches_fp32(dtype, prefixes, group, make_case, run_backend, reference):
    """bf16/fp16 decode takes the matmul path (not SDPA): within a few ulps of the fp32 oracle, padded
    (mixed lengths, masked) and unpadded batches alike, grouped heads included."""
    case = make_case(prefixes, None, group=group, head_dim=64, dtype=dtype, seed=len(prefixes) + group)
    out = run_backend(TorchNativeBackend(case.kv_pool, case.req_pool), case)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float(), reference(case), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("causal", [True, False])
def test_math_attention_with_lse_matches_the_cpu_flash_kernel(causal):
    """The off-CPU path of the prefix/new split (the GPU kernels' oracle) returns what torch's CPU flash
    kernel does: output and per-row log-sum-exp, top-left causal."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 3, 7, 16), torch.randn(1, 3, 7, 16), torch.randn(1, 3, 7, 16)
    if not causal:  # the prefix part: more keys than queries
        k, v = torch.randn(1, 3, 11, 16), torch.randn(1, 3, 11, 16)
    want_o, want_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=0.25
    )[:2]
    got_o, got_lse = math_attention_with_lse(q, k, v, causal, 0.25)
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse.float(), atol=1e-5, rtol=1e-5)
