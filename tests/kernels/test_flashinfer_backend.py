"""FlashInfer backend: page-table building and the missing-package error on any machine; on a GPU, agreement
of torch_native, triton and flashinfer with an fp32 oracle in fp16/bf16."""

import sys

import pytest
import torch

from radixlm_kernels import create_backend
from radixlm_kernels.flashinfer_backend import FlashInferBackend, build_paged_kv_csr, import_flashinfer
from radixlm_kernels.triton_backend import triton_runs_here
from runtime.model_executor.forward_batch import ForwardBatch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")


def test_csr_lists_each_request_slots_in_order(make_case):
    case = make_case([5, 6, 20], None, share_prefix=4, seed=1)  # request 1 reuses request 0's first 4 slots
    b, table = case.batch, case.req_pool.req_to_token
    indptr, indices = build_paged_kv_csr(table, b.req_pool_indices, b.seq_lens, b.seq_lens_cpu)
    assert indptr.dtype == torch.int32 and indices.dtype == torch.int32 and indptr.device.type == "cpu"
    assert indptr.tolist() == [0, 6, 13, 34]
    for i, (row, n) in enumerate(zip(b.req_pool_indices.tolist(), b.seq_lens_cpu, strict=True)):
        assert indices[indptr[i] : indptr[i + 1]].tolist() == table[row, :n].tolist()
    assert indices[6:10].tolist() == indices[0:4].tolist()  # shared prefix slots repeat


def test_csr_empty_batch():
    indptr, indices = build_paged_kv_csr(
        torch.zeros(2, 4, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        [],
    )
    assert indptr.tolist() == [0] and indices.numel() == 0


def test_missing_flashinfer_is_a_clear_import_error(monkeypatch, make_case):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` now fails, installed or not
    with pytest.raises(ImportError, match=r"pip install 'radixlm\[gpu\]'"):
        import_flashinfer()
    case = make_case([3], None)
    with pytest.raises(ImportError, match="flashinfer-python"):
        FlashInferBackend(case.kv_pool, case.req_pool)


# ---- GPU ------------------------------------------------------------------------------------------------
def _gpu_backends(case, with_geometry: bool):
    names = ["torch_native"] + (["triton"] if triton_runs_here() else [])
    backends = [create_backend(n, case.kv_pool, case.req_pool) for n in names]
    try:
        import_flashinfer()
    except ImportError:
        return backends
    extra = dict(num_heads=case.layer.num_heads, scaling=case.layer.scaling) if with_geometry else {}
    return backends + [FlashInferBackend(case.kv_pool, case.req_pool, **extra)]


# a few (dtype, GQA group, head_dim) combinations rather than the full product: every new combination costs
# FlashInfer a JIT compile on a fresh machine
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize(
    "dtype,group,head_dim",
    [(torch.float16, 1, 64), (torch.bfloat16, 3, 64), (torch.float16, 4, 128), (torch.bfloat16, 4, 128)],
)
@pytest.mark.gpu
@requires_cuda
def test_backends_agree_on_gpu(dtype, group, head_dim, decode, make_case, run_backend, reference):
    prefixes = [0, 17, 300, 1000]
    case = make_case(
        prefixes,
        None if decode else [1, 33, 100, 7],
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
        seed=group * head_dim,
        share_prefix=10,
    )
    expected = reference(case)
    tol = 5e-3 if dtype == torch.float16 else 2e-2
    backends = _gpu_backends(case, with_geometry=bool(group % 2))
    assert "triton" in [b.name for b in backends]
    for backend in backends:
        out = run_backend(backend, case)
        assert out.dtype == dtype, backend.name
        torch.testing.assert_close(
            out.float(), expected, atol=tol, rtol=tol, msg=lambda m, n=backend.name: f"{n}: {m}"
        )


@pytest.mark.gpu
@requires_cuda
def test_flashinfer_forward_writes_kv_and_replans_per_batch(make_case, run_backend, reference):
    pytest.importorskip("flashinfer")
    first = make_case([40, 3], [5, 9], group=3, head_dim=64, dtype=torch.float16, device="cuda", seed=1)
    backend = FlashInferBackend(first.kv_pool, first.req_pool)  # geometry learned at the first forward
    expected = reference(first)
    first.kv_pool.k[0][first.batch.out_cache_loc] = 0
    first.kv_pool.v[0][first.batch.out_cache_loc] = 0
    out = run_backend(backend, first, write_kv=True)
    torch.testing.assert_close(out.float(), expected, atol=5e-3, rtol=5e-3)
    # a decode batch over the same pool: init_forward_metadata plans with the remembered geometry
    b = first.batch
    dec = ForwardBatch.build_decode(
        [0, 0], b.seq_lens_cpu, b.req_pool_indices.tolist(), b.out_cache_loc[[4, 13]], device="cuda"
    )
    backend.init_forward_metadata(dec)
    assert backend._planned == (first.layer.num_heads, first.layer.scaling)
    q = torch.randn(2, first.layer.num_heads, 64, device="cuda", dtype=torch.float16)
    ref = create_backend("torch_native", first.kv_pool, first.req_pool)
    ref.init_forward_metadata(dec)
    torch.testing.assert_close(
        backend.forward_decode(q, first.layer, dec).float(),
        ref.forward_decode(q, first.layer, dec).float(),
        atol=5e-3,
        rtol=5e-3,
    )
