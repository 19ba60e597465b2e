"""TritonBackend through the AttentionBackend interface: KV writes, extend then decode, argument checks."""

import pytest
import torch

from radixlm_kernels import create_backend
from radixlm_kernels.base import AttentionLayer
from radixlm_kernels.torch_native import TorchNativeBackend
from radixlm_kernels.triton_backend import TritonBackend, triton_runs_here
from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool, SlotAllocator
from runtime.model_executor.forward_batch import ForwardBatch

pytestmark = pytest.mark.skipif(not triton_runs_here(), reason="triton cannot run here")

SMALL = dict(max_kv_splits=4, min_split_len=16, decode_block_n=16, extend_block_m=16, extend_block_n=16)


@pytest.mark.parametrize("decode", [False, True])
def test_forward_writes_kv_then_attends(decode, make_case, run_backend, device):
    case = make_case([6, 30], None if decode else [10, 3], group=3, head_dim=64, device=device, seed=4)
    # Zero the new tokens' slots in the pool: only `forward` storing k_new/v_new makes the outputs right.
    loc = case.batch.out_cache_loc
    case.kv_pool.k[0][loc] = 0.0
    case.kv_pool.v[0][loc] = 0.0
    tri = TritonBackend(case.pool_copy(), case.req_pool, **SMALL)
    ref = TorchNativeBackend(case.pool_copy(), case.req_pool)
    out = run_backend(tri, case, write_kv=True)
    expected = run_backend(ref, case, write_kv=True)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(tri.kv_pool.k[0][loc], case.k_new) and torch.equal(tri.kv_pool.v[0][loc], case.v_new)


def test_prefill_then_decode_steps_match_torch_native(device):
    """A short generation: one extend over two prompts (one resuming after a cached prefix), then decode
    steps, each backend with its own pool, fed the same per-layer q/k/v."""
    torch.manual_seed(0)
    hkv, group, dim, layers = 2, 2, 64, 2
    pools = [KVPool(128, layers, hkv, dim, torch.float32, device) for _ in range(2)]
    req_pool = ReqToTokenPool(4, 64, device)
    alloc = SlotAllocator(128, device)
    backends = [TritonBackend(pools[0], req_pool, **SMALL), TorchNativeBackend(pools[1], req_pool)]
    attn = [AttentionLayer(i, hkv * group, hkv, dim, dim**-0.5) for i in range(layers)]
    rows, lens = [1, 3], [0, 0]

    def step(batch: ForwardBatch) -> None:
        for layer in attn:
            n = batch.num_tokens
            q = torch.randn(n, hkv * group, dim, device=device)
            k, v = torch.randn(n, hkv, dim, device=device), torch.randn(n, hkv, dim, device=device)
            outs = []
            for backend in backends:
                backend.init_forward_metadata(batch)
                outs.append(backend.forward(q, k, v, layer, batch))
            torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)

    def extend(new: list[int], prefix: list[int]) -> None:
        locs = []
        for row, p, e in zip(rows, prefix, new, strict=True):
            slots = alloc.alloc(e)
            req_pool.write(row, p, slots)
            locs.append(slots)
        step(ForwardBatch.build_extend([[0] * e for e in new], prefix, rows, torch.cat(locs), device=device))

    extend([5, 19], [0, 0])
    extend([7, 2], [5, 19])  # the second chunk of each prompt attends to the first one as cached prefix
    lens = [12, 21]
    for _ in range(3):
        loc = alloc.alloc(len(rows))
        for i, row in enumerate(rows):
            req_pool.write(row, lens[i], loc[i : i + 1])
        lens = [n + 1 for n in lens]
        step(ForwardBatch.build_decode([0, 0], lens, rows, loc, device=device))


def test_create_backend_by_name(make_case, device):
    case = make_case([3], None, device=device)
    backend = create_backend("triton", case.kv_pool, case.req_pool)
    assert isinstance(backend, TritonBackend) and backend.name == "triton"


def test_rejects_bad_settings_and_missing_metadata(make_case, device):
    case = make_case([3], [4], device=device)
    with pytest.raises(ValueError, match="power of two"):
        TritonBackend(case.kv_pool, case.req_pool, decode_block_n=24)
    with pytest.raises(ValueError, match="max_kv_splits"):
        TritonBackend(case.kv_pool, case.req_pool, max_kv_splits=0)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        TritonBackend(case.kv_pool, case.req_pool).forward_extend(case.q, case.layer, case.batch)
