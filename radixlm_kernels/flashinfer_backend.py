"""FlashInfer attention backend (NVIDIA GPUs only).

FlashInfer's wrappers split attention into `plan()` (once per batch: page table in CSR form, work schedule
in a workspace buffer) and `run()` (once per layer). Our KV pool is paged with page size 1, so a request's
page list is simply its slots `req_to_token[row, :seq_len]`, and every last page holds one token.

`plan()` also needs the number of query heads and the softmax scale, which the `AttentionBackend`
constructor does not receive. Pass them as `num_heads` / `scaling` to plan in `init_forward_metadata`;
otherwise the first layer's `forward` plans (the geometry is then remembered for the following batches).
CUDA-graph decode needs the geometry before capture; `CudaGraphRunner` runs one eager forward first.

FlashInfer takes fp16/bf16 KV only; q is cast to the pool's dtype for the kernels and the output cast back.
"""

from __future__ import annotations

from typing import Any

import torch

from radixlm_kernels.base import AttentionBackend, AttentionBatch, AttentionLayer, PagedKV, ReqToTokenTable

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-KV partials)
_TENSOR_CORE_MIN_GROUP = 4  # GQA groups this large decode faster with the prefill (tensor-core) kernels


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(
            "the flashinfer attention backend needs the `flashinfer-python` package and an NVIDIA GPU: "
            "`pip install 'radixlm[gpu]'`, or choose --attention-backend triton or torch_native"
        ) from e
    return flashinfer


def build_paged_kv_csr(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page table for page size 1: (indptr [bs + 1] int32 on the CPU, indices [sum(seq_lens)] int32 on the
    device) with request b's slots at `indices[indptr[b]:indptr[b + 1]] == req_to_token[row_b, :seq_len_b]`.

    Sizes come from `seq_lens_cpu`, so building it never waits on the GPU.
    """
    bs = len(seq_lens_cpu)
    indptr = torch.zeros(bs + 1, dtype=torch.int32)
    if bs:
        indptr[1:] = torch.cumsum(torch.tensor(seq_lens_cpu, dtype=torch.int32), 0)
    total = int(indptr[-1])
    device = req_to_token.device
    req_of = torch.repeat_interleave(torch.arange(bs, device=device), seq_lens, output_size=total)  # [total]
    starts = torch.cumsum(seq_lens, 0) - seq_lens  # [bs] first index of each request
    pos = torch.arange(total, device=device) - starts[req_of]  # token position within its request
    indices = req_to_token[req_pool_indices[req_of], pos].to(torch.int32)
    return indptr, indices


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        kv_pool: PagedKV,
        req_to_token_pool: ReqToTokenTable,
        *,
        num_heads: int | None = None,
        scaling: float | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
    ):
        super().__init__(kv_pool, req_to_token_pool)
        self._fi = import_flashinfer()
        self.device = kv_pool.k[0].device
        if self.device.type != "cuda":
            raise RuntimeError(f"the flashinfer backend runs on CUDA only (KV pool is on {self.device})")
        if kv_pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"flashinfer needs a float16 or bfloat16 KV pool, got {kv_pool.dtype}; "
                "use --dtype float16/bfloat16 or another attention backend"
            )
        self.dtype = kv_pool.dtype
        # zeroed: FlashInfer requires the float workspace to be zero on first use
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # created at the first plan: whether it uses tensor cores depends on the GQA group
        self._eager_decode: Any = None
        self._graph_decode: dict[int, Any] = {}  # padded batch size -> cuda-graph decode wrapper
        self._decode: Any = None  # the decode wrapper planned for the current batch
        self._num_heads = num_heads
        self._scaling = scaling
        self._batch_is_decode = False
        self._csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self._planned: tuple[int, float] | None = None  # (num_heads, scaling) of the current plan
        self._last_page_len = torch.ones(0, dtype=torch.int32)

    # ---- planning -----------------------------------------------------------------------------------------
    def init_forward_metadata(self, batch: AttentionBatch) -> None:
        self._set_batch(batch)
        if batch.is_decode:
            self._decode = self._eager_decode  # None until the geometry is known; _plan creates it
        self._plan_if_geometry_known()

    def _set_batch(self, batch: AttentionBatch) -> None:
        table = self.req_to_token_pool.req_to_token
        indptr, indices = build_paged_kv_csr(
            table, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_cpu
        )
        qo_indptr = None
        if not batch.is_decode:
            qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(torch.tensor(batch.extend_seq_lens_cpu, dtype=torch.int32), 0)
        self._batch_is_decode = batch.is_decode
        self._csr = (indptr, indices, qo_indptr)
        if self._last_page_len.numel() < batch.batch_size:
            self._last_page_len = torch.ones(
                max(batch.batch_size, 2 * self._last_page_len.numel()), dtype=torch.int32
            )
        self._planned = None

    def _plan_if_geometry_known(self) -> None:
        if self._num_heads is not None and self._scaling is not None:
            self._plan(self._num_heads, self._scaling)

    def _plan(self, num_heads: int, scaling: float) -> None:
        assert self._csr is not None, "init_forward_metadata(batch) must be called before forward"
        indptr, indices, qo_indptr = self._csr
        bs = indptr.numel() - 1
        num_kv_heads, head_dim = self.kv_pool.num_kv_heads, self.kv_pool.head_dim
        last_page_len = self._last_page_len[:bs]
        dtypes = dict(q_data_type=self.dtype, kv_data_type=self.dtype)
        if self._batch_is_decode:
            if self._decode is None:
                self._eager_decode = self._new_decode_wrapper(num_heads)
                self._decode = self._eager_decode
            self._decode.plan(
                indptr,
                indices,
                last_page_len,
                num_heads,
                num_kv_heads,
                head_dim,
                1,
                sm_scale=scaling,
                **dtypes,
            )
        else:
            self._prefill.plan(
                qo_indptr, indptr, indices, last_page_len, num_heads, num_kv_heads, head_dim, 1,
                causal=True, sm_scale=scaling, **dtypes,
            )  # fmt: skip
        self._num_heads, self._scaling = num_heads, scaling
        self._planned = (num_heads, scaling)

    def _new_decode_wrapper(self, num_heads: int, **graph_buffers: Any) -> Any:
        group = num_heads // self.kv_pool.num_kv_heads
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=group >= _TENSOR_CORE_MIN_GROUP, **graph_buffers
        )

    def _ensure_planned(self, layer: AttentionLayer) -> None:
        if self._planned != (layer.num_heads, layer.scaling):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("flashinfer: planning inside CUDA-graph capture; plan before capturing")
            self._plan(layer.num_heads, layer.scaling)

    # ---- CUDA-graph hooks (runtime/model_executor/cuda_graph_runner.py) -----------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        max_indices = max_bs * self.req_to_token_pool.max_context_len  # shared prefixes repeat slots
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._g_indices = torch.zeros(max_indices, dtype=torch.int32, device=self.device)
        self._g_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture(self, batch: AttentionBatch) -> None:
        if self._num_heads is None or self._scaling is None:
            raise RuntimeError("flashinfer: the attention geometry is unknown; run an eager forward first")
        bs = batch.batch_size
        self._graph_decode[bs] = self._new_decode_wrapper(
            self._num_heads,
            use_cuda_graph=True,
            paged_kv_indptr_buffer=self._g_indptr[: bs + 1],
            paged_kv_indices_buffer=self._g_indices,
            paged_kv_last_page_len_buffer=self._g_last_page_len[:bs],
        )
        self.init_forward_metadata_replay(batch)

    def init_forward_metadata_replay(self, batch: AttentionBatch) -> None:
        """Re-plan the graph wrapper of this padded batch size; plan writes into the captured buffers."""
        self._set_batch(batch)
        self._decode = self._graph_decode[batch.batch_size]
        self._plan_if_geometry_known()

    # ---- per-layer attention ------------------------------------------------------------------------------
    def _paged_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        # NHD paged layout [num_pages, page_size, Hkv, D]: the pool [size + 1, Hkv, D] with page_size 1
        return self.kv_pool.k[layer_id].unsqueeze(1), self.kv_pool.v[layer_id].unsqueeze(1)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        self._ensure_planned(layer)
        out = self._prefill.run(q.to(self.dtype).contiguous(), self._paged_kv(layer.layer_id))
        return out.to(q.dtype)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        self._ensure_planned(layer)
        out = self._decode.run(q.to(self.dtype).contiguous(), self._paged_kv(layer.layer_id))
        return out.to(q.dtype)
