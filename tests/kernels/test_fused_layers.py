"""The fused rope and SiLU * up C++ kernels against the torch ops they replace (runtime.models.llama)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.models.llama import Rotary
from runtime.models.native_kernels import FUSED_LAYERS
from tests.kernels.native import load_native_or_skip

pytestmark = pytest.mark.slow  # builds a C++ kernel on first use (the fast tier needs no compiler)


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    load_native_or_skip(FUSED_LAYERS)


@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_views_of_the_qkv_projection(tokens, dtype):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)
    q, k, v = qkv.split([576, 192, 192], dim=-1)
    q, k = q.view(tokens, 9, 64), k.view(tokens, 3, 64)  # strided views, as Attention.forward has them
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), 1.0)
    cos, sin = rotary.cos_sin(torch.arange(100, 100 + tokens), torch.float32)
    want_q, want_k = Rotary.apply(q.float(), cos, sin), Rotary.apply(k.float(), cos, sin)
    v_before = v.clone()
    torch.ops.radixlm.rope_(q, k, cos, sin)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(q.float(), want_q, **tol)
    torch.testing.assert_close(k.float(), want_k, **tol)
    assert torch.equal(v, v_before)  # only q and k are written


@pytest.mark.parametrize("tokens", [1, 33])
def test_silu_mul_matches_torch(tokens):
    x = torch.randn(tokens, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 6
    want = F.silu(x[:, :1536]) * x[:, 1536:]
    torch.testing.assert_close(torch.ops.radixlm.silu_mul(x), want, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_errors():
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous float32"):
        torch.ops.radixlm.rope_(
            torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.zeros(1, 8).half(), torch.zeros(1, 8)
        )
    with pytest.raises(RuntimeError, match="must be \\[T, heads, D\\]"):
        torch.ops.radixlm.rope_(
            torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), torch.zeros(1, 8), torch.zeros(1, 8)
        )
    with pytest.raises(RuntimeError, match="silu_mul: x must be"):
        torch.ops.radixlm.silu_mul(torch.zeros(2, 3))
