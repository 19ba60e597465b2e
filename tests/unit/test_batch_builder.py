"""Batch building without a model: exact tokens, positions, KV slots and logits rows per request."""

from __future__ import annotations

import torch

from runtime.managers.scheduler.batch_builder import build_decode_batch, build_extend_batch
from runtime.managers.scheduler.req import Req
from runtime.mem_cache.memory_pool import ReqToTokenPool
from runtime.model_executor.forward_batch import ForwardMode
from runtime.sampling_params import SamplingParams


def make_req(rid: str, prompt: list[int], row: int, slots: list[int], **kw) -> Req:
    """A request whose req_to_token row holds `slots` (its prefix plus the tokens taken now)."""
    req = Req(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=4), **kw)
    req.req_pool_idx, req.kv_len = row, len(slots)
    return req


def pool_with(*rows: tuple[int, list[int]]) -> ReqToTokenPool:
    pool = ReqToTokenPool(size=4, max_context_len=16)
    for row, slots in rows:
        pool.write(row, 0, torch.tensor(slots))
    return pool


def test_extend_batch_exact_layout_and_rows():
    # a: 2 cached tokens + 3 new; b: 3 new, prompt logprobs from position 1; c: first chunk of 2 of 6.
    a = make_req("a", [10, 11, 12, 13, 14], row=2, slots=[101, 102, 5, 6, 7])
    b = make_req("b", [20, 21, 22], row=0, slots=[8, 9, 10], return_logprob=True, logprob_start_len=1)
    c = make_req("c", [30, 31, 32, 33, 34, 35], row=1, slots=[11, 12])
    pool = pool_with((2, [101, 102, 5, 6, 7]), (0, [8, 9, 10]), (1, [11, 12]))
    before = pool.req_to_token.clone()

    built = build_extend_batch([(a, 3), (b, 3), (c, 2)], pool)
    fb = built.batch

    assert fb.mode is ForwardMode.EXTEND
    assert fb.input_ids.tolist() == [12, 13, 14, 20, 21, 22, 30, 31]
    assert fb.positions.tolist() == [2, 3, 4, 0, 1, 2, 0, 1]
    assert fb.out_cache_loc.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert fb.req_pool_indices.tolist() == [2, 0, 1]
    assert fb.seq_lens_cpu == [5, 3, 2] and fb.seq_lens.tolist() == [5, 3, 2]
    assert fb.extend_prefix_lens_cpu == [2, 0, 0]
    assert fb.extend_seq_lens_cpu == [3, 3, 2]
    # a: its last token; b: positions 0..2 (position 0's logits score token 1); c: its last token.
    assert fb.logits_indices.tolist() == [2, 3, 4, 5, 7]
    assert built.logit_rows == [range(0, 1), range(1, 4), range(4, 5)]
    assert torch.equal(pool.req_to_token, before)  # read only


def test_extend_input_logprob_rows_start_at_the_cached_prefix():
    # logprob_start_len 0 with 2 tokens already in KV: rows only for the 2 positions computed now.
    r = make_req("r", [40, 41, 42, 43], row=3, slots=[1, 2, 3, 4], return_logprob=True, logprob_start_len=0)
    built = build_extend_batch([(r, 2)], pool_with((3, [1, 2, 3, 4])))
    assert built.batch.input_ids.tolist() == [42, 43]
    assert built.batch.positions.tolist() == [2, 3]
    assert built.batch.out_cache_loc.tolist() == [3, 4]
    assert built.batch.logits_indices.tolist() == [0, 1]
    assert built.logit_rows == [range(0, 2)]


def test_extend_after_output_has_no_input_logprob_rows():
    # Re-extend after jump-forward: output tokens exist, so prompt logprobs are no longer wanted.
    r = make_req("r", [1, 2], row=0, slots=[7, 8, 9, 10], return_logprob=True, logprob_start_len=0)
    r.output_ids = [3, 4, 5]  # seq_len 5, kv 4: tokens 2..3 taken now, token 4 decodes next
    built = build_extend_batch([(r, 2)], pool_with((0, [7, 8, 9, 10])))
    assert built.batch.input_ids.tolist() == [3, 4]
    assert built.batch.positions.tolist() == [2, 3]
    assert built.batch.logits_indices.tolist() == [1]
    assert built.logit_rows == [range(0, 1)]


def test_decode_batch_one_row_per_request():
    a = make_req("a", [1, 2, 3], row=1, slots=[4, 5, 6, 7])
    a.output_ids = [9]
    b = make_req("b", [8], row=0, slots=[1, 2, 3])
    b.output_ids = [6, 5]
    built = build_decode_batch([a, b], torch.tensor([7, 3]))
    fb = built.batch
    assert fb.mode is ForwardMode.DECODE
    assert fb.input_ids.tolist() == [9, 5]
    assert fb.positions.tolist() == [3, 2]
    assert fb.seq_lens_cpu == [4, 3]
    assert fb.req_pool_indices.tolist() == [1, 0]
    assert fb.out_cache_loc.tolist() == [7, 3]
    assert built.logit_rows == [range(0, 1), range(1, 2)]
