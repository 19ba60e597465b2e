"""What the scheduler owes each client: per-request send state, logprob records, each step's `ReqOutput`s.

The scheduler decides *what happens* to a request (tokens, finishing, failing); this module decides *what is
sent* and *when*: a streaming request every `stream_interval` tokens (its first chunk at once), anything else
once, when it finishes. Logprobs are kept only as far as they were asked for (the sampled token's and the
top-k), so a long prompt costs memory linear in k, not in the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from runtime.messages import ReqOutput

if TYPE_CHECKING:
    from runtime.managers.scheduler.req import Req


@dataclass
class SendState:
    """A request's output not yet sent (`Req.sent`)."""

    output_len: int = 0  # output tokens already sent
    replaced: int = 0  # sent tokens since taken back (jump-forward rewrote them): the next output says so
    # prompt logprob entries computed chunk by chunk ([logprob, token_id, top | None]), not yet sent
    input_logprobs: list[list[Any]] = field(default_factory=list)
    input_logprobs_done: bool = False  # every requested prompt position has its entry
    output_logprobs: list[list[Any]] = field(default_factory=list)
    first_chunk_sent: bool = False


def record_output_logprob(req: Req, logprob: float, token: int, top: list | None) -> None:
    """The sampled token's logprob (and its top-k, as [[logprob, id], ...]) for the next output."""
    req.sent.output_logprobs.append([logprob, token, [[lp, t] for lp, t in top] if top else None])


def take_back(req: Req, keep: int) -> None:
    """The output is rewritten from token `keep` on: tokens already sent past it are sent again (the client
    is told how many to drop)."""
    if req.sent.output_len > keep:
        req.sent.replaced += req.sent.output_len - keep
        req.sent.output_len = keep


def record_input_logprobs(req: Req, logits: torch.Tensor) -> None:
    """Prompt logprobs of one extend chunk. logits: [rows, vocab], one row per position
    max(logprob_start_len - 1, chunk start) .. kv_len - 1; row of position p scores token p + 1.

    The full-vocabulary rows live for this chunk only.
    """
    ids, sent = req.prompt_ids, req.sent
    first_pos = req.kv_len - logits.shape[0]  # position of row 0
    start = req.logprob_start_len
    if start == 0 and first_pos == 0:  # the first token has no logprob
        sent.input_logprobs.append([None, ids[0], None])
    # tokens scored by this chunk's rows, inside the prompt and at or after logprob_start_len
    targets = range(max(first_pos + 1, start, 1), min(req.kv_len, len(ids) - 1) + 1)
    if len(targets):
        rows = torch.tensor([p - 1 - first_pos for p in targets])
        lp = torch.log_softmax(logits[rows].float(), dim=-1)  # [len(targets), vocab]
        chosen = lp.gather(1, torch.tensor([ids[p] for p in targets]).unsqueeze(1)).squeeze(1)
        tops = None
        if req.top_logprobs_num:
            v, t = lp.topk(req.top_logprobs_num, dim=-1)
            tops = [[[a, b] for a, b in zip(vs, ts)] for vs, ts in zip(v.tolist(), t.tolist())]
        for j, (p, value) in enumerate(zip(targets, chosen.tolist())):
            sent.input_logprobs.append([value, ids[p], tops[j] if tops else None])
    if req.kv_len >= len(ids):
        sent.input_logprobs_done = True


class OutputStream:
    """The requests touched this step (new tokens, finished, failed) and the outputs they owe."""

    def __init__(self, stream_interval: int):
        self.stream_interval = stream_interval
        self._touched: dict[str, Req] = {}

    def touch(self, req: Req) -> None:
        self._touched[req.rid] = req

    def pending(self) -> bool:
        """Outputs still to send (a request rejected or aborted while nothing else runs)."""
        return bool(self._touched)

    def collect(self, isolated: Callable[[Req], AbstractContextManager]) -> list[ReqOutput]:
        """This step's outputs. `isolated(req)` is the scheduler's failure boundary: a request whose output
        cannot be built is failed by it, and what it was failed with is sent instead."""
        outs = []
        for req in list(self._touched.values()):
            try:
                with isolated(req):
                    out = self.output_of(req)
            except Exception:
                out = ReqOutput(
                    rid=req.rid,
                    new_token_ids=[],
                    finished_reason=req.finished_reason,
                    error=req.error,
                    error_status=req.error_status,
                )
            if out is not None:
                outs.append(out)
        self._touched = {}  # after the loop: failing a request above touches it again; its output is sent
        return outs

    def output_of(self, req: Req) -> ReqOutput | None:
        """What to send for `req` now (None: nothing yet); marks it sent."""
        sent = req.sent
        n_new = len(req.output_ids) - sent.output_len
        if not req.finished:
            interval = req.params.stream_interval or self.stream_interval  # SGLang's per-request one
            if not req.stream or n_new < interval and sent.first_chunk_sent:
                return None
        out = ReqOutput(
            rid=req.rid,
            new_token_ids=req.output_ids[sent.output_len :],
            replaced_tokens=sent.replaced,
            finished_reason=req.finished_reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.prefix_hit_len,
            cached_tokens_host=req.prefix_hit_host,
            cached_tokens_disk=req.prefix_hit_disk,
            error=req.error,
            error_status=req.error_status,
            spec=[req.spec.verify_steps, req.spec.accepted] if req.spec is not None else None,
        )
        if not sent.first_chunk_sent:
            p = req.params
            out.skip_special_tokens = p.skip_special_tokens
            out.spaces_between_special_tokens = p.spaces_between_special_tokens
            out.stop_strings = p.stop or None
            out.no_stop_trim = p.no_stop_trim
            out.cache_miss = req.cache_miss
            out.stop_regex = p.stop_regex or None
            sent.first_chunk_sent = True
        if req.return_logprob:
            out.input_token_logprobs, sent.input_logprobs = sent.input_logprobs, []
            out.output_token_logprobs, sent.output_logprobs = sent.output_logprobs, []
        sent.output_len = len(req.output_ids)
        sent.replaced = 0
        return out
