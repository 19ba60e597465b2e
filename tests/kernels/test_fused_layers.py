"""The fused rope and SiLU * up C++ kernels against the torch ops they replace (runtime.models.llama)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime.models.llama import RMSNorm, Rotary
from runtime.models.native_kernels import FUSED_LAYERS
from tests.kernels.native import load_native_or_skip

ROOT = Path(__file__).resolve().parents[2]
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
    with pytest.raises(
        RuntimeError, match="cos and sin must be float32 \\[T, D\\] with a contiguous last dim"
    ):
        torch.ops.radixlm.rope_(
            torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.zeros(1, 8).half(), torch.zeros(1, 8)
        )
    with pytest.raises(RuntimeError, match="must be \\[T, heads, D\\]"):
        torch.ops.radixlm.rope_(
            torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), torch.zeros(1, 8), torch.zeros(1, 8)
        )
    with pytest.raises(RuntimeError, match="silu_mul: x must be"):
        torch.ops.radixlm.silu_mul(torch.zeros(2, 3))


def test_rope_takes_cos_and_sin_as_row_views_of_one_table():
    """Rotary.cos_sin_rows hands rope_ the two halves of one [T, 2D] table: row stride 2D, not D."""
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), 1.0)
    positions = torch.tensor([3, 0, 700, 41])
    cos, sin = rotary.cos_sin_rows(positions, 700)
    assert cos.stride(0) == 128 and not cos.is_contiguous()
    want_cos, want_sin = rotary.cos_sin(positions, torch.float32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)  # the same angles, bit for bit
    assert rotary._table.shape[0] == 1024  # grown to the next power of two past the largest position
    q, k = torch.randn(4, 9, 64), torch.randn(4, 3, 64)
    want_q, want_k = Rotary.apply(q, want_cos, want_sin), Rotary.apply(k, want_cos, want_sin)
    torch.ops.radixlm.rope_(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-5)


NORM_TOL = {
    torch.float32: dict(atol=2e-6, rtol=2e-6),  # summation order only
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2),  # one ulp where the float32 sum rounds the other way
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def _norm_case(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(shape, generator=gen) * 3, torch.randn(shape, generator=gen)
    weight = torch.randn(shape[-1], generator=gen) * 0.2 + 1
    return x.to(dtype), residual.to(dtype), weight.to(dtype)


def _eager_norm(x, weight, eps):
    norm = RMSNorm(weight.shape[0], eps).to(weight.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


# (1, 576): one decode row (no parallel region); (70, 576): rows split across threads; (2, 3, 40): 3-D,
# a hidden size that is not a multiple of the vector width.
SHAPES = [(1, 576), (5, 64), (70, 576), (2, 3, 40)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_the_eager_module(shape, dtype):
    x, _, weight = _norm_case(shape, dtype, seed=len(shape) + shape[0])
    out = torch.ops.radixlm.rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape and out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, _eager_norm(x, weight, 1e-5), **NORM_TOL[dtype])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_add_rms_norm_is_the_residual_add_then_the_norm(shape, dtype):
    x, residual, weight = _norm_case(shape, dtype, seed=shape[0])
    want_residual = residual + x  # DecoderLayer.forward's `h + ...` in the storage dtype
    want = _eager_norm(want_residual, weight, 1e-6)
    torch.ops.radixlm.fused_add_rms_norm_(x, residual, weight, 1e-6)
    assert torch.equal(residual, want_residual)
    torch.testing.assert_close(x, want, **NORM_TOL[dtype])


def test_bad_norm_inputs_are_errors():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(
        RuntimeError, match=r"weight must be a contiguous \[hidden\] matching x's last dim \(8\)"
    ):
        torch.ops.radixlm.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm: weight and x must have one dtype"):
        torch.ops.radixlm.rms_norm(x, w.bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm: x must be contiguous"):
        torch.ops.radixlm.rms_norm(torch.randn(8, 2).t(), w, 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm: x must be float32, bfloat16 or float16"):
        torch.ops.radixlm.rms_norm(x.double(), w.double(), 1e-5)
    with pytest.raises(RuntimeError, match="residual must be contiguous with x's shape and dtype"):
        torch.ops.radixlm.fused_add_rms_norm_(x, torch.randn(3, 8), w, 1e-5)
    with pytest.raises(RuntimeError, match="residual must be contiguous with x's shape and dtype"):
        torch.ops.radixlm.fused_add_rms_norm_(x, torch.randn(2, 8).half(), w, 1e-5)
    with pytest.raises(RuntimeError, match="x and residual must be different tensors"):
        torch.ops.radixlm.fused_add_rms_norm_(x, x, w, 1e-5)
    before = x.clone()
    with pytest.raises(RuntimeError, match="fused_add_rms_norm_: weight must be"):
        torch.ops.radixlm.fused_add_rms_norm_(x, torch.randn(2, 8), torch.ones(4), 1e-5)
    assert torch.equal(x, before)  # checked before anything is written


_PORTABLE_RUN = """
import sys, torch
from runtime.models.native_kernels import FUSED_LAYERS
FUSED_LAYERS.load()
x, residual, weight = torch.load(sys.argv[1])
normed = torch.ops.radixlm.rms_norm(x, weight, 1e-5)
torch.ops.radixlm.fused_add_rms_norm_(x, residual, weight, 1e-5)
torch.save((normed, x, residual), sys.argv[2])
"""


def test_portable_norms_give_the_same_results(tmp_path):
    """RADIXLM_FUSED_LAYERS_PORTABLE=1 builds the scalar loops (another process: one library per op)."""
    args = _norm_case((3, 576), torch.float32, seed=4)
    torch.save(args, tmp_path / "args.pt")
    env = {**os.environ, "RADIXLM_FUSED_LAYERS_PORTABLE": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-c", _PORTABLE_RUN, str(tmp_path / "args.pt"), str(tmp_path / "out.pt")],
        check=True,
        env=env,
        timeout=300,
    )
    normed, x, residual = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(
        torch.ops.radixlm.rms_norm(args[0], args[2], 1e-5), normed, **NORM_TOL[torch.float32]
    )
    torch.ops.radixlm.fused_add_rms_norm_(*args, 1e-5)
    assert torch.equal(args[1], residual)
    torch.testing.assert_close(args[0], x, **NORM_TOL[torch.float32])
