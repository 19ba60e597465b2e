"""The attention backend interface shared by torch_native, triton and flashinfer.

Per batch the model runner calls `init_forward_metadata(batch)` once (plan); per layer the model calls
`forward(q, k, v, layer, batch)` (run), which stores the new tokens' K/V in the paged pool at
`batch.out_cache_loc` and attends over the request's whole KV (`req_to_token[row, :seq_len]`).

Kernels import nothing of `runtime` at run time: what a backend reads of the runtime's batch, KV pool and
request table is spelled out below as protocols, which runtime's `ForwardBatch`, `KVPool` and
`ReqToTokenPool` satisfy structurally. So `runtime` depends on `kernels`, never the reverse.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionBatch(Protocol):
    """The part of a forward pass a backend reads (runtime.model_executor.forward_batch.ForwardBatch)."""

    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64, KV length after this pass (prefix + new tokens)
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots written for the new tokens
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]  # extend only: cached tokens per request
    extend_seq_lens_cpu: list[int]  # extend only: new tokens per request

    @property
    def batch_size(self) -> int: ...

    @property
    def is_decode(self) -> bool: ...


@runtime_checkable
class PagedKV(Protocol):
    """Per-layer K/V storage indexed by slot (runtime.mem_cache.memory_pool.KVPool)."""

    k: list[torch.Tensor]  # per layer: [num_slots, num_kv_heads, head_dim]
    v: list[torch.Tensor]
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    # layers whose K/V live in a second, smaller pool (empty: one pool); `translate(layer, slots)` gives
    # the rows of k[layer] / v[layer] holding the tokens of `slots` (the slots themselves outside that set).
    # Only backends that translate (torch_native, cpu) are given a pool with sliding layers.
    sliding_layers: frozenset[int]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def translate(self, layer: int, slots: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class ReqToTokenTable(Protocol):
    """Request row -> KV slot of each of its tokens (runtime.mem_cache.memory_pool.ReqToTokenPool)."""

    req_to_token: torch.Tensor  # [rows, max_context_len] int64 slot ids
    max_context_len: int


@dataclass(frozen=True)
class AttentionLayer:
    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    # 0: global attention. W > 0: the query at position p attends to keys p - W + 1 .. p only (transformers'
    # `kv_idx > q_idx - sliding_window`). A backend reads only the window; the pool may have freed older
    # positions' K/V of such a layer (`PagedKV.sliding_layers`).
    sliding_window: int = 0
    # gpt-oss: float32 [num_heads], one learned logit per query head that joins the head's softmax
    # denominator as a key with no value: out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)). None: no
    # sinks. Only backends with `supports_sinks` take a layer that has them (else the runner refuses).
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # Gemma 2: each scaled score s becomes cap * tanh(s / cap) before the softmax (attn_logit_softcapping).
    # 0: none. Only backends with `supports_logit_softcap` take such a layer (else the runner refuses).
    logit_softcap: float = 0.0


class AttentionBackend(ABC):
    name: str = "base"
    supports_sliding_window: bool = False  # honours AttentionLayer.sliding_window (else the runner refuses)
    supports_sinks: bool = False  # honours AttentionLayer.sinks (else the runner refuses)
    supports_logit_softcap: bool = False  # honours AttentionLayer.logit_softcap (else the runner refuses)
    # reads sliding layers through `PagedKV.translate` (else the runner keeps every layer in one pool)
    supports_sliding_pool: bool = False

    def __init__(self, kv_pool: PagedKV, req_to_token_pool: ReqToTokenTable):
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool

    @abstractmethod
    def init_forward_metadata(self, batch: AttentionBatch) -> None:
        """Prepare per-batch state (index tables, masks) shared by every layer of this forward."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].

        Returns [num_tokens, num_heads, head_dim].
        """
        self.kv_pool.write(layer.layer_id, batch.out_cache_loc, k, v)
        if batch.is_decode:
            return self.forward_decode(q, layer, batch)
        return self.forward_extend(q, layer, batch)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        """Causal attention of each request's new tokens over its cached prefix plus the new tokens."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: AttentionBatch) -> torch.Tensor:
        """One query token per request over its whole KV."""
