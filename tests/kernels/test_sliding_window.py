"""Sliding-window layers (`AttentionLayer.sliding_window`): torch_native and the cpu backend against a
brute-force reference that attends each query to the keys at positions p - W + 1 .. p, read straight from
the slot table, over decode batches, short (fused) extends and long extends over cached prefixes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixlm_kernels.cpu_backend import FUSED_MAX_EXTEND, CpuPagedBackend
from radixlm_kernels.torch_native import WINDOW_QUERY_BLOCK, TorchNativeBackend
from runtime.models.native_kernels import PAGED_ATTENTION
from tests.kernels.native import load_native_or_skip


def brute_force(case, window: int) -> torch.Tensor:
    """float64, one query at a time: keys max(0, p - window + 1) .. p of its request."""
    b = case.batch
    k_buf = case.kv_pool.k[case.layer.layer_id].double()
    v_buf = case.kv_pool.v[case.layer.layer_id].double()
    ext = [1] * b.batch_size if b.is_decode else b.extend_seq_lens_cpu
    group = case.layer.num_heads // case.layer.num_kv_heads
    out, t = [], 0
    for row, seq, e in zip(b.req_pool_indices.tolist(), b.seq_lens_cpu, ext, strict=True):
        for j in range(e):
            p = seq - e + j
            slots = case.req_pool.req_to_token[row, max(0, p - window + 1) : p + 1]
            k = k_buf[slots].repeat_interleave(group, dim=1)  # [n, H, D]
            v = v_buf[slots].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", case.q[t].double(), k) * case.layer.scaling
            out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
            t += 1
    return torch.stack(out).float()


CASES = {
    # (cached prefix lengths, new tokens per request or None for a decode batch)
    "decode": ([40, 3, 17, 70], None),
    "decode-shared-prefix": ([64, 64], None),
    "short-extend": ([30, 0, 9], [5, 12, 1]),
    "long-extend-over-prefix": ([50, 0], [40, 2 * WINDOW_QUERY_BLOCK + 7]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("window", [1, 8, 33, 4096])
@pytest.mark.parametrize(
    "backend_cls",
    # the cpu backend builds a C++ kernel on first use (the fast tier needs no compiler)
    [TorchNativeBackend, pytest.param(CpuPagedBackend, marks=pytest.mark.slow)],
    ids=["torch_native", "cpu"],
)
def test_window_matches_brute_force(make_case, backend_cls, name, window):
    if backend_cls is CpuPagedBackend:
        load_native_or_skip(PAGED_ATTENTION)
    prefix, ext = CASES[name]
    case = make_case(prefix, ext, num_kv_heads=2, group=2, head_dim=32, share_prefix=32, seed=3)
    case = dataclasses.replace(case, layer=dataclasses.replace(case.layer, sliding_window=window))
    want = brute_force(case, window)
    backend = backend_cls(case.pool_copy(), case.req_pool)
    backend.init_forward_metadata(case.batch)
    got = backend.forward(case.q, case.k_new, case.v_new, case.layer, case.batch)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    if window >= 4096:  # a window past every sequence is global attention
        full = dataclasses.replace(case.layer, sliding_window=0)
        backend.init_forward_metadata(case.batch)
        torch.testing.assert_close(
            backend.forward(case.q, case.k_new, case.v_new, full, case.batch), got, atol=2e-5, rtol=1e-4
        )


@pytest.mark.slow  # builds a C++ kernel on first use
def test_short_extends_take_the_fused_op(make_case):
    """The cpu backend's windowed extend of <= FUSED_MAX_EXTEND tokens runs the C++ op over its per-token
    window table (not torch_native's masked path), and a window that cuts the prefix changes the result."""
    load_native_or_skip(PAGED_ATTENTION)
    case = make_case([60], [FUSED_MAX_EXTEND], seed=5)
    windowed = dataclasses.replace(case.layer, sliding_window=16)
    backend = CpuPagedBackend(case.pool_copy(), case.req_pool)
    backend.init_forward_metadata(case.batch)
    assert backend._fused
    got = backend.forward(case.q, case.k_new, case.v_new, windowed, case.batch)
    table = backend._windows[16][0]
    assert table.shape == (FUSED_MAX_EXTEND, 16)
    torch.testing.assert_close(
        got, brute_force(dataclasses.replace(case, layer=windowed), 16), atol=2e-5, rtol=1e-4
    )
    assert (got - brute_force(case, 10**6)).abs().max() > 1e-2


@pytest.mark.slow  # builds a C++ kernel on first use
@pytest.mark.parametrize("name", ["decode", "short-extend"])
def test_oversized_window_tables_take_the_masked_path(make_case, monkeypatch, name):
    """A per-token window table past WINDOW_TABLE_MAX slots is not built: the layer runs torch_native's
    masked path over the same pool, with the same result."""
    import radixlm_kernels.cpu_backend as cpu_backend

    load_native_or_skip(PAGED_ATTENTION)
    monkeypatch.setattr(cpu_backend, "WINDOW_TABLE_MAX", 16)
    prefix, ext = CASES[name]
    case = make_case(prefix, ext, num_kv_heads=2, group=2, head_dim=32, seed=4)
    case = dataclasses.replace(case, layer=dataclasses.replace(case.layer, sliding_window=8))
    backend = CpuPagedBackend(case.pool_copy(), case.req_pool)
    backend.init_forward_metadata(case.batch)
    got = backend.forward(case.q, case.k_new, case.v_new, case.layer, case.batch)
    assert backend._fused and backend._windows[8] is None
    torch.testing.assert_close(got, brute_force(case, 8), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("window", [1, 8, 33])
def test_triton_window_matches_brute_force(make_case, device, name, window):
    """The Triton kernels (the interpreter on a CPU-only machine, small tiles so windows cross blocks and
    decode splits): the window is a kernel argument, so decode stays CUDA-graph capturable."""
    from radixlm_kernels.triton_backend import TritonBackend, triton_runs_here

    if not triton_runs_here():
        pytest.skip("triton cannot run here")
    prefix, ext = CASES[name]
    if name == "long-extend-over-prefix":  # the interpreter runs a program per tile: keep it short
        prefix, ext = [50, 0], [40, 37]
    shape = dict(num_kv_heads=2, group=2, head_dim=32)
    case = make_case(prefix, ext, **shape, share_prefix=32, seed=3, device=device)
    case = dataclasses.replace(case, layer=dataclasses.replace(case.layer, sliding_window=window))
    small = dict(max_kv_splits=4, min_split_len=16, decode_block_n=16, extend_block_m=16, extend_block_n=16)
    backend = TritonBackend(case.pool_copy(), case.req_pool, **small)
    backend.init_forward_metadata(case.batch)
    got = backend.forward(case.q, case.k_new, case.v_new, case.layer, case.batch)
    torch.testing.assert_close(got.cpu(), brute_force(case, window).cpu(), atol=2e-4, rtol=1e-3)
