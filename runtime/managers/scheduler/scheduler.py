"""The scheduler: continuous batching over the radix cache, one step at a time.

`step()` is the lifecycle of DESIGN.md: admit (policy + token budget) -> build an extend or a decode batch
-> forward -> sample -> grammar / jump-forward -> finish checks -> outputs; finished requests' KV goes to the
radix cache. The class knows nothing about sockets (`scheduler_process` drives it over ZMQ), so tests run
it in-process.
"""

from __future__ import annotations

import gc
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from constrained.errors import GrammarUnavailable
from runtime.managers.scheduler.batch_builder import BuiltBatch, build_decode_batch, build_extend_batch
from runtime.managers.scheduler.cache_manager import CacheManager, make_tiers
from runtime.managers.scheduler.cpu_share import ThreadGovernor
from runtime.managers.scheduler.dashboard_state import DashboardTracker, dashboard_state
from runtime.managers.scheduler.grammar_manager import GrammarManager
from runtime.managers.scheduler.kv_events import BlockEvents, KVEventsConfig, ZmqEventPublisher
from runtime.managers.scheduler.lora_manager import LoraManager, lora_control
from runtime.managers.scheduler.memory import MemoryGuard, auto_budget_bytes, memory_report
from runtime.managers.scheduler.output_stream import (
    OutputStream,
    record_input_logprobs,
    record_output_logprob,
)
from runtime.managers.scheduler.programs import ProgramTable
from runtime.managers.scheduler.req import Req
from runtime.managers.scheduler.retention import Retention
from runtime.managers.scheduler.schedule_policy import (
    OVERDUE_AFTER_S,
    AddOutcome,
    AddResult,
    PrefillAdder,
    admit,
)
from runtime.managers.scheduler.sessions import SessionPins
from runtime.managers.scheduler.speculative import SpeculativeDecoder, spec_info
from runtime.managers.scheduler.stats import ThroughputLog, new_counters
from runtime.managers.scheduler.stop_checker import StopChecker
from runtime.mem_cache.radix_cache import NoPrefixCache, RadixCache
from runtime.messages import (
    AbortReq,
    DashboardStateReq,
    DashboardStateResp,
    FlushCacheReq,
    FlushCacheResp,
    GenerateReq,
    GetServerInfoReq,
    LoadLoraReq,
    Message,
    ReleaseSessionReq,
    ReleaseSessionResp,
    ReqOutput,
    ServerInfoResp,
    ToolCallsMade,
    UnloadLoraReq,
)
from runtime.model_executor.model_runner import ModelRunner
from runtime.model_executor.sampler import Sampler, SamplingBatchInfo, make_generator
from runtime.models.lora import LoraError
from runtime.models.parallel import TensorParallel
from runtime.server_args import ServerArgs

logger = logging.getLogger("radixlm.scheduler")
NO_LORA = "this server serves no LoRA adapters (start it with --lora-modules or --enable-lora)"


class RequestFailed(Exception):
    """Raised inside `Scheduler._isolated` once the request has been failed; the caller skips it."""


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
        host, disk = make_tiers(args, model_dir, self.runner)
        self.cm = CacheManager(
            cache,
            self.runner.req_to_token_pool,
            self.runner.allocator,
            host,
            disk,
            sliding_window=max(self.runner.config.sliding_windows, default=0),
        )
        self.sampler = Sampler()
        self.stop = StopChecker(self.tokenizer, self.runner.config.eos_token_ids)
        self.grammars = GrammarManager(self.tokenizer, self.runner.vocab_size, args)
        pool = self.runner.allocator.size
        max_pinned = args.max_pinned_tokens if args.max_pinned_tokens >= 0 else pool // 4
        tenant_tokens = args.tenant_max_pinned_tokens
        tenant_tokens = max_pinned // 2 if tenant_tokens < 0 else tenant_tokens
        self.sessions = SessionPins(self.cm.cache, max_pinned, host, args.tenant_max_pins, tenant_tokens)
        # agent programs: their attained service (`--schedule-policy program`) and automatic retention
        # requests that name no program are given one from their prompt where programs steer anything
        self.programs = ProgramTable(infer=args.schedule_policy == "program" or args.kv_retention == "auto")
        self.retention = (
            Retention(self.programs, self.sessions, self.cm, args.max_session_ttl_s)
            if args.kv_retention == "auto"
            else None
        )
        # while no waiting request can be admitted: the seconds they have waited together (each one's wait
        # counts: what holding automatic pins costs), and when that was last counted
        self._blocked_wait_s = 0.0
        self._blocked_at: float | None = None
        self._blocked_waiting = 0  # requests waiting when it was last counted
        self._holding = False  # nothing runs and the waiting requests wait for automatic pins (`can_run`)
        self.rng = random.Random(args.random_seed)
        self.spec = SpeculativeDecoder.from_args(args)  # the decode step with drafts; None: off
        torch.manual_seed(args.random_seed)

        self.grammar_wait: list[Req] = []  # grammar compiling
        self.waiting: list[Req] = []  # no KV yet (new or retracted)
        self.reextend: list[
            Req
        ] = []  # hold KV but need more than one token computed (chunked prefill, jump-forward)
        self.running: list[Req] = []  # decoding: kv_len == seq_len - 1
        self.riding: list[Req] = []  # running requests inside this step's prefill pass (`_riders`)
        self.outputs = OutputStream(args.stream_interval)  # what each touched request owes its client
        self.stats = new_counters()
        self._log = ThroughputLog(args.log_interval)
        # what the process may grow past this footprint (--memory-budget-mb); the process entry point takes
        # the footprint again once start-up is over (`MemoryGuard.start`)
        self.memory = MemoryGuard(auto_budget_bytes(args.memory_budget_mb))
        # KV cache events for cluster routers (--kv-events-config): the tree reports, the publisher sends
        events_config = KVEventsConfig.parse(args.kv_events_config)
        self.kv_events: BlockEvents | None = None
        self.kv_publisher: ZmqEventPublisher | None = None
        self._disk_events: BlockEvents | None = None  # the disk tier's listener ("DISK")
        if events_config is not None:
            medium = "GPU" if self.runner.device.type == "cuda" else "CPU"
            self.kv_events = BlockEvents(args.kv_events_block_size, medium)
            self.cm.cache.events = self.kv_events
            if self.cm.host is not None:
                self.cm.host.tree.events = self.kv_events.tier("HOST")
            if self.cm.disk is not None:
                self._disk_events = self.kv_events.tier("DISK")
                self.cm.disk.announce = self._disk_events.span_blocks
            self.kv_publisher = ZmqEventPublisher(events_config, data_parallel_rank=args.dp_rank)
        self.threads: ThreadGovernor | None = None  # set by the scheduler process (`cpu_share`)
        # hits, scopes, misses and pool history for GET /dashboard (`dashboard_state`)
        self.dashboard = DashboardTracker(self.cm.cache)
        # LoRA adapters (--lora-modules, --enable-lora): the served set and the model's slots; None: off
        self.lora = LoraManager.from_runner(self.runner, args.lora_modules, args.max_lora_rank)

    # ---- messages ---------------------------------------------------------------------------------------
    def handle(self, msg: Message) -> Message | None:
        """Apply one incoming message; returns a control reply when the message asks for one."""
        if isinstance(msg, GenerateReq):
            self._add_isolated(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid, abort_all=msg.abort_all)
        elif isinstance(msg, FlushCacheReq):
            ok = self.flush_cache()
            return FlushCacheResp(success=ok, message="" if ok else "requests are running; cache not flushed")
        elif isinstance(msg, GetServerInfoReq):
            return ServerInfoResp(info=self.server_info())
        elif isinstance(msg, DashboardStateReq):
            return DashboardStateResp(
                state=dashboard_state(self, self.dashboard, msg.tenant, msg.admin, msg.max_nodes)
            )
        elif isinstance(msg, ReleaseSessionReq):
            salt = msg.cache_salt
            if msg.lora is not None:  # the adapter's identity is part of its sessions' keys
                if self.lora is None:
                    return ReleaseSessionResp(0, "this server serves no LoRA adapters")
                try:
                    salt = self.lora.salt_of(msg.lora, salt)
                except LoraError as e:
                    return ReleaseSessionResp(0, str(e))
            return ReleaseSessionResp(
                released_tokens=self.sessions.release((msg.tenant, salt, msg.session_id))
            )
        elif isinstance(msg, ToolCallsMade):
            if self.retention is not None:
                self.retention.tool_calls(msg.rid, msg.names, self._kv_demand())
        elif isinstance(msg, (LoadLoraReq, UnloadLoraReq)):
            return lora_control(self.lora, msg)
        else:
            raise TypeError(f"scheduler cannot handle {type(msg).__name__}")
        return None

    def _add_isolated(self, msg: GenerateReq) -> None:
        """`add_request`, except that a failure fails this request alone (500 with an error id) instead of
        escaping into the receive loop, where the client would wait for an answer forever."""
        try:
            self.add_request(msg)
        except Exception:
            req = next((r for r in self._all_queued() if r.rid == msg.rid), None)
            if req is None:
                req = Req(rid=msg.rid, prompt_ids=[], params=msg.params)
            else:
                self._dequeue(req)
            self._fail_internal(req, "admitting")

    def add_request(self, msg: GenerateReq) -> None:
        timeout = self.args.request_timeout_s
        req = Req.from_message(msg, timeout if timeout and timeout > 0 else None)
        prog = self.programs.arrive(req)
        if self.retention is not None:
            self.retention.arrived(req, prog)
        r = self.runner
        problem = req.input_problem(r.vocab_size, r.context_length, r.max_total_tokens)
        if problem:
            self._fail(req, problem, 400)
            return
        if req.options.lora is not None:  # its adapter, whose identity joins its cache salt
            problem = self.lora.bind(req) if self.lora is not None else NO_LORA
            if problem:
                self._fail(req, problem, 400)
                return
        if req.session_id is not None and req.cache_ttl_s > 0 and not req.pin_prefix_len:
            # (a breakpoint's pin is the server's idea, not the client's: past the quota the tenant's own
            # oldest pin makes room instead)
            problem = self.sessions.quota_problem(req.session_key, len(req.prompt_ids))
            if problem:
                self._fail(req, problem, 429)
                return
        if req.priority:
            self.stats["requests_prioritized"] += 1
        req.generator = make_generator(req.params.seed)
        if req.params.has_grammar:
            # waits at most --grammar-queue-timeout-s (then 503); a full compile queue is a 503 at once
            req.grammar_future = self.grammars.compile_async(req.params)
            self.grammar_wait.append(req)
        else:
            self.waiting.append(req)

    def abort(self, rid: str, abort_all: bool = False) -> None:
        """Finish request `rid`, or every request with `abort_all`, as aborted. An empty rid matches none:
        aborting everything must be asked for explicitly."""
        if not (rid or abort_all):
            return
        for queue in (self.grammar_wait, self.waiting, self.reextend, self.running):
            for req in [r for r in queue if abort_all or r.rid == rid]:
                queue.remove(req)
                self._finish_aborted(req)

    def _finish_aborted(self, req: Req) -> None:
        self.grammars.cancel(req.grammar_future)  # a compile only this request waits for leaves the queue
        req.finish({"type": "abort", "message": "request aborted"})
        self._retire(req)
        self.stats["requests_aborted"] += 1

    def _expire_deadlines(self) -> None:
        """Abort every queued or running request past its deadline: KV freed (and cached), client told 504."""
        now = time.monotonic()
        for req in [r for r in self._all_queued() if r.deadline is not None and now > r.deadline]:
            self._dequeue(req)
            waited = now - req.arrival
            self._fail(
                req,
                f"request timed out after {waited:.1f} s (deadline: --request-timeout-s or the request's "
                "`timeout`); it was aborted and its partial output discarded",
                504,
            )
            self.stats["requests_timed_out"] += 1

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        self.sessions.release_all()  # an explicit flush empties the cache, pinned sessions included
        flushed = self.cm.flush()
        if flushed and self.spec is not None and self.spec.drafter.shared is not None:
            self.spec.drafter.shared.clear()  # it holds the flushed requests' text too
        return flushed

    # ---- the step ------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        queued = self.grammar_wait or self.waiting or self.reextend or self.running
        return bool(queued or self.outputs.pending())  # outputs: e.g. a request rejected while idle

    def can_run(self) -> bool:
        """Work that needs a forward pass (not just grammars compiling in the background, nor only requests
        waiting while automatic pins hold the memory: the loop then polls, not spins)."""
        if self.reextend or self.running:
            return True
        return bool(self.waiting) and not self._holding

    def step(self) -> list[ReqOutput]:
        """Run at most one forward pass; return the outputs to send.

        Failure boundary: an exception raised for one request (admission, grammar, sampling, output) fails
        that request alone with a 500 naming an error id (the traceback is logged under it); a failed
        forward fails the requests of its batch. Their KV is freed without caching, so the accounting
        invariant still holds and every other request goes on.
        """
        self._expire_deadlines()
        self.sessions.expire()
        self._poll_grammars()
        admitted = self._schedule_extend()
        if admitted:
            self._run_extend(admitted, self._riders())
        elif self.running:
            self._run_decode()
        self.prefetch()
        self._log.maybe_log(self.stats["generated_tokens"], self.has_work(), self.server_info)
        self.memory.check(self)
        if self.threads is not None:
            self.threads.tick()
        return self._collect_outputs()

    def prefetch(self) -> int:
        """Automatic retention: load programs expected back from the host tier into free slots (only while no
        request waits; the process loop calls it when idle too). Returns the tokens loaded."""
        if self.retention is None or self.waiting:
            return 0
        return self.retention.prefetch()

    def publish_events(self) -> None:
        """Send what the cache did since the last call as one event batch, and answer replay requests (the
        process loop calls it after every step and every message)."""
        if self.kv_publisher is not None:
            self.kv_publisher.publish(self.collect_events())
            self.kv_publisher.serve_replay()

    def collect_events(self) -> list:
        """Every tier's cache events since the last call: the disk tier's writer reports in the order it
        wrote and deleted, after what the device and host trees did this step."""
        if self._disk_events is not None:
            for kind, blocks in self.cm.disk.take_events():
                self._disk_events.report(kind, blocks)
        return self.kv_events.take()

    # ---- failure boundary ----------------------------------------------------------------------------------
    @contextmanager
    def _isolated(self, req: Req, stage: str) -> Iterator[None]:
        """Run one request's part of a step; an exception fails that request (see `step`) and is re-raised as
        `RequestFailed` only where the caller must skip the rest of that request's work."""
        try:
            yield
        except RequestFailed:
            raise
        except Exception:
            self._dequeue(req)
            self._fail_internal(req, stage)
            raise RequestFailed(req.rid) from None

    def _fail_internal(self, req: Req, stage: str) -> None:
        """Fail `req` after a bug or a fault on our side: the client gets 500 with an error id, never the
        exception text; the traceback goes to the log under that id. Its KV is freed without caching (its
        contents may not match its tokens)."""
        error_id = f"err-{uuid.uuid4().hex[:12]}"
        logger.exception("request %s failed while %s (error id %s)", req.rid[:256], stage, error_id)
        self.stats["requests_failed_internal"] += 1
        try:
            self.cm.release(req, cache_tokens=False)
        except Exception:  # the pool is now suspect: the idle accounting check decides whether we go on
            logger.exception("freeing the KV of failed request %s (error id %s)", req.rid[:256], error_id)
            req.req_pool_idx = None
        self._fail(req, f"internal error while {stage} this request (error id {error_id})", 500)

    def recover(self) -> list[ReqOutput]:
        """After an exception that escaped `step` (a bug outside any one request): fail every live request
        (500, error ids) and return their outputs. The caller then checks the KV accounting, which decides
        whether the process may go on."""
        for req in self._all_queued():
            self._dequeue(req)
            self._fail_internal(req, "scheduling")
        return self._collect_outputs()

    def _all_queued(self) -> list[Req]:
        return [*self.grammar_wait, *self.waiting, *self.reextend, *self.running, *self.riding]

    def _dequeue(self, req: Req) -> None:
        for queue in (self.grammar_wait, self.waiting, self.reextend, self.running, self.riding):
            if req in queue:
                queue.remove(req)
        self.grammars.cancel(req.grammar_future)  # no-op unless it still waits for a compile

    def _poll_grammars(self) -> None:
        self.grammars.expire([r.grammar_future for r in self.grammar_wait])
        for req in [r for r in self.grammar_wait if r.grammar_future.done()]:
            self.grammar_wait.remove(req)
            try:
                too_small = self.grammars.start(req, req.grammar_future.result())
            except GrammarUnavailable as e:  # queue full, waited too long, worker crashed: retry later
                self._fail(req, str(e), 503)
                continue
            except ValueError as e:  # GrammarError subclasses ValueError
                self._fail(req, f"invalid grammar: {e}", 400)
                continue
            except Exception:
                self._fail_internal(req, "starting the grammar of")
                continue
            if too_small:
                self._fail(req, too_small, 400)
                continue
            self.waiting.append(req)

    def _schedule_extend(self) -> list[tuple[Req, int]]:
        if not (self.waiting or self.reextend):
            return []
        a = self.args
        if not self.reextend and len(self.running) >= a.max_running_requests:
            self._preempt_for_priority()
            return []
        # Requests that already hold KV go first: they pin memory until they finish. A request mid chunked
        # prefill is first of those (see below).
        admitted, started = admit(
            self.cm, self.running, list(self.reextend), self.waiting, a, self.rng, self._offer, self.programs
        )
        for req, take in admitted:
            self.programs.charge(req, req.kv_len - take, req.kv_len)  # its slots were appended: kv_len moved
        for req in started:
            self.waiting.remove(req)
            if req.retractions == 0 and not req.output_ids:
                req.prefix_hit_len, req.prefix_hit_host = req.match_len, req.host_loaded_len
                req.prefix_hit_disk = req.disk_loaded_len
                if req.session_id:
                    self._explain_cache_miss(req)
                self.stats["prompt_tokens"] += len(req.prompt_ids)
                self.stats["cached_tokens"] += req.match_len
                self.dashboard.admitted(req)
        for req, _ in admitted:
            if req in self.reextend:
                self.reextend.remove(req)
            if req.kv_len < req.seq_len:
                # Cut by chunked prefill (at most one: the adder stops after cutting). It holds KV, so it goes
                # first next step; a request that is not admitted simply stays in `reextend`.
                self.reextend.insert(0, req)
        self._holding = False
        blocked = self._count_blocked_wait(bool(admitted))
        if not admitted and self.waiting and self.retention is not None and self.retention.relieve(blocked):
            pass  # an automatic pin went back to LRU order first: the next step tries again
        elif not admitted and self.waiting and self.retention is not None and self.retention.holding():
            # automatic pins are worth more prefill than the wait so far: they hold (`relieve`)
            self._holding = not self.running
            if self.running:
                self._preempt_for_priority()
        elif not admitted and not self.running and self.waiting:
            # Nothing runs and nothing fits: pinned sessions must not stall the server. Unpin the oldest
            # (its tokens become evictable); the next step tries again.
            self.sessions.release_oldest()
        elif not admitted and self.waiting:
            self._preempt_for_priority()
        return admitted

    def _count_blocked_wait(self, admitted: bool, now: float | None = None) -> float:
        """The request-seconds the waiting requests have waited together since none could last be admitted
        (0 once one is, or none waits): each step adds the time since the last one x the requests that were
        waiting then (one that arrived since has not waited that long). It is not reset when `relieve`
        releases a pin: every pin held meanwhile was paid that rent, so the next may go at once."""
        now = time.monotonic() if now is None else now
        if admitted or not self.waiting:
            self._blocked_wait_s, self._blocked_at = 0.0, None
            return 0.0
        if self._blocked_at is not None:
            self._blocked_wait_s += (now - self._blocked_at) * self._blocked_waiting
        self._blocked_at, self._blocked_waiting = now, len(self.waiting)
        return self._blocked_wait_s

    def _preempt_for_priority(self) -> None:
        """Nothing waiting could start (no request row or no KV): when a waiting request outranks a running
        one (a lower `priority` value), retract the lowest-ranked running request, output and cache kept;
        the next step admits the waiting one. A request that has waited past the starvation bound
        (schedule_policy.OVERDUE_AFTER_S) is never preempted, so the lowest priority still finishes."""
        if not self.waiting or not self.running:
            return
        best = min(r.priority for r in self.waiting)
        now = time.monotonic()
        victims = [r for r in self.running if r.priority > best and now - r.arrival <= OVERDUE_AFTER_S]
        if victims:
            victim = max(victims, key=lambda r: (r.priority, -len(r.output_ids), r.arrival))
            self._retract(victim, f"a waiting request of priority {best} outranks it")
            self.stats["priority_preemptions"] += 1

    def _offer(self, adder: PrefillAdder, req: Req, matched: bool) -> AddOutcome | None:
        if req.lora_adapter is not None and req.lora_slot < 0:  # its adapter's slot first, else it waits
            if not self.lora.acquire(req):
                return AddOutcome(AddResult.CONTINUE, 0)
            out = self._offer(adder, req, matched)
            if out is None or not out.tokens:
                self.lora.release(req)
            return out
        try:
            with self._isolated(req, "scheduling"):
                out = adder.add_waiting(req, matched)
                if out is not None and req.tier_unloaded_len:  # a tier held more than the pool had room for
                    if out.tokens:
                        self.stats["tier_tokens_recomputed"] += req.tier_unloaded_len
                    else:
                        self.stats["tier_load_waits"] += 1
                return out
        except RequestFailed:
            return AddOutcome(AddResult.CONTINUE, 0)

    def _explain_cache_miss(self, req: Req) -> None:
        req.cache_miss = self.sessions.explain(
            req.session_key, req.prompt_ids, req.prefix_hit_len, self.tokenizer.decode
        )
        if req.cache_miss is not None:
            logger.debug("cache miss of %s (session %s): %s", req.rid[:256], req.session_id, req.cache_miss)

    def _forward(self, reqs: list[Req], build: Callable[[], BuiltBatch], what: str, spared: list[Req] = ()):
        """Build and run one batch: (the built batch, logits). If either raises, every request of the batch
        but `spared` fails (500, error id) and None is returned: a failed forward cannot be blamed on one
        request. `spared`: requests that ran there as they would in a pass of their own (the decoding riders
        of a prefill pass), which the caller takes back."""
        try:
            built = build()
            if self.lora is not None:
                built.batch.lora_slots = self.lora.slots_of(reqs)
            return built, self.runner.forward(built.batch)
        except Exception:
            for req in reqs:
                if req in spared:
                    continue
                self._dequeue(req)
                self._fail_internal(req, what)
            return None

    def _riders(self) -> list[Req]:
        """The running requests that decode their next token inside this step's prefill pass, with a slot
        each already appended (none when mixing is off, or when the free list cannot give each its slot:
        they then wait for the next decode step, as without mixing).

        Why: a prefill pass reads every weight once, as a decode step does; the running requests' one token
        each adds little to it, where a separate decode step would read the weights again. Without it every
        arriving prompt (an agent's next call, a new user turn) stalls every running stream for a pass.
        Riders never evict: under a pool that is full, slots taken a pass early evicted cached prefixes
        that paused agents came back for (bench.agent_replay recomputed ~20% more prefill)."""
        if self.args.disable_mixed_batch or not self.running:
            return []
        riders = list(self.running)
        slots = self.cm.run_slots(riders, [1] * len(riders), evict=False)
        if slots is None:
            return []
        self.cm.append_one_slot_each(riders, slots)
        self.running, self.riding = [], riders
        return riders

    def _run_extend(self, admitted: list[tuple[Req, int]], riders: list[Req] = ()) -> None:
        t0 = time.perf_counter()
        batch = [*admitted, *((r, 1) for r in riders)]  # a rider extends its last token (a decode step)
        ran = self._forward(
            [r for r, _ in batch],
            lambda: build_extend_batch(batch, self.cm.req_pool, device=self.runner.device),
            "prefilling",
            spared=riders,
        )
        if ran is None:  # the prompts failed; the riders give their slot back and decode next step
            riding, self.riding = self.riding, []
            for req in riding:
                self.cm.drop_kv_from(req, req.kv_len - 1)
                self._place(req)
            return
        if self.retention is not None and not riders:  # the prompts' own time (retention's prefill rate)
            self.retention.observe_prefill(sum(take for _, take in admitted), time.perf_counter() - t0)
        built, logits = ran
        self.stats["extend_steps"] += 1

        last_rows, done = [], []
        for (req, _), rows in zip(admitted, built.logit_rows):
            try:
                with self._isolated(req, "computing prompt logprobs for"):
                    if req.wants_input_logprobs:
                        record_input_logprobs(req, logits[rows.start : rows.stop])
            except RequestFailed:
                continue
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
            try:
                with self._isolated(req, "caching the prefix of"):
                    if not req.finished and req.req_pool_idx is not None:
                        self.cm.cache_prefix(req)
                    self._place(req)
            except RequestFailed:
                continue
        for req, _ in admitted:
            self.outputs.touch(req)
        if riders:
            self.stats["mixed_decode_tokens"] += len(riders)
            self._sample_and_advance(riders, logits[[rows[-1] for rows in built.logit_rows[len(admitted) :]]])
            riding, self.riding = self.riding, []  # those still riding: a failed one left it (`_dequeue`)
            for req in riding:
                self.outputs.touch(req)
                self._place(req)

    def _run_decode(self) -> None:
        if self.spec is not None and self.spec.step(self):
            return

        def one_each() -> torch.Tensor | None:
            return self.cm.run_slots(self.running, [1] * len(self.running)) if self.running else None

        slots = one_each()
        while slots is None and self.sessions.release_oldest():  # pins go before running requests do
            slots = one_each()
        while slots is None and self.running:
            self._retract_one()
            slots = one_each()
        if not self.running:
            return
        reqs = list(self.running)
        self.cm.append_one_slot_each(reqs, slots)
        t_step = time.perf_counter()
        ran = self._forward(
            reqs, lambda: build_decode_batch(reqs, slots, device=self.runner.device), "decoding"
        )
        if ran is None:
            return
        logits = ran[1]
        self.stats["decode_steps"] += 1
        self.running = []
        self._sample_and_advance(reqs, logits)
        if self.spec is not None and self.spec.drafting(reqs):  # a plain step is the draft budget's baseline
            elapsed = time.perf_counter() - t_step
            self.spec.budget.observe([r.seq_len for r in reqs], [1] * len(reqs), elapsed, False)
        for req in reqs:
            self.outputs.touch(req)
            self._place(req)

    def _place(self, req: Req) -> None:
        """Queue a request after its tokens were sampled, by what its KV state needs next."""
        if req.finished:
            self._retire(req)
        elif req.req_pool_idx is None:  # its KV was given back (jump-forward rewrote cached tokens)
            self.waiting.append(req)
        elif req.kv_len == req.seq_len - 1:
            self.running.append(req)
        else:
            self.reextend.append(req)

    def _retract_one(self) -> None:
        """Decode ran out of KV: give the memory of the lowest-ranked request (the highest `priority`
        value), the least progressed among those, back; it re-queues, output kept."""
        self._retract(min(self.running, key=lambda r: (-r.priority, len(r.output_ids), -r.arrival)))

    def _retract(self, victim: Req, why: str = "KV pool exhausted") -> None:
        """Give a running request's KV back (its tokens stay cached) and queue it again, output kept."""
        self.running.remove(victim)
        self.cm.release(victim, cache_tokens=True)
        victim.retractions += 1
        self.stats["retractions"] += 1
        self.waiting.append(victim)
        logger.info("%s: retracted %s after %d output tokens", why, victim.rid, len(victim.output_ids))

    # ---- sampling and per-token bookkeeping ----------------------------------------------------------------
    def _sample_and_advance(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Sample one token per request (logits [len(reqs), vocab]) and apply it. If the batched sampler
        raises, each request is sampled alone, so only the request at fault fails."""
        try:
            out = self._sample(reqs, logits)
        except Exception:
            if len(reqs) == 1:
                self._dequeue(reqs[0])
                self._fail_internal(reqs[0], "sampling the next token of")
                return
            for i, req in enumerate(reqs):
                self._sample_and_advance([req], logits[i : i + 1])
            return
        next_ids = out.next_token_ids.tolist()
        logprobs = out.logprob_list()
        for i, req in enumerate(reqs):
            try:
                with self._isolated(req, "advancing"):
                    self._advance(req, out, i, next_ids[i], logprobs[i])
            except RequestFailed:
                continue

    def _sample(self, reqs: list[Req], logits: torch.Tensor):
        info = SamplingBatchInfo.from_requests([r.params for r in reqs], logits.shape[-1], logits.device)
        mask = self.grammars.vocab_mask(reqs, logits.shape[-1], logits.device)
        banned = [self.stop.banned_ids(r) for r in reqs]
        tops = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
        return self.sampler(
            logits,
            info,
            [r.output_ids for r in reqs],
            [r.prompt_ids for r in reqs],
            vocab_mask=mask,
            banned_token_ids=banned if any(banned) else None,
            top_logprobs_nums=tops if any(tops) else None,
            generators=[r.generator for r in reqs],
            need_logprobs=any(r.return_logprob for r in reqs),
        )

    def _advance(self, req: Req, out, i: int, tok: int, logprob: float) -> bool:
        """Apply row `i` of the sampler's output to `req`: token, logprobs, grammar, stop checks, jump.
        True when jump-forward rewrote the output (a speculative run ends there)."""
        req.output_ids.append(tok)
        self.stats["generated_tokens"] += 1
        if req.return_logprob:
            top = out.top_logprobs[i] if out.top_logprobs is not None and req.top_logprobs_num else None
            record_output_logprob(req, logprob, tok, top)
        if req.grammar is not None:
            if out.no_allowed_token is not None and bool(out.no_allowed_token[i]):
                req.finish({"type": "abort", "message": "grammar allows no further token"})
                return False
            req.grammar.accept_token(tok)
        reason = self.stop.check(req)
        if reason:
            req.finish(reason)
        elif self.grammars.jumps(req):
            gained = self.grammars.jump_forward(req, self.cm.drop_kv_from)
            if gained is not None:
                self.stats["jump_forward_tokens"] += gained
                return True
        return False

    # ---- leaving -------------------------------------------------------------------------------------------
    def _retire(self, req: Req) -> None:
        session = req.session_id if req.error is None else None
        prog = self.programs.finish(req)
        # automatic retention: a program's request that gave no cache_ttl_s (an explicit TTL wins)
        auto = self.retention is not None and prog is not None and req.error is None
        auto = auto and req.options.cache_ttl_s is None
        key = None
        if req.req_pool_idx is not None:
            key = req.cache_key(req.kv_len) if session or auto else None
            if key and req.pin_prefix_len:
                key = key[: req.pin_prefix_len]
            self.cm.release(req, cache_tokens=True)
        pinned = False
        if auto and key:
            decision = self.retention.retain(req, key, self._kv_demand())
            pinned = decision is not None and decision.action in ("device", "host")
        elif session:
            pinned = bool(key) and self.sessions.pin(req.session_key, key, req.cache_ttl_s)
        if session:
            self.sessions.remember(req.session_key, req.all_ids, pinned)
        if self.spec is not None:
            self.spec.learn(req, self.stats)
        self.outputs.touch(req)
        if req.finished_reason and req.finished_reason.get("type") != "abort":
            self.stats["requests_finished"] += 1
        if self.lora is not None:
            self.lora.release(req)

    def _kv_demand(self) -> int:
        """KV slots the queued requests want now: waiting prompts and the running requests' reservations
        (what automatic retention weighs a pin against)."""
        ratio = self.args.new_token_ratio
        waiting = sum(r.seq_len for r in self.waiting)
        return waiting + sum(int(r.remaining_new_tokens * ratio) for r in (*self.running, *self.reextend))

    def _fail(self, req: Req, message: str, status: int) -> None:
        req.error, req.error_status = message, status
        req.finish({"type": "abort", "message": message})
        self._retire(req)

    def _collect_outputs(self) -> list[ReqOutput]:
        return self.outputs.collect(lambda req: self._isolated(req, "sending the output of"))

    # ---- introspection -------------------------------------------------------------------------------------
    def live_requests(self) -> list[Req]:
        return [*self.waiting, *self.reextend, *self.running, *self.riding]

    def check_accounting(self) -> None:
        self.cm.check_accounting(self.live_requests())

    def server_info(self) -> dict[str, Any]:
        prompt = self.stats["prompt_tokens"]
        return {
            "num_running_reqs": len(self.running) + len(self.reextend),
            "num_queued_reqs": len(self.waiting) + len(self.grammar_wait),
            **self.cm.info(),
            "cache_hit_rate": self.stats["cached_tokens"] / prompt if prompt else 0.0,
            "attention_backend": self.runner.backend_name,
            "gc_frozen_objects": gc.get_freeze_count(),  # start-up objects the GC no longer walks
            "grammar": self.grammars.stats(),
            **(self.lora.info() if self.lora is not None else {}),
            **self.sessions.info(),
            **self.programs.info(),
            **(self.retention.info() if self.retention is not None else {}),
            **self.stats,
            **spec_info(self.stats, self.spec),
            "memory": memory_report(self, self.memory),
            **(self.threads.info() if self.threads is not None else {}),
            **(self.kv_publisher.info() if self.kv_publisher is not None else {}),
        }
