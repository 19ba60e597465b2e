"""Kernel tests: random paged-KV cases shared as fixtures, and the Triton interpreter on CPU-only machines.

TRITON_INTERPRET must be set before the kernels are decorated (`radixlm_kernels.triton_ops` is imported
lazily by `TritonBackend`), so it is set here, at collection time.
With a GPU the real kernels run on CUDA tensors.
GPU-only test modules mark themselves `gpu` and skip without CUDA.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import pytest
import torch

from radixlm_kernels.base import AttentionLayer
from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool
from runtime.model_executor.forward_batch import ForwardBatch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # Triton tests: real kernels on a GPU, the interpreter otherwise
MAX_REQS = 8


@dataclass
class Case:
    kv_pool: KVPool
    req_pool: ReqToTokenPool
    batch: ForwardBatch
    layer: AttentionLayer
    q: torch.Tensor  # [num_tokens, H, D]
    k_new: torch.Tensor  # [num_tokens, Hkv, D]: what the new tokens' K/V are (already in the pool)
    v_new: torch.Tensor

    def pool_copy(self, dtype: torch.dtype | None = None) -> KVPool:
        """Deep copy of the KV pool (optionally converted), for backends that write into it."""
        pool = copy.deepcopy(self.kv_pool)
        if dtype is not None:
            pool.dtype = dtype
            pool.k = [k.to(dtype) for k in pool.k]
            pool.v = [v.to(dtype) for v in pool.v]
        return pool


def _make_case(
    prefix_lens: list[int],
    extend_lens: list[int] | None,
    *,
    num_kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    share_prefix: int = 0,
    layer_id: int = 0,
) -> Case:
    """A batch over a randomly filled pool.

    extend_lens None: a decode batch whose requests hold `prefix_lens[i] + 1` tokens (the last one new).
    Otherwise an extend batch: request i has `prefix_lens[i]` cached tokens and `extend_lens[i]` new ones.
    Slots are scattered (a random permutation) and rows are not 0..bs-1. With share_prefix = n, request 1
    reuses request 0's first n slots, as the radix cache makes requests do.
    """
    gen = torch.Generator().manual_seed(seed)
    decode = extend_lens is None
    ext = [1] * len(prefix_lens) if decode else list(extend_lens)
    seq = [p + e for p, e in zip(prefix_lens, ext, strict=True)]
    size = sum(seq) + 7
    num_heads = num_kv_heads * group
    kv_pool = KVPool(size, layer_id + 1, num_kv_heads, head_dim, dtype, device)
    for buf in (*kv_pool.k, *kv_pool.v):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    req_pool = ReqToTokenPool(MAX_REQS, max(seq) + 5, device)
    rows = torch.randperm(MAX_REQS, generator=gen)[: len(seq)].tolist()
    free = (torch.randperm(size, generator=gen) + 1).tolist()  # slot 0 is the dummy
    out_cache_loc = []
    for i, (row, n) in enumerate(zip(rows, seq, strict=True)):
        slots = [free.pop() for _ in range(n)]
        if i == 1 and share_prefix:
            shared = min(share_prefix, prefix_lens[0], prefix_lens[1])
            slots[:shared] = req_pool.req_to_token[rows[0], :shared].tolist()
        req_pool.req_to_token[row, :n] = torch.tensor(slots, device=device)
        out_cache_loc += slots[n - ext[i] :]
    loc = torch.tensor(out_cache_loc, dtype=torch.int64)
    layer = AttentionLayer(layer_id, num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    if decode:
        batch = ForwardBatch.build_decode([0] * len(seq), seq, rows, loc, device=device)
    else:
        batch = ForwardBatch.build_extend([[0] * e for e in ext], prefix_lens, rows, loc, device=device)
    q = torch.randn((sum(ext), num_heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    k_new = kv_pool.k[layer_id][loc.to(device)].clone()
    v_new = kv_pool.v[layer_id][loc.to(device)].clone()
    return Case(kv_pool, req_pool, batch, layer, q, k_new, v_new)


def _run_backend(backend, case: Case, write_kv: bool = False) -> torch.Tensor:
    """Plan and run one layer; write_kv=True goes through `forward` (store the new K/V, then attend)."""
    backend.init_forward_metadata(case.batch)
    if write_kv:
        return backend.forward(case.q, case.k_new, case.v_new, case.layer, case.batch)
    if case.batch.is_decode:
        return backend.forward_decode(case.q, case.layer, case.batch)
    return backend.forward_extend(case.q, case.layer, case.batch)


def _reference(case: Case) -> torch.Tensor:
    """torch_native in fp32 on a copy of the pool: the oracle for every backend and dtype."""
    from radixlm_kernels.torch_native import TorchNativeBackend

    ref = TorchNativeBackend(case.pool_copy(torch.float32), case.req_pool)
    q32 = Case(ref.kv_pool, case.req_pool, case.batch, case.layer, case.q.float(), case.k_new, case.v_new)
    return _run_backend(ref, q32)


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def make_case():
    return _make_case


@pytest.fixture
def run_backend():
    return _run_backend


@pytest.fixture
def reference():
    return _reference
