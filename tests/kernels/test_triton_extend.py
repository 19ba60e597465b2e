"""Triton extend (new tokens over a cached prefix + causal self-attention) vs the torch_native oracle."""

import pytest
import torch

from radixlm_kernels.triton_backend import TritonBackend, triton_runs_here

pytestmark = pytest.mark.skipif(not triton_runs_here(), reason="triton cannot run here")

SMALL = dict(extend_block_m=16, extend_block_n=16)
# prefixes from none to several tiles; new-token counts from 1 to more than two 16-row blocks; a prefix
# that ends mid-tile so the causal part starts inside a tile
PREFIXES = [0, 5, 40, 16, 0]
EXTENDS = [1, 12, 30, 17, 35]


@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 128), (4, 64), (1, 128), (3, 64), (4, 128)])
def test_extend_matches_torch_native(group, head_dim, make_case, run_backend, reference, device):
    case = make_case(
        PREFIXES,
        EXTENDS,
        group=group,
        head_dim=head_dim,
        device=device,
        seed=group * head_dim,
        share_prefix=5,
    )
    out = run_backend(TritonBackend(case.kv_pool, case.req_pool, **SMALL), case)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(out, reference(case), atol=1e-4, rtol=1e-4)


def test_extend_default_tiles(make_case, run_backend, reference, device):
    case = make_case([70, 0], [20, 66], group=3, head_dim=64, device=device, seed=5)
    out = run_backend(TritonBackend(case.kv_pool, case.req_pool), case)
    torch.testing.assert_close(out, reference(case), atol=1e-4, rtol=1e-4)


def test_extend_fp16(make_case, run_backend, reference, device):
    case = make_case([0, 21], [9, 18], group=4, head_dim=64, dtype=torch.float16, device=device, seed=9)
    out = run_backend(TritonBackend(case.kv_pool, case.req_pool, **SMALL), case)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference(case), atol=2e-3, rtol=2e-3)


def test_extend_is_causal(make_case, run_backend, device):
    """Changing the K/V of a request's last new token changes only that token's output."""
    case = make_case([4], [20], group=1, head_dim=64, device=device, seed=2)
    backend = TritonBackend(case.kv_pool, case.req_pool, **SMALL)
    before = run_backend(backend, case)
    last_slot = case.batch.out_cache_loc[-1]
    case.kv_pool.k[0][last_slot] += 1.0
    case.kv_pool.v[0][last_slot] += 1.0
    after = run_backend(backend, case)
    assert torch.equal(before[:-1], after[:-1])
    assert not torch.allclose(before[-1], after[-1])
