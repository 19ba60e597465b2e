"""The attention backend interface shared by torch_native, triton and flashinfer.

Per batch the model runner calls `init_forward_metadata(batch)` once (plan); per layer the model calls
`forward(q, k, v, layer, batch)` (run), which stores the new tokens' K/V in the paged pool at
`batch.out_cache_loc` and attends over the request's whole KV (`req_to_token[row, :seq_len]`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool
from runtime.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayer:
    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend(ABC):
    name: str = "base"

    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool):
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare per-batch state (index tables, masks) shared by every layer of this forward."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].

        Returns [num_tokens, num_heads, head_dim].
        """
        self.kv_pool.write(layer.layer_id, batch.out_cache_loc, k, v)
        if batch.is_decode:
            return self.forward_decode(q, layer, batch)
        return self.forward_extend(q, layer, batch)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """Causal attention of each request's new tokens over its cached prefix plus the new tokens."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """One query token per request over its whole KV."""
