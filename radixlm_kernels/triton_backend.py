"""Triton attention backend: split-KV decode and prefix-aware extend kernels over the paged KV pool.

Runs on CUDA, and on CPU tensors under `TRITON_INTERPRET=1` (slow; for tests). The kernels read KV slots
straight from `req_to_token`, so the per-batch metadata is tiny: for extend three [bs] index tensors, for
decode only the launch grid size. Decode reads nothing on the host during a layer's forward, which makes
it CUDA-graph capturable (see `init_forward_metadata_capture` and
`runtime/model_executor/cuda_graph_runner.py`).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from radixlm_kernels.base import AttentionBackend, AttentionBatch, AttentionLayer, PagedKV, ReqToTokenTable


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_here() -> bool:
    """True when triton imports and can execute: on a CUDA GPU, or on the CPU under TRITON_INTERPRET=1."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken triton install means "not available", not a crash at backend selection
        return False
    return torch.cuda.is_available() or _interpreting()


class TritonBackend(AttentionBackend):
    """Attention with the kernels in `radixlm_kernels.triton_ops`.

    Tuning knobs (defaults fit a GPU; tests pass small values to exercise splitting on tiny inputs):
    `max_kv_splits` / `min_split_len` bound how a decode request's KV is split across programs;
    `decode_block_n`, `extend_block_m`, `extend_block_n` are the kernels' tile sizes (powers of two >= 16).
    """

    name = "triton"
    supports_sliding_window = True  # a kernel argument per layer: decode stays CUDA-graph capturable

    def __init__(
        self,
        kv_pool: PagedKV,
        req_to_token_pool: ReqToTokenTable,
        *,
        max_kv_splits: int = 16,
        min_split_len: int = 128,
        decode_block_n: int = 64,
        extend_block_m: int = 64,
        extend_block_n: int = 64,
    ):
        super().__init__(kv_pool, req_to_token_pool)
        if not triton_runs_here():
            raise RuntimeError(
                "the triton backend needs triton and a CUDA GPU (or TRITON_INTERPRET=1 for tests)"
            )
        device = kv_pool.k[0].device
        if device.type != "cuda" and not _interpreting():
            raise RuntimeError(
                f"the triton backend runs on CUDA tensors (KV pool is on {device}); "
                "CPU tensors only work under TRITON_INTERPRET=1"
            )
        for name, val in (
            ("decode_block_n", decode_block_n),
            ("extend_block_m", extend_block_m),
            ("extend_block_n", extend_block_n),
        ):
            if val < 16 or val & (val - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {val}")
        if max_kv_splits < 1 or min_split_len < 1:
            raise ValueError("max_kv_splits and min_split_len must be >= 1")
        # Imported here, not at module import: the kernels must be decorated after TRITON_INTERPRET is set.
        from radixlm_kernels import triton_ops

        if (
            device.type != "cuda"
            and type(triton_ops.decode._decode_split_kernel).__name__ != "InterpretedFunction"
        ):
            raise RuntimeError(
                "radixlm_kernels.triton_ops was imported before TRITON_INTERPRET=1 was set; set it before "
                "the first import (e.g. at the top of conftest.py)"
            )
        self._ops = triton_ops
        self.max_kv_splits = max_kv_splits
        self.min_split_len = min_split_len
        self.decode_block_n = decode_block_n
        self.extend_block_m = extend_block_m
        self.extend_block_n = extend_block_n
        self._decode_grid_splits = 1
        self._extend_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._max_extend_len = 0

    # ---- per-batch metadata -------------------------------------------------------------------------------
    def init_forward_metadata(self, batch: AttentionBatch) -> None:
        if batch.is_decode:
            max_len = max(batch.seq_lens_cpu) if batch.seq_lens_cpu else 1
            self._decode_grid_splits = self._ops.decode_grid_splits(
                max_len, self.max_kv_splits, self.min_split_len
            )
            return
        prefix, ext = batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu
        starts = [0] * len(ext)
        for i in range(1, len(ext)):
            starts[i] = starts[i - 1] + ext[i - 1]
        # one host->device copy for the three [bs] tables
        meta = torch.tensor([prefix, ext, starts], dtype=torch.int64).to(
            batch.seq_lens.device, non_blocking=True
        )
        self._extend_meta = (meta[0], meta[1], meta[2])
        self._max_extend_len = max(ext) if ext else 0

    # CUDA-graph hooks (see runtime/model_executor/cuda_graph_runner.py). Decode reads seq_lens and
    # req_pool_indices on the device only, so a graph stays valid for any contents of those buffers as long as
    # the grid covers the longest possible split count.
    def init_cuda_graph_state(self, max_bs: int) -> None:
        pass

    def init_forward_metadata_capture(self, batch: AttentionBatch) -> None:
        self._decode_grid_splits = self.max_kv_splits

    def init_forward_metadata_replay(self, batch: AttentionBatch) -> None:
        self._decode_grid_splits = self.max_kv_splits

    # ---- per-layer attention ------------------------------------------------------------------------------
    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        if self._extend_meta is None:
            raise RuntimeError("init_forward_metadata(batch) must be called before forward_extend")
        prefix_lens, extend_lens, qo_start = self._extend_meta
        return self._ops.extend_attention(
            q,
            self.kv_pool.k[layer.layer_id],
            self.kv_pool.v[layer.layer_id],
            self.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            prefix_lens,
            extend_lens,
            qo_start,
            self._max_extend_len,
            layer.scaling,
            block_m=self.extend_block_m,
            block_n=self.extend_block_n,
            window=layer.sliding_window,
        )

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        return self._ops.decode_attention(
            q,
            self.kv_pool.k[layer.layer_id],
            self.kv_pool.v[layer.layer_id],
            self.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            layer.scaling,
            grid_splits=self._decode_grid_splits,
            max_splits=self.max_kv_splits,
            min_split_len=self.min_split_len,
            block_n=self.decode_block_n,
            window=layer.sliding_window,
        )
