"""Batch building: admitted requests -> the `ForwardBatch` plus which logits rows belong to which request.

Pure functions of the requests' state and the req->token table (read, never written), so the row
bookkeeping that ties logits back to requests is unit-tested without a model
(tests/unit/test_batch_builder.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.managers.scheduler.req import Req
from runtime.mem_cache.memory_pool import ReqToTokenPool
from runtime.model_executor.forward_batch import ForwardBatch


@dataclass
class BuiltBatch:
    batch: ForwardBatch
    # Per request, in batch order: its rows of the logits the forward returns ([len(logits_indices), vocab]).
    # Extend: one row per prompt position whose input logprob is wanted, else only the last token's row;
    # the last row of each range picks the next token. Decode: exactly one row per request.
    logit_rows: list[range]


def build_extend_batch(
    admitted: list[tuple[Req, int]], req_pool: ReqToTokenPool, device: str | torch.device = "cpu"
) -> BuiltBatch:
    """`admitted`: (request, tokens taken now), with the slots for those tokens already appended, i.e. the
    request's `kv_len` counts them: this pass computes positions `kv_len - take .. kv_len - 1`."""
    tokens, prefix_lens, pool_rows, sel, logit_rows = [], [], [], [], []
    offset = 0
    for req, take in admitted:
        start = req.kv_len - take
        tokens.append(req.token_slice(start, req.kv_len))
        prefix_lens.append(start)
        pool_rows.append(req.req_pool_idx)
        first_row = len(sel)
        if req.wants_input_logprobs:  # logits of position p score token p + 1: start one position early
            first = max(req.logprob_start_len - 1, start)
            sel.extend(offset + p - start for p in range(first, req.kv_len))
        else:
            sel.append(offset + take - 1)
        logit_rows.append(range(first_row, len(sel)))
        offset += take
    slots = torch.cat([req_pool.read(r.req_pool_idx, r.kv_len, r.kv_len - t) for r, t in admitted])
    batch = ForwardBatch.build_extend(
        tokens, prefix_lens, pool_rows, slots, logits_indices=sel, device=device
    )
    return BuiltBatch(batch, logit_rows)


def build_decode_batch(
    reqs: list[Req], slots: torch.Tensor, device: str | torch.device = "cpu"
) -> BuiltBatch:
    """One new token per request: its last token, written to `slots[i]` (already appended, so `kv_len`
    counts it)."""
    batch = ForwardBatch.build_decode(
        [r.last_token_id for r in reqs],
        [r.kv_len for r in reqs],
        [r.req_pool_idx for r in reqs],
        slots,
        device=device,
    )
    return BuiltBatch(batch, [range(i, i + 1) for i in range(len(reqs))])


def build_verify_batch(
    reqs: list[Req], drafts: list[list[int]], req_pool: ReqToTokenPool, device: str | torch.device = "cpu"
) -> BuiltBatch:
    """Speculative verify: per request an extend of its last token + its draft over its cached prefix, with
    slots for all of them already appended (`kv_len` counts them). Every position gets a logits row: row j
    of a request scores the token after its draft's first j tokens. A request without a draft is a decode
    step in extend form (one token, one row)."""
    tokens, prefix_lens, sel, logit_rows = [], [], [], []
    for req, draft in zip(reqs, drafts):
        n = 1 + len(draft)
        tokens.append([req.last_token_id, *draft])
        prefix_lens.append(req.kv_len - n)
        logit_rows.append(range(len(sel), len(sel) + n))
        sel.extend(range(len(sel), len(sel) + n))
    slots = torch.cat(
        [req_pool.read(r.req_pool_idx, r.kv_len, r.kv_len - 1 - len(d)) for r, d in zip(reqs, drafts)]
    )
    batch = ForwardBatch.build_extend(
        tokens, prefix_lens, [r.req_pool_idx for r in reqs], slots, logits_indices=sel, device=device
    )
    return BuiltBatch(batch, logit_rows)
