"""KV memory: the request->slot table, the per-layer KV storage, and the slot allocator.

Three objects with one job each:
- `ReqToTokenPool`: row per live request; `req_to_token[row, i]` is the KV slot of the request's token i.
- `KVPool`: per-layer K and V tensors indexed by slot. Slot 0 is a reserved dummy (padding writes go there),
  so usable slots are 1..size.
- `SlotAllocator`: hands out and takes back slot indices. It knows nothing about tensors' contents.

Accounting invariant (checked by the scheduler when idle and by tests):
    allocator.available() + slots held by the radix cache + slots held by running requests == size

Sliding-window layers (a per-layer-group pool): with `sliding_size` set, the layers in `sliding_layers`
keep their K/V in tensors of `sliding_size + 1` rows instead of `size + 1`. Slots everywhere else (the
request table, the radix cache, `out_cache_loc`) stay *full* slots; `full_to_sliding[full_slot]` is the
sliding row that holds that token's K/V for the sliding layers, 0 (the dummy row) where none is held.
`KVPool.translate` maps a full slot tensor to the rows a layer reads. `SlidingSlotAllocator` hands out a
full slot and a sliding row together, frees both together, and can free the sliding row alone
(`free_sliding`: the token is older than every window that will still read it). A token whose sliding row
was freed keeps its full slot and stays valid for the full-attention layers; whoever reads a sliding layer
must only read tokens that still hold one (the cache manager's rule, `sliding_usable_len`). Second
invariant:
    sliding free rows + rows mapped from full slots == sliding_size, and no free full slot holds a row
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """torch.zeros, except that on the CPU the memory is a private anonymous mapping: zero pages the kernel
    maps only when first written (page-aligned). torch.zeros writes every byte at once: for the default
    model's 5.5 GB float32 pool, 8.8 s of a server's start on this project's 2-core machines, for pages most
    servers never reach."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # holds `pages` open


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


class SlidingSlotAllocator(SlotAllocator):
    """A `SlotAllocator` of full slots whose every allocated slot also holds a row of the sliding-layer pool
    (`full_to_sliding[slot]`, shared with the `KVPool`). `alloc(n)` fails (None) when either pool has fewer
    than n free; `available()` counts full slots (`sliding_available()` the rows); `free` gives back both,
    `free_sliding` only the rows (the full slots stay allocated, their sliding K/V gone)."""

    def __init__(self, size: int, sliding_size: int, full_to_sliding: torch.Tensor, device="cpu"):
        if not 0 < sliding_size <= size:
            raise ValueError(f"sliding_size must be in 1..size ({size}), got {sliding_size}")
        if full_to_sliding.shape != (size + 1,):
            raise ValueError(f"full_to_sliding must have size + 1 = {size + 1} entries")
        self.sliding = SlotAllocator(sliding_size, device)
        self.full_to_sliding = full_to_sliding
        super().__init__(size, device)

    def clear(self) -> None:
        super().clear()
        self.sliding.clear()
        self.full_to_sliding.zero_()

    def sliding_available(self) -> int:
        return self.sliding.available()

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self.sliding.available():
            return None
        full = super().alloc(n)
        if full is None:
            return None
        self.full_to_sliding[full] = self.sliding.alloc(n)
        return full

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        self.free_sliding(slots)
        super().free(slots)

    def free_sliding(self, slots: torch.Tensor) -> int:
        """Give back the sliding rows of full `slots` (those that hold one); returns how many."""
        if slots.numel() == 0:
            return 0
        slots = slots.to(self.full_to_sliding.device).flatten()
        rows = self.full_to_sliding[slots]
        held = rows[rows != 0]
        self.sliding.free(held)
        self.full_to_sliding[slots] = 0
        return held.numel()

    def sliding_held(self, slots: torch.Tensor) -> torch.Tensor:
        """bool [len(slots)]: which full slots still hold a sliding row."""
        return self.full_to_sliding[slots.to(self.full_to_sliding.device)] != 0

    def check(self) -> None:
        """Raise AssertionError if a sliding row is lost, held twice, or held by a free full slot."""
        mapped = self.full_to_sliding[1:]
        rows = mapped[mapped != 0]
        free_rows = self.sliding.free_slots()
        assert rows.numel() + free_rows.numel() == self.sliding.size, (
            f"sliding KV accounting broken: {rows.numel()} mapped + {free_rows.numel()} free != "
            f"sliding pool size {self.sliding.size}"
        )
        both = torch.cat([rows.cpu(), free_rows.cpu()])
        assert torch.unique(both).numel() == self.sliding.size, "sliding KV accounting broken: a row twice"
        assert not bool((self.full_to_sliding[self.free_slots()] != 0).any()), (
            "sliding KV accounting broken: a free full slot still holds a sliding row"
        )
        assert int(self.full_to_sliding[0]) == 0, "the dummy slot 0 must map to the dummy row"


class KVPool:
    """Per-layer K/V storage: k[layer] and v[layer] are [size + 1, num_kv_heads, head_dim], or, for the
    layers in `sliding_layers` when `sliding_size` > 0, [sliding_size + 1, ...] rows addressed through
    `full_to_sliding` (see the module docstring)."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        sliding_layers: Sequence[int] = (),
        sliding_size: int = 0,
    ):
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.sliding_size = sliding_size if sliding_layers else 0
        self.sliding_layers = frozenset(sliding_layers) if self.sliding_size else frozenset()
        # full slot -> sliding row (0: none held); None without a sliding pool
        self.full_to_sliding = (
            torch.zeros(size + 1, dtype=torch.int64, device=device) if self.sliding_size else None
        )
        rows = [self.sliding_size if i in self.sliding_layers else size for i in range(num_layers)]
        self.k = [lazy_zeros((r + 1, num_kv_heads, head_dim), dtype, device) for r in rows]
        self.v = [lazy_zeros((r + 1, num_kv_heads, head_dim), dtype, device) for r in rows]

    def translate(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The rows of `k[layer]` / `v[layer]` that hold full `slots` (any shape): `slots` itself for a
        layer in the full pool, their sliding rows (0, the dummy, where none is held) for a sliding layer."""
        if layer not in self.sliding_layers:
            return slots
        if slots.dim() == 1:
            return self.full_to_sliding.index_select(0, slots)
        return self.full_to_sliding[slots]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim] for full `slots` [num_tokens]."""
        slots = self.translate(layer, slots)
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
