"""HTTP server: FastAPI app with the native (SGLang-compatible) API, admin endpoints and the OpenAI routes.

Every handler validates its input and answers 4xx with OpenAI's error object; nothing a client sends can
take the server down. Non-streaming handlers watch for client disconnects; streaming ones abort when the
response is cancelled -- either way the request's KV is freed at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.entrypoints.generate_input import check_unicode, parse_generate_body
from runtime.entrypoints.http_common import (
    FastJSONResponse,
    error_response,
    run_unless_disconnected,
    sse,
)
from runtime.entrypoints.metrics import Metrics
from runtime.entrypoints.streaming import stream_response
from runtime.errors import RequestError
from runtime.managers.tokenizer_manager import TokenizerManager
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


class AbortRequest(BaseModel):
    rid: str = ""


def create_app(tm: TokenizerManager, args: ServerArgs) -> FastAPI:
    # orjson for every JSON answer; routes with large bodies return a FastJSONResponse themselves
    app = FastAPI(title="radixlm", version="0.1.0", default_response_class=FastJSONResponse)
    app.state.tm = tm
    app.state.args = args
    metrics = Metrics()
    tm.metrics = metrics

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError):
        return error_response(e.status, e.message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return error_response(400, _describe_validation(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        """Routing errors (404, 405) and body decode failures, in the same error object as everything else."""
        return error_response(e.status_code, _describe_http_error(request, e), headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        """A bug on our side: still the error object (Starlette logs the traceback after this answers)."""
        return error_response(
            500, f"internal server error while serving {request.url.path}: {type(e).__name__}: {e}"
        )

    app.add_middleware(_Guard, args=args)

    # ---- native API ---------------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request, body: GenerateRequest):
        try:
            reqs, is_batch = parse_generate_body(body.model_dump(exclude_unset=True))
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
        if server_args.get("api_key"):
            server_args["api_key"] = "***"
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
    async def flush_cache():
        resp = await tm.flush_cache()
        if not resp.success:
            return error_response(400, f"cache not flushed: {resp.message}")
        return PlainTextResponse("Cache flushed.")

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        try:
            check_unicode({"rid": body.rid})  # the IPC encoder cannot carry a lone surrogate
        except ValueError as e:
            raise RequestError(str(e), 400) from None
        tm.abort(body.rid)
        return {"success": True}

    @app.get("/metrics")
    async def prometheus_metrics():
        try:
            info = await tm.server_info()
        except RequestError:
            info = None
        return Response(metrics.render(info), media_type="text/plain; version=0.0.4")

    from runtime.entrypoints.openai_api import register_openai_routes

    register_openai_routes(app, tm, args)
    return app


class _Guard:
    """Pure ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from the handlers):
    API key, JSON content type, body size limit."""

    def __init__(self, app, args: ServerArgs):
        self.app, self.args = app, args

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        args = self.args
        headers = {k.lower(): v for k, v in scope["headers"]}
        if args.api_key and scope["path"] != "/health":
            if not hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {args.api_key}".encode()):
                resp = error_response(401, "missing or invalid API key (use 'Authorization: Bearer KEY')")
                return await resp(scope, receive, send)
        if scope["method"] == "POST" and b"json" not in headers.get(b"content-type", b""):
            scope["headers"] = [
                *((k, v) for k, v in scope["headers"] if k != b"content-type"),
                (b"content-type", b"application/json"),
            ]
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await error_response(400, "invalid Content-Length header")(scope, receive, send)
            if int(length) > args.max_request_bytes:
                msg = f"request body too large ({int(length)} bytes; limit {args.max_request_bytes})"
                return await error_response(413, msg)(scope, receive, send)
        elif scope["method"] == "POST" and headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = b""
            while True:
                msg = await receive()
                if msg["type"] != "http.request":
                    return
                body += msg.get("body", b"")
                if len(body) > args.max_request_bytes:
                    msg = f"request body too large (limit {args.max_request_bytes} bytes)"
                    return await error_response(413, msg)(scope, receive, send)
                if not msg.get("more_body"):
                    break
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # after the body: disconnect detection still works

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


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
