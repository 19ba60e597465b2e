"""KV memory: the request->slot table, the per-layer KV storage, and the slot allocator.

Three objects with one job each:
- `ReqToTokenPool`: row per live request; `req_to_token[row, i]` is the KV slot of the request's token i.
- `KVPool`: per-layer K and V tensors indexed by slot. Slot 0 is a reserved dummy (padding writes go there),
  so usable slots are 1..size.
- `SlotAllocator`: hands out and takes back slot indices. It knows nothing about tensors' contents.

Accounting invariant (checked by the scheduler when idle and by tests):
    allocator.available() + slots held by the radix cache + slots held by running requests == size
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        # [size, max_context_len] int64 slot ids
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free_rows = list(range(size))

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if row in self._free_rows:  # O(size) but size is small (max running requests)
            raise ValueError(f"req_to_token row {row} freed twice")
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + slots.numel()] = slots

    def write_each(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """`req_to_token[rows[i], positions[i]] = slots[i]`: one indexed write for a decode step's batch
        instead of a sliced assignment per request (~4 us each)."""
        device = self.req_to_token.device
        index = torch.tensor([rows, positions], dtype=torch.int64).to(device)
        self.req_to_token.index_put_((index[0], index[1]), slots.to(device))

    def read(self, row: int, end: int, start: int = 0) -> torch.Tensor:
        return self.req_to_token[row, start:end]


class SlotAllocator:
    """Free list of KV slots 1..size. Freed slots are reused last-in-first-out (warm in cache)."""

    def __init__(self, size: int, device: str | torch.device = "cpu"):
        self.size = size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._num_free = self.size

    def available(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots, or None when fewer than n are free (the caller evicts or retracts and retries)."""
        if n > self._num_free:
            return None
        out = self._free[self._num_free - n : self._num_free].clone()
        self._num_free -= n
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        if self._num_free + n > self.size:
            raise RuntimeError(f"freeing {n} slots would exceed pool size {self.size}: double free")
        self._free[self._num_free : self._num_free + n] = slots.to(self._free.device).flatten()
        self._num_free += n

    def free_slots(self) -> torch.Tensor:
        return self._free[: self._num_free]


class KVPool:
    """Per-layer K/V storage: k[layer] and v[layer] are [size + 1, num_kv_heads, head_dim]."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ):
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (size + 1, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim] for `slots` [num_tokens]."""
        # index_copy_ rather than `buf[slots] = x`: the advanced-indexing path is far slower on CPU.
        self.k[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.dtype))

    def nbytes(self) -> int:
        """Bytes of K and V storage (allocated at construction)."""
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
