"""Speculative decoding: the decode step with drafts, verified in one forward (`--speculative-algorithm`).

Each running request gets a draft from `drafting.Drafter` (its own tokens, and with `suffix` the finished
sequences too). A constrained request's draft is walked through its grammar once
(`GrammarManager.verify_masks`): it ends before the first token the grammar rejects, after one that
terminates it, and after one into text the grammar forces (jump-forward goes first: it supplies forced text,
drafts cover the free part); the same walk fills the mask of every verified row. If any request has a
draft, the step is one EXTEND forward in which each request feeds its last token plus its draft (a request
without a draft feeds its last token alone, as a decode would), so drafted and plain requests share the
forward.

Verification samples row j of a request (the distribution after its draft's first j tokens) exactly as a
decode step would sample that position: same penalties (the draft's tokens count as output), bans, grammar
mask (the state after draft[:j]), temperature and filters, same generator. Row j is kept while the token
sampled there equals draft token j; the first token that differs is kept too, and the rest is dropped (with
all draft tokens accepted the last row adds one more). For greedy rows this is "the longest prefix equal to
the argmax, plus the bonus token". For sampled rows it is the standard accept/resample rule for a
deterministic draft: with y ~ p, x is accepted with probability p(x), and on rejection y is distributed as p
with x's mass removed, renormalised. So every emitted token has exactly the non-speculative distribution. A
seeded request's generator is rewound and advanced once per emitted token, so its tokens are those it would
draw without speculation (up to the round-off of a different batch shape). Emitted tokens go through the
scheduler's `_advance` one at a time, as decoded ones do: the grammar accepts each once, a stop or a
terminated grammar finishes the request there, and a jump-forward ends the run (its tokens replace the rest).

KV: slots for the last token and every draft token come from the request's decode run
(`CacheManager.run_slots`); after verification the slots of rejected positions leave its KV row at once and
go back to the head of that run (`CacheManager.drop_kv_from`), so a request's KV row only ever holds tokens
it keeps, the radix cache never receives a rejected token, and its next positions reuse those slots.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from runtime.managers.scheduler.batch_builder import build_verify_batch
from runtime.managers.scheduler.drafting import Drafter, SpecState
from runtime.managers.scheduler.req import Req
from runtime.managers.scheduler.spec_budget import DraftBudget
from runtime.model_executor.sampler import SamplingBatchInfo

if TYPE_CHECKING:
    from runtime.managers.scheduler.scheduler import Scheduler


class SpeculativeDecoder:
    def __init__(self, algorithm: str, max_draft: int):
        self.drafter = Drafter(algorithm, max_draft)
        self.max_draft = max_draft
        self.budget = DraftBudget()  # trims drafts to what the measured step cost says pays

    @classmethod
    def from_args(cls, args) -> SpeculativeDecoder | None:
        if args.speculative_algorithm == "none":
            return None
        return cls(args.speculative_algorithm, args.speculative_num_draft_tokens)

    # ---- drafting ------------------------------------------------------------------------------------------
    def draft(self, req: Req) -> list[int]:
        """The drafter's proposal for `req`'s next step ([] when it has none); a constrained request's is cut
        to what its grammar allows by `GrammarManager.verify_masks`."""
        bound = self.bound(req)
        k = min(bound, req.remaining_new_tokens - 1)  # room for the bonus token: max_new exact
        if k < 1:
            return []
        if req.spec is None:
            req.spec = SpecState(k=bound, max_k=bound)
        k = min(k, req.spec.k)
        return self.drafter.propose(req.spec, req.all_ids, k, shared_ok=req.cache_salt is None)

    def bound(self, req: Req) -> int:
        """The most draft tokens `req` may get: the server's, or its own `speculative_num_draft_tokens`
        when lower (0: it does not speculate)."""
        own = req.params.speculative_num_draft_tokens
        return self.max_draft if own is None else min(own, self.max_draft)

    def drafting(self, reqs: list[Req]) -> bool:
        """Whether any of `reqs` may speculate. When none may (each turned it off), a step costs what it
        costs without speculation: no proposals, no step timing for the draft budget."""
        return any(r.params.speculative_num_draft_tokens != 0 for r in reqs)

    def learn(self, req: Req, stats: dict) -> None:
        """A request left with valid tokens: its new part feeds the shared index (`suffix`). One that turned
        speculation off does not: it costs nothing of speculation's."""
        if (
            self.drafter.shared is None
            or req.cache_salt is not None
            or req.error is not None
            or req.params.speculative_num_draft_tokens == 0
        ):
            return
        t0 = time.perf_counter()
        self.drafter.learn(req.all_ids, req.prefix_hit_len)
        stats["spec_draft_seconds"] += time.perf_counter() - t0

    # ---- the step ------------------------------------------------------------------------------------------
    def step(self, s: Scheduler) -> bool:
        """Run the decode step of `s.running` with drafts; False (nothing done) when no request has a draft
        or the pool cannot hold them now (the plain decode step then runs, with its retraction logic)."""
        if not self.drafting(s.running):
            return False
        t0 = time.perf_counter()
        reqs = list(s.running)
        proposed = [self.draft(r) for r in reqs]
        s.stats["spec_draft_steps"] += 1
        if not any(proposed):  # the usual step on free text: every request pausing or without a match
            s.stats["spec_draft_seconds"] += time.perf_counter() - t0
            return False
        contexts = [r.seq_len for r in reqs]
        alphas = [r.spec.alpha if r.spec else 0.0 for r in reqs]
        drafts = self.budget.trim(proposed, contexts, alphas)
        for req, ctx, before, after in zip(reqs, contexts, proposed, drafts):
            if before and not after:
                req.spec.cut(ctx, before)
        mask = None
        if any(drafts):  # after the budget: the masks are filled for exactly the rows that are verified
            reqs, drafts, mask = s.grammars.verify_masks(reqs, drafts, lambda r: self._fail(s, r))
            contexts = [r.seq_len for r in reqs]  # a request whose grammar failed is gone
        s.stats["spec_draft_seconds"] += time.perf_counter() - t0
        if not any(drafts):
            return False
        slots = s.cm.run_slots(reqs, [1 + len(d) for d in drafts])
        if slots is None:
            return False
        at = 0
        for req, d in zip(reqs, drafts):
            s.cm.append_slots(req, slots[at : at + 1 + len(d)])
            at += 1 + len(d)
        t_step = time.perf_counter()
        ran = s._forward(
            reqs,
            lambda: build_verify_batch(reqs, drafts, s.cm.req_pool, device=s.runner.device),
            "verifying the draft of",
        )
        if ran is None:
            return True
        built, logits = ran
        s.stats["decode_steps"] += 1
        s.stats["spec_verify_steps"] += 1
        s.running = []
        self._verify(s, reqs, drafts, built.logit_rows, logits, mask)
        self.budget.observe(contexts, [1 + len(d) for d in drafts], time.perf_counter() - t_step, True)
        for req in reqs:
            s.outputs.touch(req)
            s._place(req)
        return True

    @staticmethod
    def _fail(s: Scheduler, req: Req) -> None:
        s._dequeue(req)
        s._fail_internal(req, "checking the draft of")

    def _verify(self, s: Scheduler, reqs: list[Req], drafts: list[list[int]], rows, logits, mask) -> None:
        """`mask`: `GrammarManager.verify_masks`'s, one row per logits row (None: no grammar)."""
        gens = {id(r.generator): (r.generator, r.generator.get_state()) for r in reqs if r.generator}
        try:
            out = self._sample(s, reqs, drafts, logits, mask)
            parts = [(reqs, drafts, rows, out)]
        except Exception:  # sample each request alone, so only the request at fault fails
            parts = []
            for req, d, r in zip(reqs, drafts, rows):
                for gen, state in gens.values():
                    gen.set_state(state)
                try:
                    one_mask = mask[r.start : r.stop] if req.grammar is not None else None
                    one = self._sample(s, [req], [d], logits[r.start : r.stop], one_mask)
                except Exception:
                    s._dequeue(req)
                    s._fail_internal(req, "sampling the next tokens of")
                    continue
                parts.append(([req], [d], [range(0, len(r))], one))
        for gen, state in gens.values():
            gen.set_state(state)
        for part_reqs, part_drafts, part_rows, out in parts:
            next_ids, logprobs = out.next_token_ids.tolist(), out.logprob_list()
            for req, draft, r in zip(part_reqs, part_drafts, part_rows):
                self._apply(s, req, draft, r, out, next_ids, logprobs)

    def _sample(self, s: Scheduler, reqs: list[Req], drafts: list[list[int]], logits: torch.Tensor, mask):
        """Sample every row: row j of a request as its decode step after draft[:j] would be sampled (its
        grammar's mask in the state after draft[:j]: `mask`, [rows, vocab] bool or None)."""
        row_reqs, outs, bans, tops = [], [], [], []
        for req, draft in zip(reqs, drafts):
            for j in range(1 + len(draft)):
                row_reqs.append(req)
                outs.append(req.output_ids + draft[:j] if j else req.output_ids)
                bans.append(s.stop.banned_ids(req, ahead=j))
                tops.append(req.top_logprobs_num if req.return_logprob else 0)
        vocab = logits.shape[-1]
        info = SamplingBatchInfo.from_requests([r.params for r in row_reqs], vocab, logits.device)
        return s.sampler(
            logits,
            info,
            outs,
            [r.prompt_ids for r in row_reqs],
            vocab_mask=mask.to(logits.device) if mask is not None else None,
            banned_token_ids=bans if any(bans) else None,
            top_logprobs_nums=tops if any(tops) else None,
            generators=[r.generator for r in row_reqs],
            need_logprobs=any(r.return_logprob for r in reqs),
        )

    def _apply(self, s: Scheduler, req: Req, draft: list[int], rows: range, out, next_ids, logprobs) -> None:
        """Emit the verified tokens of one request, stopping at the first rejection, finish or jump-forward
        (its forced tokens replace the rest of the run); free the KV of every position past the last
        accepted draft token."""
        from runtime.managers.scheduler.scheduler import RequestFailed

        old_seq = req.seq_len  # the last token sits at old_seq - 1; draft token j at old_seq + j
        accepted = emitted = 0
        try:
            with s._isolated(req, "advancing"):
                for j, i in enumerate(rows):
                    tok = next_ids[i]
                    jumped = s._advance(req, out, i, tok, logprobs[i])
                    emitted += 1
                    if j < len(draft) and tok == draft[j]:
                        accepted += 1
                    else:
                        break
                    if req.finished or jumped:
                        break
                if req.generator is not None and not req.params.is_greedy:
                    for _ in range(emitted):  # one draw per emitted token, as decode steps would make
                        torch.rand(1, generator=req.generator, device=req.generator.device)
                if draft:  # KV is valid for the last token and the accepted draft tokens; a running
                    # request keeps none for its newest token (kv_len == seq_len - 1)
                    s.cm.drop_kv_from(req, min(old_seq + accepted, req.seq_len - 1))
        except RequestFailed:
            return
        if draft:
            s.stats["spec_verified_drafts"] += 1
            s.stats["spec_draft_tokens"] += len(draft)
            s.stats["spec_accepted_tokens"] += accepted
            req.spec.record(len(draft), accepted, req.spec.max_k)


SPEC_COST_NAMES = ("fixed_s", "verify_extra_s", "per_row_s", "per_row_1k_keys_s")


def spec_info(stats: dict, spec: SpeculativeDecoder | None = None) -> dict:
    """Derived figures for /get_server_info and the metrics: mean tokens per verified draft (accepted + the
    sampled one), drafting seconds per step, and the draft budget's fitted step cost (seconds: fixed, per
    verify step's extra, per row, per row x 1000 keys; null before the first fit)."""
    verified, steps = stats["spec_verified_drafts"], stats["spec_draft_steps"]
    coef = spec.budget.cost.coef if spec is not None else None
    return {
        "spec_accept_length": (stats["spec_accepted_tokens"] + verified) / verified if verified else 0.0,
        "spec_draft_seconds_per_step": stats["spec_draft_seconds"] / steps if steps else 0.0,
        "spec_step_cost": dict(zip(SPEC_COST_NAMES, coef)) if coef else None,
    }
