"""CPU attention that reads the paged KV pool in place: `torch.ops.radixlm.paged_attention` (C++).

The torch_native backend gathers each request's whole K/V out of the pool every layer (index_select) and
runs SDPA over the copy; over a long cached prefix that copy is most of a decode step, and SDPA's fp32
single-query path has a per-call cost that dominates short contexts. The C++ op walks the request's slots
itself, keeps an online softmax per query row, splits long requests across threads, and reads a split of
slots that several requests share (a cached prefix) once for all of them (see
runtime/models/csrc/paged_attention.cpp). It serves decode and extends whose requests all add at most
`FUSED_MAX_EXTEND` tokens (speculative verification, a tool result or user turn appended after a cached
prefix); longer extends, where the prefix copy is amortised over many queries and SDPA's blocked kernel wins,
stay on torch_native. One request extending E = 64 tokens over P cached ones, the default model's 30 layers,
2 threads: torch_native takes 1.1-2.1x the op's time (P = 0 to 4,000, either slot layout), and still
1.0-1.2x at E = 128 (`python -m bench.paged_attention_op --vs-torch-native --cases 1x1400e64,...`).
In a batch that mixes both (a long prefill with running requests decoding beside it), the short requests
still take the op (`_ShortRequests`): decoding beside a prefill costs what a decode step's attention does,
not a copy of each request's context. Only on full-attention layers without sinks or soft-capping: the
others still run the whole batch through torch_native.

`forward` (the per-layer call) goes through the sibling op `paged_attention_kv`, which also stores the new
tokens' K/V in the pool, cast to its dtype, and takes q, k, v as the strided views the model's qkv split
gives: one call per layer where the write alone was two casts and two index_copy_. `forward_decode` and
`forward_extend` (attention over a pool already written) keep calling `paged_attention`.

A sliding-window layer (`AttentionLayer.sliding_window`) runs the same op over a per-batch table with one
row per query token holding that token's window of slots (`_window_table`), so the op's causal walk reads
the window and nothing before it; long extends, and tables past WINDOW_TABLE_MAX slots, take torch_native's
masked path. The op takes attention sinks (gpt-oss's `AttentionLayer.sinks`) and soft-capped scores (Gemma 2's
`AttentionLayer.logit_softcap`) itself.

The ops are built and loaded by the runtime (`runtime.models.native_kernels.PAGED_ATTENTION`) before this
backend is created; kernels never import the runtime, so `op_available()` only checks that it is there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixlm_kernels.base import AttentionBatch, AttentionLayer
from radixlm_kernels.torch_native import TorchNativeBackend

FUSED_MAX_EXTEND = 64
# A sliding-window layer's per-token table (query tokens x window) past this many slots takes torch_native's
# masked path instead (8 MB of int64: e.g. 256 verify tokens under a 4096-token window).
WINDOW_TABLE_MAX = 1 << 20
OP = "radixlm::paged_attention"
OPS = (OP, "radixlm::paged_attention_kv")


def has_cpu_kernels(*ops: str) -> bool:
    """True when every op ("radixlm::name") has a CPU implementation loaded in this process."""
    try:
        return all(torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU") for op in ops)
    except RuntimeError:  # an op's schema is not even declared
        return False


def op_available() -> bool:
    """True when the attention ops have CPU implementations loaded in this process."""
    return has_cpu_kernels(*OPS)


class _ShortRequests(NamedTuple):
    """The requests of a long-extend batch that add at most FUSED_MAX_EXTEND tokens: their batch indices,
    their query rows, and the op's per-request arguments for them."""

    indices: frozenset[int]
    rows: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    ext_lens: torch.Tensor

    @classmethod
    def of(cls, batch: AttentionBatch) -> _ShortRequests | None:
        ext = batch.extend_seq_lens_cpu
        short = [i for i, e in enumerate(ext) if e <= FUSED_MAX_EXTEND]
        if not short:
            return None
        starts = [0]
        for e in ext:
            starts.append(starts[-1] + e)
        device = batch.seq_lens.device
        rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=device) for i in short])
        pick = torch.tensor(short, dtype=torch.int64, device=device)
        return cls(
            frozenset(short),
            rows,
            batch.req_pool_indices[pick],
            batch.seq_lens[pick],
            torch.tensor([ext[i] for i in short], dtype=torch.int64, device=device),
        )


class CpuPagedBackend(TorchNativeBackend):
    name = "cpu"  # supports_sinks, supports_logit_softcap: the op's (and torch_native's for long extends)

    def __init__(self, kv_pool, req_to_token_pool):
        if not op_available():
            raise RuntimeError(
                f"the cpu attention backend needs the C++ op {OP}, which is not loaded: build it with "
                "runtime.models.native_kernels.PAGED_ATTENTION.load() or use --attention-backend torch_native"
            )
        super().__init__(kv_pool, req_to_token_pool)
        self._fused = False
        self._ext_lens: torch.Tensor | None = None
        self._windows: dict[int, tuple | None] = {}
        self._native_ready = False  # torch_native's metadata built for this batch
        self._short: _ShortRequests | None = None  # a long-extend batch's short requests

    def init_forward_metadata(self, batch: AttentionBatch) -> None:
        self._windows = {}
        self._native_ready = False
        self._short = None
        if batch.is_decode:
            self._fused = True
            self._ext_lens = torch.ones(batch.batch_size, dtype=torch.int64, device=batch.seq_lens.device)
            return
        self._fused = max(batch.extend_seq_lens_cpu) <= FUSED_MAX_EXTEND
        if self._fused:
            self._ext_lens = torch.tensor(batch.extend_seq_lens_cpu, dtype=torch.int64)
        else:
            super().init_forward_metadata(batch)
            self._native_ready = True
            self._short = _ShortRequests.of(batch)

    def _masked_path(self, layer: AttentionLayer, batch: AttentionBatch) -> bool:
        """Whether this layer runs torch_native's path (its metadata built on first use): a long extend, or a
        sliding-window layer whose per-token window table would pass WINDOW_TABLE_MAX."""
        masked = not self._fused or (
            bool(layer.sliding_window) and self._window_table(layer.sliding_window, batch) is None
        )
        if masked and not self._native_ready:
            super().init_forward_metadata(batch)
            self._native_ready = True
        return masked

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch
    ) -> torch.Tensor:
        if self._masked_path(layer, batch):  # write through the pool, then torch_native's SDPA path
            return super().forward(q, k, v, layer, batch)
        args = self._op_args(layer, batch)
        loc = batch.out_cache_loc
        if layer.sliding_window:  # the sliding layers' own rows (a sliding pool) or the slots themselves
            loc = self._window_table(layer.sliding_window, batch)[4]
        return torch.ops.radixlm.paged_attention_kv(q, k, v, loc, *args)

    def _attend(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        return torch.ops.radixlm.paged_attention(q, *self._op_args(layer, batch))

    def _op_args(self, layer: AttentionLayer, batch: AttentionBatch, requests: tuple | None = None) -> tuple:
        """What both ops take after q (and the new k, v): the layer's pool, the slot table, the batch (or
        `requests`: the pool rows, sequence and extend lengths of some of its requests)."""
        if layer.sliding_window:
            assert requests is None, "a sliding-window layer's table covers the whole batch"
            return (
                self.kv_pool.k[layer.layer_id],
                self.kv_pool.v[layer.layer_id],
                *self._window_table(layer.sliding_window, batch)[:4],
                layer.scaling,
                layer.sinks,
                layer.logit_softcap,
            )
        pool_rows, seq_lens, ext_lens = requests or (batch.req_pool_indices, batch.seq_lens, self._ext_lens)
        return (
            self.kv_pool.k[layer.layer_id],
            self.kv_pool.v[layer.layer_id],
            self.req_to_token_pool.req_to_token,
            pool_rows,
            seq_lens,
            ext_lens,
            layer.scaling,
            layer.sinks,
            layer.logit_softcap,
        )

    def _window_table(self, window: int, batch: AttentionBatch) -> tuple | None:
        """A sliding-window layer's (req_to_token, req_pool_indices, seq_lens, ext_lens) for the op: one
        pseudo-request per query token, whose row of a per-batch table holds the slots of that token's window
        (positions max(0, p - window + 1) .. p), so the op's causal walk over a row reads exactly the window.
        Then the new tokens' slots to write. Both are the rows of the layer's K/V tensors: with a sliding
        pool (`KVPool.translate`) its rows, not the full slots. Built once per batch and window, shared by
        the layers of that window; None when it would hold more than WINDOW_TABLE_MAX slots."""
        if window not in self._windows:
            ext = self._ext_lens.to(batch.seq_lens.device)
            n = int(ext.sum())
            first = torch.cumsum(ext, 0) - ext  # each request's first query index
            pos = (batch.seq_lens - ext).repeat_interleave(ext, output_size=n) + (
                torch.arange(n, device=ext.device) - first.repeat_interleave(ext, output_size=n)
            )
            start = (pos - window + 1).clamp(min=0)
            lens = pos + 1 - start
            width = int(lens.max())
            if n * width > WINDOW_TABLE_MAX:
                self._windows[window] = None
                return None
            table = self.req_to_token_pool.req_to_token
            cols = (start[:, None] + torch.arange(width, device=ext.device)[None, :]).clamp(
                max=table.shape[1] - 1
            )
            rows = batch.req_pool_indices.repeat_interleave(ext, output_size=n)
            layer = min(self.kv_pool.sliding_layers, default=-1)  # all sliding layers share one mapping
            self._windows[window] = (
                self.kv_pool.translate(layer, table[rows[:, None], cols]).contiguous(),
                torch.arange(n, device=ext.device),
                lens.contiguous(),
                torch.ones(n, dtype=torch.int64, device=ext.device),
                self.kv_pool.translate(layer, batch.out_cache_loc),
            )
        return self._windows[window]

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        if not self._masked_path(layer, batch):
            return self._attend(q, layer, batch)
        short = self._short
        if short is None or layer.sliding_window or layer.sinks is not None or layer.logit_softcap:
            return super().forward_extend(q, layer, batch)
        out = self._extend_plain(q, layer, batch, skip=short.indices)  # the long requests
        args = self._op_args(layer, batch, (short.req_pool_indices, short.seq_lens, short.ext_lens))
        out[short.rows] = torch.ops.radixlm.paged_attention(q[short.rows], *args)
        return out

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        if self._masked_path(layer, batch):
            return super().forward_decode(q, layer, batch)
        return self._attend(q, layer, batch)
