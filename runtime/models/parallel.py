"""Tensor parallelism for the decoder: the rank's group handle, shard ranges, and the sharded layers.

Megatron-style splits, one all_reduce per attention block and per MLP:
- `ColumnParallelLinear` keeps a slice of the output features of each fused part (q|k|v, gate|up): no
  communication, its output stays sharded;
- `RowParallelLinear` keeps the matching slice of the input features (o, down) and sums the ranks' partial
  outputs with one all_reduce;
- `VocabParallelEmbedding` looks up only its vocabulary rows (the others read zeros) and all_reduces;
- `ParallelLMHead` computes its vocabulary slice; `TensorParallel.gather_logits` all_gathers the slices.

Every layer loads its own shard from the full checkpoint tensor (`load_shard`), so checkpoints are read as
they are and never resharded on disk. At tp_size 1 each layer is the plain layer (no collective, no mask).

Splits may be uneven: heads go to ranks in contiguous, balanced ranges of whole GQA groups (SmolLM2's 3 KV
heads on 2 ranks: 2 + 1, with their 6 + 3 query heads), the MLP's intermediate features likewise, and the
vocabulary in equal padded slices (the padding rows are zero and cut off after the gather). A rank needs at
least one KV head, so tp_size > num_kv_heads is an error (`check_tp_shardable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class TensorParallel:
    """This process's place in the tensor-parallel group: rank, size and the collectives the model uses.

    `group` is a torch.distributed process group (gloo on CPU, NCCL on CUDA) or None at size 1;
    `control_group` a gloo group for host-side messages (the same group on CPU), used by the model runner.
    """

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        group: Any = None,
        device: torch.device | None = None,
        control_group: Any = None,
    ):
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is outside 0..{size - 1}")
        if size > 1 and group is None:
            raise ValueError("a tensor-parallel group of size > 1 needs a process group")
        self.rank, self.size, self.group = rank, size, group
        self.device = device or torch.device("cpu")
        self.control_group = control_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (in place)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[T, padded_vocab / size] slices of every rank -> [T, vocab_size] (padding rows cut off)."""
        if self.size == 1:
            return local[:, :vocab_size]
        import torch.distributed as dist

        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s (so every rank sizes shared structures alike)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when n units are cut into `parts` contiguous, balanced pieces."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def check_tp_shardable(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """ValueError naming the numbers when the attention heads cannot be split across `tp_size` ranks."""
    if tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {tp_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    if tp_size > num_kv_heads:
        raise ValueError(
            f"--tp-size {tp_size} cannot shard this model: its {num_kv_heads} KV heads do not go into "
            f"{tp_size} ranks (every rank needs at least one KV head); use --tp-size <= {num_kv_heads}"
        )


@dataclass(frozen=True)
class HeadShard:
    """The attention heads of one rank: query heads [q_start, q_stop), KV heads [kv_start, kv_stop)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int

    @property
    def num_heads(self) -> int:
        return self.q_stop - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_stop - self.kv_start

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
        check_tp_shardable(num_heads, num_kv_heads, tp.size)
        kv_start, kv_stop = split_range(num_kv_heads, tp.size, tp.rank)
        group = num_heads // num_kv_heads  # query heads per KV head stay together
        return cls(kv_start * group, kv_stop * group, kv_start, kv_stop)


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(start, stop, padded rows) of this rank's vocabulary slice; every rank holds `padded` rows."""
    padded = -(-vocab_size // tp.size)
    start = min(tp.rank * padded, vocab_size)
    return start, min(start + padded, vocab_size), padded


def _check_shape(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != want:
        raise ValueError(f"weight {name!r} has shape {tuple(got)}, expected {want}")


class ColumnParallelLinear(nn.Linear):
    """Fused parts (q|k|v or gate|up), each keeping output rows [start, stop) of its full `size` rows.

    Output: [*, sum(stop - start)], this rank's slices of the parts concatenated.
    """

    def __init__(self, in_features: int, parts: list[tuple[int, int, int]], bias: bool = False):
        super().__init__(in_features, sum(stop - start for _, start, stop in parts), bias=bias)
        self.parts = parts  # (full size, start, stop) per part
        self.offsets = [sum(p[2] - p[1] for p in parts[:i]) for i in range(len(parts))]

    def load_shard(self, attr: str, full: torch.Tensor, part: int) -> None:
        size, start, stop = self.parts[part]
        want = (size, self.in_features) if attr == "weight" else (size,)
        _check_shape(f"{attr} (part {part})", full.shape, want)
        dst = self.weight if attr == "weight" else self.bias
        off = self.offsets[part]
        dst.data[off : off + stop - start].copy_(full[start:stop])


class RowParallelLinear(nn.Linear):
    """Keeps input features [start, stop) of the full `in_full`; the ranks' partial products are summed."""

    def __init__(self, in_full: int, out_features: int, tp: TensorParallel, shard: tuple[int, int]):
        super().__init__(shard[1] - shard[0], out_features, bias=False)
        self.in_full, self.shard, self.tp = in_full, shard, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))

    def load_shard(self, attr: str, full: torch.Tensor, part: int = 0) -> None:
        _check_shape(attr, full.shape, (self.out_features, self.in_full))
        self.weight.data.copy_(full[:, self.shard[0] : self.shard[1]])


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, stop) of the vocabulary, zero-padded to `padded` rows; ids elsewhere read zeros."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel):
        self.start, self.stop, padded = vocab_shard(vocab_size, tp)
        super().__init__(padded, dim)
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, dim]
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0.0))

    def load_shard(self, attr: str, full: torch.Tensor, part: int = 0) -> None:
        _check_shape(attr, full.shape, (self.vocab_size, self.embedding_dim))
        _load_vocab_rows(self.weight, full, self.start, self.stop)


class ParallelLMHead(nn.Linear):
    """The output projection over this rank's vocabulary slice, zero-padded like the embedding (so a tied head
    shares the embedding's weight: `LlamaForCausalLM.tie_weights`)."""

    def __init__(self, dim: int, vocab_size: int, tp: TensorParallel):
        self.start, self.stop, padded = vocab_shard(vocab_size, tp)
        super().__init__(dim, padded, bias=False)
        self.vocab_size = vocab_size

    def load_shard(self, attr: str, full: torch.Tensor, part: int = 0) -> None:
        _check_shape(attr, full.shape, (self.vocab_size, self.in_features))
        _load_vocab_rows(self.weight, full, self.start, self.stop)


def _load_vocab_rows(weight: nn.Parameter, full: torch.Tensor, start: int, stop: int) -> None:
    weight.data.zero_()
    weight.data[: stop - start].copy_(full[start:stop])
