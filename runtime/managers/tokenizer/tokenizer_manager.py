"""TokenizerManager: the front of the process trio, living in the caller's process on an asyncio loop.

It has the Supervisor launch the scheduler and detokenizer processes, tokenizes and validates requests, sends
them over ZMQ, and wakes each request's waiter when its text arrives. When the Supervisor reports a dead
child, every in-flight request fails at once with a clear error instead of hanging.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from runtime import ipc
from runtime.errors import RequestError
from runtime.managers.tokenizer.grammar_validator import GrammarValidator
from runtime.managers.tokenizer.supervisor import Supervisor
from runtime.messages import (
    AbortReq,
    BatchStrOut,
    DashboardStateReq,
    DashboardStateResp,
    FlushCacheReq,
    FlushCacheResp,
    GenerateReq,
    GetServerInfoReq,
    LoadLoraReq,
    LoraResp,
    ReleaseSessionReq,
    ReleaseSessionResp,
    ReqTextOutput,
    ServerInfoResp,
    ToolCallsMade,
    UnloadLoraReq,
    decode,
)
from runtime.sampling_params import INT64_MAX, SamplingParams, TokenBudgetError, check_token_budget
from runtime.server_args import ServerArgs
from runtime.tenants import scoped_salt, tenant_name

logger = logging.getLogger("radixlm.tokenizer_manager")

# Prompts per tokenizer call: a batch of many prompts is encoded in slices, so other requests' tokenization
# (and nothing on the event loop) waits behind one slice at most.
ENCODE_SLICE = 64


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    return_text_in_logprobs: bool
    client_rid: str | None = None  # set on the n choices of one client request: aborting it aborts them
    tenant: str | None = None  # whose key sent it (--api-keys-file)
    created: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    chunks: list[ReqTextOutput] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False
    first_token_time: float | None = None
    cached_tokens: int = 0
    cached_tokens_host: int = 0
    cached_tokens_disk: int = 0
    cache_miss: dict[str, Any] | None = None
    spec: list[int] | None = None  # speculative decoding: [verify steps, accepted draft tokens]
    finish_type: str | None = None
    input_logprobs: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)


class TokenizerManager:
    def __init__(self, args: ServerArgs, model_dir: str, on_child_death: Callable[[str], None] | None = None):
        from runtime.models.model_loader import load_tokenizer

        self.args = args
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.on_child_death = on_child_death
        self.endpoints = ipc.IpcEndpoints.create()
        self.states: dict[str, ReqState] = {}
        self.tenant_in_flight: Counter[str] = Counter()  # sequences in `states` per tenant
        self.pending_control: dict[type, list[asyncio.Future]] = {
            FlushCacheResp: [],
            ServerInfoResp: [],
            DashboardStateResp: [],
            ReleaseSessionResp: [],
            LoraResp: [],
        }
        self.dead_reason: str | None = None
        self.draining = False
        self.metrics = None  # set by the HTTP server (runtime.entrypoints.metrics.Metrics)
        self._tasks: list[asyncio.Task] = []
        self.grammar_validator = GrammarValidator(args)  # spec checks: capped workers, --grammar-* limits
        # Tokenization runs here, never on the event loop: a large prompt would otherwise keep /health and
        # every stream waiting. One worker: prompts are tokenized in arrival order, in slices of ENCODE_SLICE.
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixlm-tokenize")
        self.supervisor = Supervisor(args, model_dir, self.endpoints)
        try:
            self.info = self.supervisor.start()  # children already stopped if this raises
        except BaseException:
            self.shutdown()
            raise
        self.context_length: int = self.info["context_length"]
        self._ctx = zmq.asyncio.Context()
        self._send_sock = ipc.socket(self._ctx, zmq.PUSH, self.endpoints.scheduler, bind=False)
        self._recv_sock = ipc.socket(self._ctx, zmq.PULL, self.endpoints.tokenizer, bind=True)

    # ---- processes ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the receive loop and the watchdog on the running event loop."""
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._recv_loop()),
            loop.create_task(self.supervisor.watch(self._on_death)),
        ]

    def shutdown(self) -> None:
        if hasattr(self, "tokenize_pool"):
            self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if hasattr(self, "grammar_validator"):
            self.grammar_validator.close()
        if hasattr(self, "supervisor"):
            self.supervisor.stop()
        for t in self._tasks:
            t.cancel()
        if hasattr(self, "_ctx"):
            self._send_sock.close()
            self._recv_sock.close()
            self._ctx.term()
        self.endpoints.cleanup()

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    def _on_death(self, reason: str) -> None:
        logger.error("%s: failing %d in-flight request(s)", reason, len(self.states))
        self.dead_reason = reason
        self.fail_in_flight(reason)
        for futs in self.pending_control.values():
            for f in futs:
                if not f.done():
                    f.set_exception(RequestError(reason, 503))
            futs.clear()
        if self.on_child_death:
            self.on_child_death(reason)

    def fail_in_flight(self, reason: str, status: int = 503) -> None:
        """End every in-flight request now: its handler answers `status` with `reason` (a stream gets an error
        event), instead of waiting for output that will never come."""
        for st in list(self.states.values()):
            abandoned = {"type": "abort", "message": reason}
            st.chunks.append(
                ReqTextOutput(
                    rid=st.rid,
                    text_delta="",
                    new_token_ids=[],
                    error=reason,
                    error_status=status,
                    finished_reason=abandoned,
                )
            )
            st.event.set()

    async def _recv_loop(self) -> None:
        while True:
            msg = decode(await self._recv_sock.recv())
            if isinstance(msg, BatchStrOut):
                for out in msg.outputs:
                    st = self.states.get(out.rid)
                    if st is not None:
                        st.chunks.append(out)
                        st.event.set()
            elif type(msg) in self.pending_control:
                futs = self.pending_control[type(msg)]
                if futs:
                    fut = futs.pop(0)
                    if not fut.done():
                        fut.set_result(msg)

    # ---- requests --------------------------------------------------------------------------------------
    def num_in_flight(self) -> int:
        return len(self.states)

    def check_admission(self, n: int = 1) -> None:
        """503 when the server cannot take `n` more sequences; 429 when the requesting tenant (the HTTP
        request's, `tenants.current_tenant`) is at its --tenant-max-concurrent-requests."""
        if self.dead_reason:
            raise RequestError(f"server is unhealthy: {self.dead_reason}", 503)
        if self.draining:
            raise RequestError("server is shutting down", 503)
        limit = self.args.max_running_requests + self.args.max_queued_requests
        if len(self.states) + n > limit:
            raise RequestError(
                f"server overloaded: {len(self.states)} requests in flight (limit {limit})", 503
            )
        tenant, quota = tenant_name(), self.args.tenant_max_concurrent_requests
        if tenant is not None and quota and self.tenant_in_flight.get(tenant, 0) + n > quota:
            raise RequestError(
                f"tenant quota --tenant-max-concurrent-requests ({quota}) reached: "
                f"{self.tenant_in_flight.get(tenant, 0)} of your sequences are in flight",
                429,
            )

    def scope(self, cache_salt: str | None) -> tuple[str | None, str | None]:
        """(tenant, the salt the scheduler sees) of a request from the current HTTP request's tenant."""
        tenant = tenant_name()
        return tenant, scoped_salt(tenant, cache_salt, self.args.share_cache_across_tenants)

    # ---- request bounds (ServerArgs "request bounds"), checked before anything expensive ------------------
    def check_prompt_count(self, sequences: int) -> None:
        """`sequences`: prompts x n choices, every sequence the request would start."""
        limit = self.args.max_prompts_per_request
        if sequences > limit:
            raise RequestError(
                f"the request starts {sequences} sequences (prompts x n), more than "
                f"--max-prompts-per-request ({limit})",
                400,
            )

    def check_prompt_chars(self, chars: int) -> None:
        limit = self.args.max_prompt_chars
        if chars > limit:
            raise RequestError(
                f"the prompt text has {chars} characters, more than --max-prompt-chars ({limit})", 400
            )

    def check_stop(self, stop: list[str], what: str = "stop strings") -> None:
        """`what`: "stop strings", or "stop_regex patterns" (bounded alike, each kind on its own)."""
        if len(stop) > self.args.max_stop_strings:
            raise RequestError(
                f"{len(stop)} {what}, more than --max-stop-strings ({self.args.max_stop_strings})", 400
            )
        chars = sum(len(s) for s in stop)
        if chars > self.args.max_stop_chars:
            raise RequestError(
                f"the {what} have {chars} characters together, more than --max-stop-chars "
                f"({self.args.max_stop_chars})",
                400,
            )

    def check_rid(self, rid: str) -> None:
        """A rid travels in every message of its request and in log lines: short, and printable."""
        if len(rid) > self.args.max_rid_length:
            raise RequestError(
                f"'rid' has {len(rid)} characters, more than --max-rid-length ({self.args.max_rid_length})",
                400,
            )
        if not rid.isprintable():
            raise RequestError("'rid' must contain only printable characters (no control characters)", 400)

    def session_ttl(self, req: GenerateReq) -> float | None:
        """Seconds the request's tokens stay pinned after it finishes (0: it names no session; None: it gave
        none and --kv-retention auto lets the scheduler decide, for its named or inferred program)."""
        if req.options.session_id is None:
            auto = self.args.kv_retention == "auto"
            return None if auto or req.options.program_id is not None else 0.0
        ttl = req.options.cache_ttl_s
        if ttl is None and self.args.kv_retention == "auto":
            return None
        ttl = ttl if ttl is not None else self.args.session_ttl_s
        if ttl > self.args.max_session_ttl_s:
            limit = self.args.max_session_ttl_s
            raise RequestError(f"'cache_ttl_s' ({ttl:g}) is more than --max-session-ttl-s ({limit:g})", 400)
        return ttl

    def check_bounds(self, reqs: list[GenerateReq]) -> None:
        self.check_prompt_count(sum(r.params.n for r in reqs))
        self.check_prompt_chars(sum(len(r.text) for r in reqs if r.text is not None))
        for r in reqs:
            self.check_rid(r.rid)
            self.check_stop(r.params.stop)
            self.check_stop(r.params.stop_regex, "stop_regex patterns")

    # ---- tokenization (in `tokenize_pool`) -------------------------------------------------------------
    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, as `tokenizer.encode` gives them, computed off the event loop."""
        loop = asyncio.get_running_loop()
        out: list[list[int]] = []
        for i in range(0, len(texts), ENCODE_SLICE):
            part = texts[i : i + ENCODE_SLICE]
            out.extend(await loop.run_in_executor(self.tokenize_pool, self._encode, part, add_special_tokens))
        return out

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer's batch call lets go of the GIL while it encodes
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        return [self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    async def run_in_tokenizer(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run other tokenizer work (e.g. decoding echoed prompts) on the tokenization thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    async def tokenize_texts(self, reqs: list[GenerateReq]) -> list[GenerateReq]:
        """`reqs` with every text prompt replaced by its token ids (one tokenizer pass per prompt)."""
        texts = [r.text for r in reqs if r.input_ids is None]
        if not texts:
            return reqs
        ids = iter(await self.encode(texts))
        return [
            r if r.input_ids is not None else msgspec.structs.replace(r, text=None, input_ids=next(ids))
            for r in reqs
        ]

    async def validate_grammar(self, params: SamplingParams) -> None:
        if not params.has_grammar:
            return
        kind, spec = params.grammar
        problem = await self.grammar_validator.validate(kind, spec)  # RequestError 503 when busy
        if problem:
            raise RequestError(f"invalid {kind}: {problem}", 400)

    async def generate(self, req: GenerateReq) -> AsyncIterator[dict[str, Any]]:
        """Yield the cumulative output dict after every chunk (streaming) or once at the end.

        Closing the iterator early (client disconnect) aborts the request in the scheduler at once.
        """
        self.check_admission()
        ids = req.input_ids if req.input_ids is not None else (await self.encode([req.text]))[0]
        vocab_size = self.info.get("vocab_size")
        if req.input_ids is not None and vocab_size and not all(0 <= t < vocab_size for t in ids):
            # Checked here, not only in the scheduler: an id beyond 64 bits could not even be sent there.
            raise RequestError(f"input token ids must be in [0, {vocab_size})", 400)
        bias_problem = req.params.logit_bias_problem(vocab_size) if vocab_size else None
        if bias_problem:
            raise RequestError(bias_problem, 400)
        try:
            check_token_budget(
                len(ids), req.params.max_new_tokens, self.context_length, self.info.get("max_total_tokens")
            )
        except TokenBudgetError as e:
            raise RequestError(str(e), 400) from None
        if req.logprob_start_len >= len(ids):
            raise RequestError(
                f"logprob_start_len ({req.logprob_start_len}) must be < the prompt length ({len(ids)})", 400
            )
        await self.validate_grammar(req.params)
        if req.options.priority and self.args.scheduling_policy == "fcfs":
            raise RequestError(
                f"'priority' is {req.options.priority}, but this server runs --scheduling-policy fcfs "
                "(restart it with --scheduling-policy priority, or send priority 0)",
                400,
            )
        ttl = self.session_ttl(req)
        if req.rid in self.states:
            raise RequestError(f"duplicate request id {req.rid!r}", 400)
        tenant, salt = self.scope(req.options.cache_salt)
        options = msgspec.structs.replace(req.options, cache_salt=salt, cache_ttl_s=ttl, tenant=tenant)
        msg = msgspec.structs.replace(req, text=None, input_ids=ids, options=options)
        st = ReqState(
            req.rid, len(ids), req.return_text_in_logprobs, client_rid=req.client_rid, tenant=tenant
        )
        # Nothing may run between registering the state and entering the try: a state that outlives its
        # request is a permanent in-flight slot (and blocks the SIGTERM drain).
        self.states[req.rid] = st
        if tenant is not None:
            self.tenant_in_flight[tenant] += 1
        sent = False
        try:
            if self.metrics:
                self.metrics.on_request_start()
            try:
                ipc.send(self._send_sock, msg)
            except (OverflowError, TypeError, ValueError) as e:  # a value the IPC encoder cannot carry
                raise RequestError(f"the request cannot be encoded: {e}", 400) from None
            sent = True
            while True:
                await st.event.wait()
                st.event.clear()
                chunks, st.chunks = st.chunks, []
                for c in chunks:
                    self._apply_chunk(st, c)
                if st.finished:
                    yield self._result(st, chunks[-1])
                    return
                if req.stream and chunks:
                    yield self._result(st, chunks[-1])
        finally:
            self.states.pop(req.rid, None)
            if tenant is not None:
                self.tenant_in_flight[tenant] -= 1
                if not self.tenant_in_flight[tenant]:
                    del self.tenant_in_flight[tenant]
            if sent and not st.finished and self.dead_reason is None:
                self.abort(req.rid)
            if self.metrics:
                self.metrics.on_request_end(st)

    def _apply_chunk(self, st: ReqState, c: ReqTextOutput) -> None:
        if c.error:
            st.finished = True
            raise RequestError(c.error, c.error_status or 500)
        if c.replaced_tokens:
            del st.output_ids[len(st.output_ids) - c.replaced_tokens :]
        st.output_ids.extend(c.new_token_ids)
        if st.first_token_time is None and st.output_ids:
            st.first_token_time = time.perf_counter()
        st.text += c.text_delta
        st.cached_tokens, st.cached_tokens_host = c.cached_tokens, c.cached_tokens_host
        st.cached_tokens_disk = c.cached_tokens_disk
        if c.cache_miss is not None:
            st.cache_miss = c.cache_miss
        if c.spec is not None:
            st.spec = c.spec
        if c.input_token_logprobs:
            st.input_logprobs.extend(self._lp_entries(st, c.input_token_logprobs))
        if c.output_token_logprobs:
            st.output_logprobs.extend(self._lp_entries(st, c.output_token_logprobs))
        if c.finished_reason is not None:
            st.finished = True
            st.finish_type = c.finished_reason.get("type")

    def _lp_entries(self, st: ReqState, entries: list) -> list:
        out = []
        for lp, tid, top in entries:
            text = self.tokenizer.decode([tid]) if st.return_text_in_logprobs else None
            top_fmt = None
            if top:
                top_fmt = [
                    [tlp, t, self.tokenizer.decode([t]) if st.return_text_in_logprobs else None]
                    for tlp, t in top
                ]
            out.append((lp, tid, text, top_fmt))
        return out

    def _result(self, st: ReqState, last: ReqTextOutput) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": st.rid,
            "prompt_tokens": st.prompt_tokens,
            "completion_tokens": len(st.output_ids),
            "cached_tokens": last.cached_tokens,
            "cached_tokens_by_tier": {
                "device": last.cached_tokens - last.cached_tokens_host - last.cached_tokens_disk,
                "host": last.cached_tokens_host,
                "disk": last.cached_tokens_disk,
            },
            "finish_reason": last.finished_reason,
            "e2e_latency": time.perf_counter() - st.created,
        }
        if st.cache_miss is not None:
            meta["cache_miss"] = st.cache_miss
        if st.spec is not None:  # tokens per verify step: accepted draft tokens + the sampled one
            steps, accepted = st.spec
            meta["spec_verify_steps"] = steps
            meta["spec_accept_len"] = (accepted + steps) / steps if steps else 0.0
        if st.input_logprobs or st.output_logprobs:
            meta["input_token_logprobs"] = [[lp, t, x] for lp, t, x, _ in st.input_logprobs]
            meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x, _ in st.output_logprobs]
            meta["output_token_logprobs_length"] = len(st.output_logprobs)  # as SGLang reports it
            meta["input_top_logprobs"] = [top for *_, top in st.input_logprobs]
            meta["output_top_logprobs"] = [top for *_, top in st.output_logprobs]
        return {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}

    async def prepare_choices(self, reqs: list[GenerateReq]) -> list[GenerateReq]:
        """Expand `n > 1` into n choices and prefill each such prompt once first, so the n choices share its
        KV through the radix cache instead of computing it n times. Admission counts every choice. The one
        place this rule lives: `generate_all` and the streaming loop both start here.

        The bounds and admission are checked before tokenizing: a request refused anyway costs no tokenizer
        time; each prompt is tokenized once, not once per choice."""
        self.check_bounds(reqs)
        self.check_admission(sum(r.params.n for r in reqs))
        reqs = await self.tokenize_texts(reqs)
        expanded = self.expand_n(reqs)
        warm = [self.prefill_only(r) for r in reqs if r.params.n > 1]
        if warm:
            await gather_or_cancel(*(self.final(w) for w in warm))
        return expanded

    async def generate_all(self, reqs: list[GenerateReq]) -> list[dict[str, Any]]:
        """Run non-streaming requests to completion (see `prepare_choices`); results flattened in order."""
        expanded = await self.prepare_choices(reqs)
        return await gather_or_cancel(*(self.final(r) for r in expanded))

    async def final(self, req: GenerateReq) -> dict[str, Any]:
        last = None
        async for chunk in self.generate(req):
            last = chunk
        return last

    @staticmethod
    def expand_n(reqs: list[GenerateReq]) -> list[GenerateReq]:
        out = []
        for r in reqs:
            if r.params.n == 1:
                out.append(r)
                continue
            for i in range(r.params.n):
                p = dataclasses.replace(r.params, n=1)
                if p.seed is not None:  # distinct samples, still reproducible
                    p = dataclasses.replace(p, seed=choice_seed(p.seed, i))
                out.append(msgspec.structs.replace(r, rid=f"{r.rid}-{i}", params=p, client_rid=r.rid))
        return out

    @staticmethod
    def prefill_only(r: GenerateReq) -> GenerateReq:
        p = dataclasses.replace(
            r.params, n=1, max_new_tokens=0, min_new_tokens=0, regex=None, json_schema=None, lark=None
        )
        return msgspec.structs.replace(
            r, rid=f"{r.rid}-prefill", params=p, stream=False, return_logprob=False, client_rid=r.rid
        )

    def abort_own(self, rid: str) -> None:
        """`abort(rid)` for a client: with tenants, only the requesting tenant's requests of that rid."""
        tenant = tenant_name()
        if tenant is None:
            return self.abort(rid)
        for st in [s for s in self.states.values() if s.tenant == tenant and rid in (s.rid, s.client_rid)]:
            ipc.send(self._send_sock, AbortReq(rid=st.rid))

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort request `rid` in the scheduler (with the n choices a client request of that rid became), or
        every request with `abort_all` ("" alone aborts none)."""
        ipc.send(self._send_sock, AbortReq(rid=rid, abort_all=abort_all))
        if rid and not abort_all:
            for st in [s for s in self.states.values() if s.client_rid == rid]:
                ipc.send(self._send_sock, AbortReq(rid=st.rid))

    def tool_calls_made(self, meta: dict[str, Any], names: list[str]) -> None:
        """A front end parsed tool calls `names` from the finished answer whose meta_info is `meta`: tell the
        scheduler's automatic retention which tools the program now waits on (nothing without
        `--kv-retention auto`, or without calls). Call it before the answer is sent."""
        if names and self.args.kv_retention == "auto" and meta.get("id"):
            ipc.send(self._send_sock, ToolCallsMade(rid=meta["id"], names=list(names)))

    # ---- control ---------------------------------------------------------------------------------------
    async def _control(self, msg, resp_type: type, timeout: float = 30.0):
        if self.dead_reason:
            raise RequestError(f"server is unhealthy: {self.dead_reason}", 503)
        fut = asyncio.get_running_loop().create_future()
        self.pending_control[resp_type].append(fut)
        ipc.send(self._send_sock, msg)
        return await asyncio.wait_for(fut, timeout)

    async def flush_cache(self) -> FlushCacheResp:
        return await self._control(FlushCacheReq(), FlushCacheResp)

    async def release_session(
        self, session_id: str, cache_salt: str | None = None, lora: str | None = None
    ) -> int:
        """Unpin a session of the current tenant (`DELETE /v1/sessions/{id}`), under adapter `lora` when its
        requests ran under one; the tokens it pinned (0: none, also for another tenant's session of that id).
        RequestError (400) when `lora` is not served."""
        tenant, salt = self.scope(cache_salt)
        msg = ReleaseSessionReq(session_id=session_id, cache_salt=salt, tenant=tenant, lora=lora)
        resp = await self._control(msg, ReleaseSessionResp)
        if resp.error is not None:
            raise RequestError(f"lora: {resp.error}", 400)
        return resp.released_tokens

    async def lora_control(self, msg: LoadLoraReq | UnloadLoraReq) -> LoraResp:
        """Load or unload a LoRA adapter in the scheduler; the reply lists the adapters served after."""
        return await self._control(msg, LoraResp)

    async def server_info(self) -> dict[str, Any]:
        resp = await self._control(GetServerInfoReq(), ServerInfoResp)
        return resp.info

    async def dashboard_state(self, tenant: str | None, admin: bool, max_nodes: int) -> dict[str, Any]:
        """The live dashboard's state as this viewer may see it (`entrypoints/dashboard.py`)."""
        msg = DashboardStateReq(tenant=tenant, admin=admin, max_nodes=max_nodes)
        resp = await self._control(msg, DashboardStateResp)
        return resp.state


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice `i` of a request seeded `seed`: seed + i, wrapped to stay a signed 64-bit integer
    (near INT64_MAX it continues at 0, so the n choices still get n different seeds)."""
    s = seed + i
    return s if s <= INT64_MAX else s - (1 << 63)


async def gather_or_cancel(*aws: Awaitable[Any]) -> list[Any]:
    """asyncio.gather, except that when one fails the others are cancelled (aborting their requests) and
    awaited: the accepted prompts of a rejected batch must not keep generating for a client that already
    got its error."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
