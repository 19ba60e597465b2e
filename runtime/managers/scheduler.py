"""The scheduler: continuous batching over the radix cache, one step at a time.

`step()` is the lifecycle of DESIGN.md: admit (policy + token budget) -> build an extend or a decode batch
-> forward -> sample -> grammar / jump-forward -> finish checks -> outputs; finished requests' KV goes to the
radix cache. The class knows nothing about sockets (`runtime.managers.scheduler_process` drives it over ZMQ),
so tests run it in-process.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import torch

from constrained.errors import GrammarUnavailable
from runtime.managers.batch_builder import build_decode_batch, build_extend_batch
from runtime.managers.cache_manager import CacheManager
from runtime.managers.grammar_manager import GrammarManager
from runtime.managers.req import Req, ReqStatus
from runtime.managers.schedule_policy import AddResult, PrefillAdder, order_waiting
from runtime.managers.stop_checker import StopChecker
from runtime.mem_cache.radix_cache import NoPrefixCache, RadixCache
from runtime.messages import (
    AbortReq,
    FlushCacheReq,
    FlushCacheResp,
    GetServerInfoReq,
    Message,
    ReqOutput,
    ServerInfoResp,
    TokenizedGenerateReq,
)
from runtime.model_executor.model_runner import ModelRunner
from runtime.model_executor.sampler import Sampler, SamplingBatchInfo, make_generator
from runtime.models.parallel import TensorParallel
from runtime.sampling_params import TokenBudgetError, check_token_budget
from runtime.server_args import ServerArgs

logger = logging.getLogger("radixlm.scheduler")


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        model_dir: str,
        runner: ModelRunner | None = None,
        tokenizer=None,
        tp: TensorParallel | None = None,
    ):
        from runtime.models.model_loader import load_tokenizer

        self.args = args = args.resolve()  # idempotent; tests may pass unresolved args
        self.runner = runner or ModelRunner.from_server_args(args, model_dir, tp)
        self.tokenizer = tokenizer or load_tokenizer(model_dir)
        cache = NoPrefixCache() if args.disable_radix_cache else RadixCache()
        self.cm = CacheManager(cache, self.runner.req_to_token_pool, self.runner.allocator)
        self.sampler = Sampler()
        self.stop = StopChecker(self.tokenizer, self.runner.config.eos_token_ids)
        self.grammars = GrammarManager(self.tokenizer, self.runner.vocab_size, args)
        self.rng = random.Random(args.random_seed)
        torch.manual_seed(args.random_seed)

        self.grammar_wait: list[Req] = []  # grammar compiling
        self.waiting: list[Req] = []  # no KV yet (new or retracted)
        self.reextend: list[
            Req
        ] = []  # hold KV but need more than one token computed (chunked prefill, jump-forward)
        self.running: list[Req] = []  # decoding: kv_len == seq_len - 1
        self.touched: dict[str, Req] = {}  # requests with output to send this step
        self.stats: dict[str, float] = dict(
            prompt_tokens=0,
            cached_tokens=0,
            generated_tokens=0,
            extend_steps=0,
            decode_steps=0,
            retractions=0,
            jump_forward_tokens=0,
            requests_finished=0,
            requests_aborted=0,
        )
        self._last_log = time.monotonic()
        self._gen_tokens_at_log = 0

    # ---- messages ---------------------------------------------------------------------------------------
    def handle(self, msg: Message) -> Message | None:
        """Apply one incoming message; returns a control reply when the message asks for one."""
        if isinstance(msg, TokenizedGenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            ok = self.flush_cache()
            return FlushCacheResp(success=ok, message="" if ok else "requests are running; cache not flushed")
        elif isinstance(msg, GetServerInfoReq):
            return ServerInfoResp(info=self.server_info())
        else:
            raise TypeError(f"scheduler cannot handle {type(msg).__name__}")
        return None

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        req = Req.from_message(msg)
        problem = self._validate(req)
        if problem:
            self._fail(req, problem, 400)
            return
        req.generator = make_generator(req.params.seed)
        if req.params.has_grammar:
            # waits at most --grammar-queue-timeout-s (then 503); a full compile queue is a 503 at once
            req.grammar_future = self.grammars.compile_async(req.params)
            req.status = ReqStatus.GRAMMAR
            self.grammar_wait.append(req)
        else:
            self.waiting.append(req)

    def _validate(self, req: Req) -> str | None:
        n, r = len(req.prompt_ids), self.runner
        try:
            check_token_budget(n, req.params.max_new_tokens, r.context_length, r.max_total_tokens)
        except TokenBudgetError as e:
            return str(e)
        if max(req.prompt_ids) >= r.vocab_size or min(req.prompt_ids) < 0:
            return f"input token ids must be in [0, {r.vocab_size})"
        if req.logprob_start_len >= n:
            return f"logprob_start_len ({req.logprob_start_len}) must be < the prompt length ({n})"
        return None

    def abort(self, rid: str) -> None:
        for queue in (self.grammar_wait, self.waiting, self.reextend, self.running):
            for req in [r for r in queue if rid in ("", r.rid)]:
                queue.remove(req)
                self._finish_aborted(req)

    def _finish_aborted(self, req: Req) -> None:
        self.grammars.cancel(req.grammar_future)  # a compile only this request waits for leaves the queue
        req.finish({"type": "abort", "message": "request aborted"})
        self._retire(req)
        self.stats["requests_aborted"] += 1

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        return self.cm.flush()

    # ---- the step ------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        # `touched`: outputs still to send (a request rejected or aborted while nothing else runs).
        return bool(self.grammar_wait or self.waiting or self.reextend or self.running or self.touched)

    def can_run(self) -> bool:
        """Work that needs a forward pass (not just grammars compiling in the background)."""
        return bool(self.waiting or self.reextend or self.running)

    def step(self) -> list[ReqOutput]:
        """Run at most one forward pass; return the outputs to send."""
        self._poll_grammars()
        admitted = self._schedule_extend()
        if admitted:
            self._run_extend(admitted)
        elif self.running:
            self._run_decode()
        self._maybe_log()
        return self._collect_outputs()

    def _poll_grammars(self) -> None:
        self.grammars.expire([r.grammar_future for r in self.grammar_wait])
        for req in [r for r in self.grammar_wait if r.grammar_future.done()]:
            self.grammar_wait.remove(req)
            try:
                req.grammar = req.grammar_future.result().new_matcher()
            except GrammarUnavailable as e:  # queue full, waited too long, worker crashed: retry later
                self._fail(req, str(e), 503)
                continue
            except ValueError as e:  # GrammarError subclasses ValueError
                self._fail(req, f"invalid grammar: {e}", 400)
                continue
            req.status = ReqStatus.WAITING
            self.waiting.append(req)

    def _schedule_extend(self) -> list[tuple[Req, int]]:
        if not (self.waiting or self.reextend):
            return []
        a = self.args
        if not self.reextend and len(self.running) >= a.max_running_requests:
            return []
        adder = PrefillAdder(
            self.cm,
            self.running,
            max_prefill_tokens=a.max_prefill_tokens,
            chunk_size=a.chunked_prefill_size,
            new_token_ratio=a.new_token_ratio,
            max_running=a.max_running_requests,
        )
        # Requests that already hold KV go first: they pin memory until they finish.
        held = list(self.reextend)  # a request mid chunked prefill is first (see the end of this method)
        held_admitted = 0
        for req in held:
            out = adder.add(req, req.seq_len - req.kv_len, chunkable=not req.wants_input_logprobs)
            held_admitted += out.tokens > 0
            if out.result is not AddResult.CONTINUE:
                break
        started: list[Req] = []
        if held_admitted == len(held):
            for req in order_waiting(a.schedule_policy, self.waiting, self.cm, self.rng):
                out = adder.add(req, req.seq_len - req.match_len, chunkable=not req.wants_input_logprobs)
                if out.tokens:
                    if not self.cm.start(req):
                        adder.withdraw_last()
                        break
                    started.append(req)
                if out.result is not AddResult.CONTINUE:
                    break
        admitted: list[tuple[Req, int]] = []
        for req, take in adder.admitted:
            slots = self.cm.alloc_slots(take)
            if slots is None:  # evictable prefixes got locked by this batch; retry next step
                if req in started:
                    self.cm.release(req, cache_tokens=False)
                    started.remove(req)
                continue
            self.cm.append_slots(req, slots)
            admitted.append((req, take))
        for req in started:
            self.waiting.remove(req)
            req.status = ReqStatus.RUNNING
            if req.retractions == 0 and not req.output_ids:
                req.cached_tokens = req.match_len
                self.stats["prompt_tokens"] += len(req.prompt_ids)
                self.stats["cached_tokens"] += req.match_len
        for req, _ in admitted:
            if req in self.reextend:
                self.reextend.remove(req)
            if req.kv_len < req.seq_len:
                # Cut by chunked prefill (at most one: the adder stops after cutting). It holds KV, so it goes
                # first next step; a request that is not admitted simply stays in `reextend`.
                self.reextend.insert(0, req)
        return admitted

    def _run_extend(self, admitted: list[tuple[Req, int]]) -> None:
        built = build_extend_batch(admitted, self.cm.req_pool, device=self.runner.device)
        logits = self.runner.forward(built.batch)
        self.stats["extend_steps"] += 1

        last_rows, done = [], []
        for (req, _), rows in zip(admitted, built.logit_rows):
            if req.wants_input_logprobs:
                self._record_input_logprobs(req, logits[rows.start : rows.stop])
            if req.kv_len == req.seq_len:  # prompt (or re-extend) complete: its last logits pick a token
                last_rows.append(rows[-1])
                done.append(req)
        wanting = [(r, i) for r, i in zip(done, last_rows) if r.params.max_new_tokens > 0]
        for req in done:
            if req.params.max_new_tokens == 0:  # prefill-only (cache warming, prompt logprobs)
                req.finish({"type": "length", "length": 0})
        if wanting:
            self._sample_and_advance([r for r, _ in wanting], logits[[i for _, i in wanting]])
        for req in done:
            if not req.finished and req.req_pool_idx is not None:
                self.cm.cache_prefix(req)
            self._place(req)
        for req, _ in admitted:
            self.touched[req.rid] = req

    def _run_decode(self) -> None:
        slots = self.cm.alloc_slots(len(self.running))
        while slots is None and self.running:
            self._retract_one()
            slots = self.cm.alloc_slots(len(self.running)) if self.running else None
        if not self.running:
            return
        reqs = list(self.running)
        for i, req in enumerate(reqs):
            self.cm.append_slots(req, slots[i : i + 1])
        logits = self.runner.forward(build_decode_batch(reqs, slots, device=self.runner.device).batch)
        self.stats["decode_steps"] += 1
        self.running = []
        self._sample_and_advance(reqs, logits)
        for req in reqs:
            self.touched[req.rid] = req
            self._place(req)

    def _place(self, req: Req) -> None:
        """Queue a request after its tokens were sampled, by what its KV state needs next."""
        if req.finished:
            self._retire(req)
        elif req.req_pool_idx is None:  # its KV was given back (jump-forward rewrote cached tokens)
            req.status = ReqStatus.WAITING
            self.waiting.append(req)
        elif req.kv_len == req.seq_len - 1:
            self.running.append(req)
        else:
            self.reextend.append(req)

    def _retract_one(self) -> None:
        """Decode ran out of KV: give the least-progressed request's memory back;
        it re-queues, output kept.
        """
        victim = min(self.running, key=lambda r: (len(r.output_ids), -r.arrival))
        self.running.remove(victim)
        self.cm.release(victim, cache_tokens=True)
        victim.status = ReqStatus.WAITING
        victim.retractions += 1
        self.stats["retractions"] += 1
        self.waiting.append(victim)
        logger.info(
            "KV pool exhausted: retracted %s after %d output tokens", victim.rid, len(victim.output_ids)
        )

    # ---- sampling and per-token bookkeeping ----------------------------------------------------------------
    def _sample_and_advance(self, reqs: list[Req], logits: torch.Tensor) -> None:
        info = SamplingBatchInfo.from_requests([r.params for r in reqs], logits.shape[-1], logits.device)
        mask = self.grammars.vocab_mask(reqs, logits.shape[-1], logits.device)
        banned = [self.stop.banned_ids(r) for r in reqs]
        tops = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
        out = self.sampler(
            logits,
            info,
            [r.output_ids for r in reqs],
            [r.prompt_ids for r in reqs],
            vocab_mask=mask,
            banned_token_ids=banned if any(banned) else None,
            top_logprobs_nums=tops if any(tops) else None,
            generators=[r.generator for r in reqs],
        )
        next_ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist()
        for i, req in enumerate(reqs):
            tok = next_ids[i]
            req.output_ids.append(tok)
            self.stats["generated_tokens"] += 1
            if req.return_logprob:
                top = out.top_logprobs[i] if out.top_logprobs is not None and tops[i] else None
                req.pending_output_logprobs.append(
                    [logprobs[i], tok, [[lp, t] for lp, t in top] if top else None]
                )
            if req.grammar is not None:
                if out.no_allowed_token is not None and bool(out.no_allowed_token[i]):
                    req.finish({"type": "abort", "message": "grammar allows no further token"})
                    continue
                req.grammar.accept_token(tok)
            reason = self.stop.check(req)
            if reason:
                req.finish(reason)
            elif req.grammar is not None and self.grammars.jump_forward and not req.return_logprob:
                self._jump_forward(req)

    def _jump_forward(self, req: Req) -> None:
        plan = self.grammars.plan_jump(req)
        if plan is None:
            return
        keep, new_ids = plan
        old_len = len(req.output_ids)
        req.output_ids = req.output_ids[:keep] + new_ids
        if req.sent_output_len > keep:
            req.replaced_since_send += req.sent_output_len - keep
            req.sent_output_len = keep
        self.stats["jump_forward_tokens"] += len(new_ids) - (old_len - keep)
        req.grammar.reset_to(req.output_ids)
        if len(req.output_ids) >= req.params.max_new_tokens:
            req.output_ids = req.output_ids[: req.params.max_new_tokens]
            req.grammar.reset_to(req.output_ids)
            req.finish({"type": "length", "length": req.params.max_new_tokens})
            return
        if req.grammar.is_terminated():
            req.finish({"type": "stop", "matched": None})
            return
        if not self.cm.truncate(req, min(req.kv_len, len(req.prompt_ids) + keep)):
            self.cm.release(req, cache_tokens=False)

    def _record_input_logprobs(self, req: Req, logits: torch.Tensor) -> None:
        """logits: rows for positions max(start-1, kv_start) .. seq_len-1 of the prompt."""
        start = req.logprob_start_len
        lp = torch.log_softmax(logits.float(), dim=-1)
        ids = req.prompt_ids
        first_pos = req.kv_len - logits.shape[0]  # position of row 0
        entries: list[list[Any]] = []
        for p in range(start, len(ids)):
            if p == 0:
                entries.append([None, ids[0], None])
                continue
            r = p - 1 - first_pos
            top = None
            if req.top_logprobs_num:
                v, t = lp[r].topk(req.top_logprobs_num)
                top = [[float(a), int(b)] for a, b in zip(v.tolist(), t.tolist())]
            entries.append([float(lp[r, ids[p]]), ids[p], top])
        req.pending_input_logprobs = entries

    # ---- leaving -------------------------------------------------------------------------------------------
    def _retire(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            self.cm.release(req, cache_tokens=True)
        req.status = ReqStatus.FINISHED
        self.touched[req.rid] = req
        if req.finished_reason and req.finished_reason.get("type") != "abort":
            self.stats["requests_finished"] += 1

    def _fail(self, req: Req, message: str, status: int) -> None:
        req.error, req.error_status = message, status
        req.finish({"type": "abort", "message": message})
        self._retire(req)

    def _collect_outputs(self) -> list[ReqOutput]:
        outs = []
        for req in self.touched.values():
            n_new = len(req.output_ids) - req.sent_output_len
            if not req.finished:
                if not req.stream or n_new < self.args.stream_interval and req.first_chunk_sent:
                    continue
            out = ReqOutput(
                rid=req.rid,
                new_token_ids=req.output_ids[req.sent_output_len :],
                replaced_tokens=req.replaced_since_send,
                finished_reason=req.finished_reason,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.output_ids),
                cached_tokens=req.cached_tokens,
                error=req.error,
                error_status=req.error_status,
            )
            if not req.first_chunk_sent:
                p = req.params
                out.skip_special_tokens = p.skip_special_tokens
                out.spaces_between_special_tokens = p.spaces_between_special_tokens
                out.stop_strings = p.stop or None
                out.no_stop_trim = p.no_stop_trim
                req.first_chunk_sent = True
            if req.return_logprob:
                out.input_token_logprobs = req.pending_input_logprobs
                out.output_token_logprobs = req.pending_output_logprobs
                req.pending_output_logprobs = []
                if req.pending_input_logprobs is not None:
                    req.pending_input_logprobs = []  # sent once
            req.sent_output_len = len(req.output_ids)
            req.replaced_since_send = 0
            outs.append(out)
        self.touched = {}
        return outs

    # ---- introspection -------------------------------------------------------------------------------------
    def live_requests(self) -> list[Req]:
        return [*self.waiting, *self.reextend, *self.running]

    def check_accounting(self) -> None:
        self.cm.check_accounting(self.live_requests())

    def server_info(self) -> dict[str, Any]:
        cache, alloc = self.cm.cache, self.cm.allocator
        prompt = self.stats["prompt_tokens"]
        return {
            "num_running_reqs": len(self.running) + len(self.reextend),
            "num_queued_reqs": len(self.waiting) + len(self.grammar_wait),
            "max_total_tokens": alloc.size,
            "free_slots": alloc.available(),
            "cache_tokens": cache.total_size(),
            "cache_evictable_tokens": cache.evictable_size(),
            "cache_protected_tokens": cache.protected_size(),
            "request_held_tokens": alloc.size - alloc.available() - cache.total_size(),
            "token_usage": 1 - (alloc.available() + cache.evictable_size()) / alloc.size,
            "cache_hit_rate": self.stats["cached_tokens"] / prompt if prompt else 0.0,
            "radix_cache_enabled": cache.enabled,
            "attention_backend": self.runner.backend_name,
            "grammar": self.grammars.stats(),
            **{k: v for k, v in self.stats.items()},
        }

    def _maybe_log(self) -> None:
        interval = self.args.log_interval
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval:
            return
        gen = self.stats["generated_tokens"]
        tput = (gen - self._gen_tokens_at_log) / (now - self._last_log)
        self._last_log, self._gen_tokens_at_log = now, gen
        if not self.has_work() and tput == 0:
            return
        info = self.server_info()
        logger.info(
            "running %d, queued %d, token usage %.2f, cache hit rate %.1f%%, gen throughput %.1f tok/s",
            info["num_running_reqs"],
            info["num_queued_reqs"],
            info["token_usage"],
            100 * info["cache_hit_rate"],
            tput,
        )
