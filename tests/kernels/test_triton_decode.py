"""Triton split-KV decode vs the torch_native oracle (CPU interpreter here, real kernels on a GPU).

Sizes are tiny because the interpreter runs every program in Python; small split/tile settings make those
tiny sequences still cross chunk and tile boundaries (and leave an empty chunk inside a request).
"""

import pytest
import torch

from radixlm_kernels.triton_backend import TritonBackend, triton_runs_here
from radixlm_kernels.triton_ops import decode_grid_splits
from runtime.model_executor.forward_batch import ForwardBatch

pytestmark = pytest.mark.skipif(not triton_runs_here(), reason="triton cannot run here")

SMALL = dict(max_kv_splits=4, min_split_len=16, decode_block_n=16)
# KV lengths 1, 9, 33, 70: one split; one partial tile; 3 chunks of 16 with a 1-token tail;
# 4 chunks of 32 where the last one is empty.
MIXED_PREFIXES = [0, 8, 32, 69]


@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 128), (4, 64), (1, 128), (3, 64), (4, 128)])
def test_decode_matches_torch_native(group, head_dim, make_case, run_backend, reference, device):
    case = make_case(
        MIXED_PREFIXES,
        None,
        group=group,
        head_dim=head_dim,
        device=device,
        seed=group + head_dim,
        share_prefix=8,
    )
    out = run_backend(TritonBackend(case.kv_pool, case.req_pool, **SMALL), case)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.testing.assert_close(out, reference(case), atol=1e-4, rtol=1e-4)


def test_decode_default_tiles_long_sequence(make_case, run_backend, reference, device):
    # default settings: 300 tokens -> 3 chunks of 128 (min_split_len) read in 64-token tiles
    case = make_case([299, 4], None, group=3, head_dim=64, device=device, seed=7)
    out = run_backend(TritonBackend(case.kv_pool, case.req_pool), case)
    torch.testing.assert_close(out, reference(case), atol=1e-4, rtol=1e-4)


def test_decode_fp16(make_case, run_backend, reference, device):
    # (bf16 is checked on the GPU only: the interpreter's tl.dot mishandles bf16)
    case = make_case(MIXED_PREFIXES, None, group=4, head_dim=64, dtype=torch.float16, device=device, seed=3)
    out = run_backend(TritonBackend(case.kv_pool, case.req_pool, **SMALL), case)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference(case), atol=2e-3, rtol=2e-3)


def test_decode_independent_of_grid_and_batch(make_case, run_backend, device):
    """A request's output depends only on its own KV: not on the launch grid (eager's tight grid vs the
    CUDA-graph grid of max_kv_splits) nor on the other requests in the batch. Bitwise."""
    case = make_case([3, 40, 20], None, group=2, head_dim=64, device=device, seed=11)
    backend = TritonBackend(case.kv_pool, case.req_pool, **SMALL)
    tight = run_backend(backend, case)
    assert backend._decode_grid_splits == 3  # longest request: 41 tokens -> 3 chunks of >= 16
    backend.init_forward_metadata_capture(case.batch)  # graph mode: grid of max_kv_splits = 4
    full = backend.forward_decode(case.q, case.layer, case.batch)
    assert torch.equal(tight, full)

    b = case.batch
    for i in (0, 2):  # alone, these requests get a grid of 1 and 2 splits
        alone = ForwardBatch.build_decode(
            [0], [b.seq_lens_cpu[i]], [int(b.req_pool_indices[i])], b.out_cache_loc[i : i + 1], device=device
        )
        backend.init_forward_metadata(alone)
        out_alone = backend.forward_decode(case.q[i : i + 1], case.layer, alone)
        assert torch.equal(out_alone[0], tight[i])


def test_grid_splits_cover_every_request():
    assert decode_grid_splits(1, 16, 128) == 1
    assert decode_grid_splits(128, 16, 128) == 1
    assert decode_grid_splits(129, 16, 128) == 2
    assert decode_grid_splits(10**6, 16, 128) == 16
    assert decode_grid_splits(0, 16, 128) == 1
