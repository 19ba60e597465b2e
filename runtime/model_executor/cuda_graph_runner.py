"""CUDA-graph capture and replay of decode forwards (NVIDIA GPUs only).

A decode step of a small model is dominated by kernel-launch overhead; replaying a captured graph launches
the whole forward at once. Graphs have fixed shapes and fixed tensor addresses, so the runner captures one
graph per batch size in `batch_sizes`, all reading static input buffers, and pads a live batch up to the
next captured size. Padding rows decode a dummy 1-token sequence: they read `req_to_token[pad_row, 0]`
(always a valid slot id) and write their KV to the reserved dummy slot 0, so they touch no live request.

How the model runner uses it::

    runner = CudaGraphRunner(model.forward, [1, 2, 4, 8, 16, 24, 32], attn_backend=backend)  # after KV alloc
    ...
    if runner.can_run(batch):
        logits = runner.replay(batch)        # [bs, vocab]; metadata is planned inside
    else:
        backend.init_forward_metadata(batch)
        logits = model.forward(batch)

`model_forward_fn(batch) -> logits [bs, vocab]` must, for a decode batch: read only the batch's tensors
(input_ids, positions, req_pool_indices, seq_lens, out_cache_loc; never `.item()`/`.tolist()` or
`seq_lens_cpu`), call the attention backend's `forward` per layer, not call `init_forward_metadata` (the
runner does), and return logits for every row (a decode batch's `logits_indices` is None). The KV pool and
`req_to_token` must not be reallocated after capture: graphs hold their addresses.

The attention backend must implement the graph hooks: `init_cuda_graph_state(max_bs)`,
`init_forward_metadata_capture(batch)` and `init_forward_metadata_replay(batch)` (the triton and flashinfer
backends do; torch_native does not, as its decode gathers a batch-dependent shape).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from runtime.model_executor.forward_batch import ForwardBatch, ForwardMode

GRAPH_HOOKS = ("init_cuda_graph_state", "init_forward_metadata_capture", "init_forward_metadata_replay")


def supports_cuda_graph(attn_backend: object) -> bool:
    return all(callable(getattr(attn_backend, hook, None)) for hook in GRAPH_HOOKS)


def padded_batch_size(bs: int, captured: Sequence[int]) -> int | None:
    """Smallest captured size >= bs (`captured` sorted ascending), or None when bs is larger than all."""
    i = bisect.bisect_left(captured, bs)
    return captured[i] if i < len(captured) else None


def fill_padded_decode_batch(
    static: ForwardBatch, batch: ForwardBatch, padded: int, pad_req_pool_index: int = 0, pad_slot: int = 0
) -> None:
    """Copy decode `batch` into the first rows of `static`'s tensors (each >= `padded` rows) and make rows
    bs..padded-1 dummy 1-token sequences that read `req_to_token[pad_req_pool_index, 0]` and write their KV
    to `pad_slot`, so they touch no live request. Shared by the CUDA-graph and the compiled-decode runners.
    """
    bs = batch.batch_size
    static.input_ids[:bs].copy_(batch.input_ids)
    static.positions[:bs].copy_(batch.positions)
    static.req_pool_indices[:bs].copy_(batch.req_pool_indices)
    static.seq_lens[:bs].copy_(batch.seq_lens)
    static.out_cache_loc[:bs].copy_(batch.out_cache_loc)
    if padded > bs:  # earlier larger batches may have left live rows here
        static.input_ids[bs:padded].zero_()
        static.positions[bs:padded].zero_()
        static.req_pool_indices[bs:padded].fill_(pad_req_pool_index)
        static.seq_lens[bs:padded].fill_(1)
        static.out_cache_loc[bs:padded].fill_(pad_slot)
    static.seq_lens_cpu = list(batch.seq_lens_cpu) + [1] * (padded - bs)


class CudaGraphRunner:
    def __init__(
        self,
        model_forward_fn: Callable[[ForwardBatch], torch.Tensor],
        batch_sizes: Sequence[int],
        *,
        attn_backend: object,
        device: str | torch.device = "cuda",
        pad_req_pool_index: int = 0,
        pad_slot: int = 0,
        warmup_iters: int = 2,
    ):
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        if not supports_cuda_graph(attn_backend):
            name = getattr(attn_backend, "name", type(attn_backend).__name__)
            raise ValueError(
                f"attention backend {name!r} does not support CUDA graphs (needs {', '.join(GRAPH_HOOKS)})"
            )
        sizes = sorted(set(int(b) for b in batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch_sizes must be positive, got {list(batch_sizes)}")
        self.model_forward_fn = model_forward_fn
        self.attn_backend = attn_backend
        self.device = device
        self.batch_sizes = sizes
        self.max_bs = sizes[-1]
        self.pad_req_pool_index = pad_req_pool_index
        self.pad_slot = pad_slot

        # Static inputs, sized for the largest graph; graph bs reads the first bs rows.
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(self.max_bs, **i64)
        self.positions = torch.zeros(self.max_bs, **i64)
        self.req_pool_indices = torch.full((self.max_bs,), pad_req_pool_index, **i64)
        self.seq_lens = torch.ones(self.max_bs, **i64)
        self.out_cache_loc = torch.full((self.max_bs,), pad_slot, **i64)

        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._batches: dict[int, ForwardBatch] = {}
        self._capture_all(warmup_iters)

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_cpu=[1] * bs,
        )

    def _capture_all(self, warmup_iters: int) -> None:
        self.attn_backend.init_cuda_graph_state(self.max_bs)
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first, so smaller graphs reuse its memory pool
            batch = self._static_batch(bs)
            # Eager warm-up: compiles kernels (Triton / FlashInfer JIT) and lets backends learn the geometry.
            self.attn_backend.init_forward_metadata(batch)
            self.model_forward_fn(batch)
            self.attn_backend.init_forward_metadata_capture(batch)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(warmup_iters):
                    self.model_forward_fn(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model_forward_fn(batch)
            pool = graph.pool()
            self._graphs[bs], self._outputs[bs], self._batches[bs] = graph, out, batch
        torch.cuda.synchronize(self.device)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.is_decode and 0 < batch.batch_size <= self.max_bs and batch.input_ids.device.type == "cuda"
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] of a decode batch (a fresh tensor, safe to keep across replays)."""
        if not self.can_run(batch):
            raise ValueError(f"cannot replay a {batch.mode.value} batch of size {batch.batch_size}")
        bs = batch.batch_size
        padded = padded_batch_size(bs, self.batch_sizes)
        assert padded is not None
        static = self._batches[padded]
        fill_padded_decode_batch(static, batch, padded, self.pad_req_pool_index, self.pad_slot)
        self.attn_backend.init_forward_metadata_replay(static)
        self._graphs[padded].replay()
        return self._outputs[padded][:bs].clone()
