"""The model worker's only input: one plain description of a forward pass.

The scheduler builds a `ForwardBatch` from its requests; the model runner and the attention backends read it
and never look at scheduler objects. Extend (prefill over a cached prefix) and decode are the two modes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # new tokens per request appended after a (possibly empty) cached prefix
    DECODE = "decode"  # exactly one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64, new tokens of all requests concatenated
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64, prefix + new tokens (KV length after this pass)
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots written for the new tokens
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)  # EXTEND only
    extend_seq_lens_cpu: list[int] = field(default_factory=list)  # EXTEND only: new tokens per request
    # Token indices (into input_ids) whose logits are wanted; default: the last token of each request.
    logits_indices: torch.Tensor | None = None
    # LoRA (runtime.models.lora): each request's adapter pool slot, -1 for the base model; None: all base
    lora_slots: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @classmethod
    def build_extend(
        cls,
        input_ids: list[list[int]],
        prefix_lens: list[int],
        req_pool_indices: list[int],
        out_cache_loc: torch.Tensor,
        logits_indices: list[int] | None = None,
        device: str | torch.device = "cpu",
    ) -> ForwardBatch:
        """`input_ids[i]` are request i's new tokens, placed after its `prefix_lens[i]` cached tokens."""
        ext = [len(t) for t in input_ids]
        seq = [p + e for p, e in zip(prefix_lens, ext)]
        flat = [t for toks in input_ids for t in toks]
        pos = [p for pre, s in zip(prefix_lens, seq) for p in range(pre, s)]
        if logits_indices is None:
            logits_indices, acc = [], 0
            for e in ext:
                acc += e
                logits_indices.append(acc - 1)
        return cls(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(flat, dtype=torch.int64, device=device),
            positions=torch.tensor(pos, dtype=torch.int64, device=device),
            req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=device),
            out_cache_loc=out_cache_loc.to(device),
            seq_lens_cpu=seq,
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=ext,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        )

    @classmethod
    def build_decode(
        cls,
        input_ids: list[int],
        seq_lens: list[int],
        req_pool_indices: list[int],
        out_cache_loc: torch.Tensor,
        device: str | torch.device = "cpu",
    ) -> ForwardBatch:
        """`seq_lens[i]` counts the new token: its position is `seq_lens[i] - 1`."""
        return cls(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64, device=device),
            req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            out_cache_loc=out_cache_loc.to(device),
            seq_lens_cpu=list(seq_lens),
        )
