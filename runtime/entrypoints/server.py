"""HTTP server: FastAPI app with the native (SGLang-compatible) API, admin endpoints and the OpenAI routes.

Every handler validates its input and answers 4xx with OpenAI's error object; nothing a client sends can
take the server down. Non-streaming handlers watch for client disconnects; streaming ones abort when the
response is cancelled -- either way the request's KV is freed at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.entrypoints.generate_input import (
    PROGRAM_HEADER,
    SESSION_HEADER,
    check_unicode,
    parse_cache_salt,
    parse_generate_body,
)
from runtime.entrypoints.http_common import (
    FastJSONResponse,
    error_response,
    run_unless_disconnected,
    sse,
)
from runtime.entrypoints.metrics import Metrics
from runtime.entrypoints.security import Guard, require_admin
from runtime.entrypoints.streaming import stream_response
from runtime.entrypoints.wire.anthropic import PATH_PREFIX as ANTHROPIC_PATHS
from runtime.entrypoints.wire.anthropic import anthropic_error
from runtime.errors import RequestError
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager
from runtime.server_args import ServerArgs

logger = logging.getLogger("radixlm.server")


class GenerateRequest(BaseModel):
    """Native /generate body (documented for OpenAPI; `parse_generate_body` does the exact validation).

    Strict, because lax mode would coerce ("yes" -> True, "5" -> 5) before the exact checks could object.
    """

    model_config = ConfigDict(extra="allow", strict=True)
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    timeout: float | None = None  # seconds; only shortens --request-timeout-s
    cache_salt: str | None = None  # cached KV is shared only between requests of the same salt
    session_id: str | None = None  # or the X-Session-Id header: its tokens stay cached for cache_ttl_s
    cache_ttl_s: float | None = None  # seconds; default --session-ttl-s
    lora_path: str | list[str] | None = None  # a LoRA adapter's name (or one per prompt); also `lora`


class ConcatAppendRequest(BaseModel):
    """SGLang frontend's `forks.join(mode="concate_and_append")`: append the forks' KV to `dst_rid`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    src_rids: list[str]
    dst_rid: str


class AbortRequest(BaseModel):
    """One request by its rid, or (an admin operation) every request with `abort_all`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str | None = None
    abort_all: bool = False


def create_app(tm: TokenizerManager, args: ServerArgs) -> FastAPI:
    # orjson for every JSON answer; routes with large bodies return a FastJSONResponse themselves
    app = FastAPI(title="radixlm", version="0.1.0", default_response_class=FastJSONResponse)
    app.state.tm = tm
    app.state.args = args
    metrics = Metrics()
    tm.metrics = metrics

    add_error_handlers(app)
    app.add_middleware(Guard, args=args)

    # ---- native API ---------------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request, body: GenerateRequest):
        data = body.model_dump(exclude_unset=True)
        if data.get("session_id") is None and request.headers.get(SESSION_HEADER):
            data["session_id"] = request.headers[SESSION_HEADER]
        if data.get("program_id") is None and request.headers.get(PROGRAM_HEADER):
            data["program_id"] = request.headers[PROGRAM_HEADER]
        try:
            reqs, is_batch = parse_generate_body(data, max_prompts=args.max_prompts_per_request)
        except ValueError as e:
            raise RequestError(str(e), 400) from None
        if reqs[0].stream:
            req = reqs[0]
            if req.params.n > 1:
                raise RequestError(
                    "streaming with n > 1 is not supported on /generate; use /v1 endpoints", 400
                )
            return await stream_response(tm, [req], _NativeFormatter())
        results = await run_unless_disconnected(request, tm.generate_all(reqs))
        return FastJSONResponse(results if is_batch or len(results) > 1 else results[0])

    @app.delete("/v1/sessions/{session_id}")
    async def release_session(session_id: str, cache_salt: str | None = None, lora: str | None = None):
        """Unpin a session's cached tokens now (they stay in the cache as ordinary LRU entries). A session
        is its id within its `cache_salt` (query parameter; none for unsalted requests) and, for requests
        that ran under a LoRA adapter, that adapter (`lora`: its name)."""
        try:
            salt = parse_cache_salt(cache_salt)
        except ValueError as e:
            raise RequestError(str(e), 400) from None
        released = await tm.release_session(session_id, salt, lora)
        if not released:
            return error_response(404, f"session {session_id!r} holds no pinned tokens")
        return {"session_id": session_id, "released_tokens": released}

    @app.post("/concate_and_append_request")
    async def concate_and_append_request(body: ConcatAppendRequest):
        """Accepted as a hint. SGLang's frontend has already appended the forks' text to the joining state's
        text, and its next /generate sends all of it: radixlm encodes that text with exact attention (the
        shared prefix from the radix cache) instead of splicing KV computed at other positions."""
        for rid in [*body.src_rids, body.dst_rid]:
            if not rid or len(rid) > args.max_rid_length:
                raise RequestError(
                    f"rids must be non-empty and at most --max-rid-length ({args.max_rid_length}) characters",
                    400,
                )
        return {"success": True}

    @app.get("/health")
    async def health():
        if not tm.healthy:
            return error_response(503, f"unhealthy: {tm.dead_reason}")
        if tm.draining:
            return error_response(503, "shutting down")
        return PlainTextResponse("ok")

    @app.get("/health_generate")
    async def health_generate():
        if not tm.healthy:
            return error_response(503, f"unhealthy: {tm.dead_reason}")
        reqs, _ = parse_generate_body(
            {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        )
        await asyncio.wait_for(tm.generate_all(reqs), timeout=60)
        return PlainTextResponse("ok")

    hf_config = _hf_config_summary(tm.model_dir)

    # /model_info and /server_info: the names sglang-router asks first (it falls back to the /get_* ones).
    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        tok = tm.tokenizer
        return {
            "model_path": args.model,
            "model_dir": tm.model_dir,
            "served_model_name": args.model_name,
            "tokenizer_path": tm.model_dir,
            "is_generation": True,
            **hf_config,
            "chat_template": tok.chat_template,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "context_length": tm.context_length,
            "vocab_size": tm.info.get("vocab_size"),
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        info = await tm.server_info()
        server_args = dataclasses.asdict(args)
        for name in ("api_key", "admin_api_key"):
            if server_args.get(name):
                server_args[name] = "***"
        # The name sglang-router registers this worker under (its /v1/models answer, as ours).
        server_args["served_model_name"] = args.model_name
        return {
            **server_args,
            **info,
            "requests_in_flight": tm.num_in_flight(),
            "model_dir": tm.model_dir,
            "load_seconds": tm.info.get("load_seconds"),
        }

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        require_admin(request, args, "/flush_cache")
        resp = await tm.flush_cache()
        if not resp.success:
            return error_response(400, f"cache not flushed: {resp.message}")
        return PlainTextResponse("Cache flushed.")

    @app.post("/abort_request")
    async def abort_request(request: Request, body: AbortRequest):
        if body.abort_all:
            if body.rid is not None:
                raise RequestError("give either 'rid' or 'abort_all', not both", 400)
            require_admin(request, args, "abort_all")
            logger.warning("abort_all: aborting %d request(s) in flight", tm.num_in_flight())
            tm.abort(abort_all=True)
            return {"success": True}
        if not body.rid:
            raise RequestError(
                "'rid' is required: the non-empty id of the request to abort (to abort every request, an "
                'admin sends {"abort_all": true})',
                400,
            )
        if len(body.rid) > args.max_rid_length:
            too_long = (
                f"'rid' is too long ({len(body.rid)} characters; --max-rid-length {args.max_rid_length})"
            )
            raise RequestError(too_long, 400)
        try:
            check_unicode({"rid": body.rid})  # the IPC encoder cannot carry a lone surrogate
        except ValueError as e:
            raise RequestError(str(e), 400) from None
        tm.abort_own(body.rid)
        return {"success": True}

    @app.get("/metrics")
    async def prometheus_metrics():
        try:
            info = await tm.server_info()
        except RequestError:
            info = None
        return Response(metrics.render(info), media_type="text/plain; version=0.0.4")

    from runtime.entrypoints.lora_routes import register_lora_routes
    from runtime.entrypoints.openai import register_openai_routes

    register_lora_routes(app, tm, args)  # before the OpenAI routes, which read its served names
    from runtime.entrypoints.dashboard import register_dashboard_routes

    register_dashboard_routes(app, tm, args)
    register_openai_routes(app, tm, args)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the client's, as OpenAI's error object (Anthropic's on the /v1/messages routes,
    where the `anthropic` client reads it)."""

    def error(request: Request, status: int, message: str, headers: dict[str, str] | None = None):
        if request.url.path.startswith(ANTHROPIC_PATHS):
            return anthropic_error(status, message)
        return error_response(status, message, headers=headers)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        return error(request, e.status, e.message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error(request, 400, _describe_validation(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        """Routing errors (404, 405) and body decode failures, in the same error object as everything else."""
        return error(request, e.status_code, _describe_http_error(request, e), headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        """A bug on our side. The client gets an id to quote, never the exception text (it can carry paths,
        configuration or other clients' data); the log gets the id with the traceback."""
        error_id = "err-" + secrets.token_hex(6)
        path = request.url.path
        logger.error("internal server error %s on %s %s", error_id, request.method, path, exc_info=e)
        return error(request, 500, f"internal server error (id {error_id}); see the server log")


class _NativeFormatter:
    """Native /generate streams: every event is the whole cumulative output, as the non-streaming answer."""

    def start(self, num_choices: int) -> list[bytes]:
        return []

    def update(self, index: int, out: dict[str, Any], text_delta: str, logprob_start: int) -> bytes | None:
        return sse(out)

    def end(self, finals: list[dict[str, Any]]) -> list[bytes]:
        return []


def _describe_http_error(request: Request, e: StarletteHTTPException) -> str:
    message = str(e.detail)
    if e.status_code in (404, 405):
        message = f"{message}: {request.method} {request.url.path}"
    elif e.__cause__ is not None:  # FastAPI's "There was an error parsing the body" hides why
        message = f"{message}: {e.__cause__}"
    return message


def _hf_config_summary(model_dir: str) -> dict[str, Any]:
    """`model_type` and `architectures` from the model folder's config.json (what a router labels workers
    with); empty when the file is missing or unreadable."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in ("model_type", "architectures") if k in config}


def _describe_validation(e: RequestValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
        else:
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"
