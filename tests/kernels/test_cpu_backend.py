"""The `cpu` attention backend (C++ paged attention over the pool) against the torch_native oracle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixlm_kernels import create_backend, resolve_backend_name
from radixlm_kernels.cpu_backend import FUSED_MAX_EXTEND, CpuPagedBackend
from runtime.models.native_kernels import PAGED_ATTENTION
from tests.kernels.native import load_native_or_skip

pytestmark = pytest.mark.slow  # builds a C++ kernel on first use (the fast tier needs no compiler)


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    load_native_or_skip(PAGED_ATTENTION)


ROOT = Path(__file__).resolve().parents[2]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [
        ([0, 5, 130], None),  # decode: 1, 6 and 131 keys
        ([700], None),  # one long request: split across threads and merged
        ([40, 3, 0], [7, 1, 12]),  # short extends after cached prefixes, one without a prefix
        ([300, 300], [FUSED_MAX_EXTEND, 2]),  # the largest fused extend
    ],
)
def test_matches_torch_native(dtype, prefix_lens, extend_lens, make_case, run_backend, reference):
    case = make_case(prefix_lens, extend_lens, num_kv_heads=3, group=3, dtype=dtype, seed=len(prefix_lens))
    out = run_backend(CpuPagedBackend(case.pool_copy(), case.req_pool), case)
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float(), reference(case), **TOL[dtype])


def test_shared_prefix_slots_and_kv_write(make_case, run_backend, reference):
    """Two requests read the same cached slots (radix-cache sharing); `forward` stores the new K/V first."""
    case = make_case([64, 80], None, num_kv_heads=2, group=2, share_prefix=50, seed=3)
    loc = case.batch.out_cache_loc
    case.kv_pool.k[0][loc] = 0.0  # only the write in `forward` makes the result right
    case.kv_pool.v[0][loc] = 0.0
    backend = CpuPagedBackend(case.pool_copy(), case.req_pool)
    out = run_backend(backend, case, write_kv=True)
    assert torch.equal(backend.kv_pool.k[0][loc], case.k_new)
    expected = run_backend(CpuPagedBackend(case.pool_copy(), case.req_pool), case, write_kv=True)
    torch.testing.assert_close(out, expected)
    case.kv_pool.k[0][loc], case.kv_pool.v[0][loc] = case.k_new, case.v_new
    torch.testing.assert_close(out, reference(case), atol=2e-5, rtol=1e-4)


def test_long_extend_takes_the_sdpa_path(make_case, run_backend, reference):
    case = make_case([10], [FUSED_MAX_EXTEND + 1], num_kv_heads=1, group=3, seed=5)
    backend = CpuPagedBackend(case.pool_copy(), case.req_pool)
    out = run_backend(backend, case)
    assert not backend._fused
    torch.testing.assert_close(out, reference(case), atol=2e-5, rtol=1e-4)


def test_bad_metadata_is_an_error_not_a_wild_read():
    q = torch.zeros(2, 4, 64)
    k = torch.zeros(10, 2, 64)
    table = torch.zeros(2, 8, dtype=torch.int64)
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="sum\\(ext_lens\\) must equal"):
        torch.ops.radixlm.paged_attention(q, k, k, table, one, torch.tensor([3]), torch.tensor([1]), 0.1)
    with pytest.raises(RuntimeError, match="ext_len <= seq_len <= req_to_token's width"):
        torch.ops.radixlm.paged_attention(q, k, k, table, one, torch.tensor([9]), torch.tensor([2]), 0.1)
    with pytest.raises(RuntimeError, match="valid row"):
        torch.ops.radixlm.paged_attention(
            q, k, k, table, torch.tensor([5]), torch.tensor([3]), torch.tensor([2]), 0.1
        )


_PORTABLE_RUN = """
import sys, torch
from runtime.models.native_kernels import PAGED_ATTENTION
PAGED_ATTENTION.load()
args = torch.load(sys.argv[1])
torch.save(torch.ops.radixlm.paged_attention(*args), sys.argv[2])
"""


def test_portable_build_gives_the_same_results(tmp_path):
    """RADIXLM_PAGED_ATTENTION_PORTABLE=1 builds the scalar loops (another process: one library per op):
    the same answers as this process's vector build."""
    gen = torch.Generator().manual_seed(9)
    k, v = torch.randn(400, 3, 64, generator=gen), torch.randn(400, 3, 64, generator=gen)
    table = (torch.randperm(399, generator=gen) + 1)[:360].view(3, 120)
    args = (
        torch.randn(5, 9, 64, generator=gen),
        k,
        v,
        table,
        torch.tensor([2, 0]),
        torch.tensor([120, 77]),
        torch.tensor([4, 1]),
        0.125,
    )
    torch.save(args, tmp_path / "args.pt")
    env = {**os.environ, "RADIXLM_PAGED_ATTENTION_PORTABLE": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-c", _PORTABLE_RUN, str(tmp_path / "args.pt"), str(tmp_path / "out.pt")],
        check=True,
        env=env,
        timeout=300,
    )
    portable = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(torch.ops.radixlm.paged_attention(*args), portable, atol=1e-5, rtol=1e-5)


def test_auto_is_cpu_on_the_cpu_and_cpu_is_refused_elsewhere(make_case):
    assert resolve_backend_name("auto", "cpu") == "cpu"
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_backend_name("cpu", "cuda")
    case = make_case([4], None)
    assert isinstance(create_backend("cpu", case.kv_pool, case.req_pool), CpuPagedBackend)
