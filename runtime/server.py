"""HTTP server: FastAPI app with the native (SGLang-compatible) API, admin endpoints and the OpenAI routes.

Every handler validates its input and answers 4xx with OpenAI's error object; nothing a client sends can
take the server down. Non-streaming handlers watch for client disconnects; streaming ones abort when the
response is cancelled -- either way the request's KV is freed at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from runtime.generate_input import parse_generate_body
from runtime.http_common import SSE_DONE, error_response, run_unless_disconnected, sse, sse_stream
from runtime.metrics import Metrics
from runtime.server_args import ServerArgs
from runtime.tokenizer_manager import RequestError, TokenizerManager

logger = logging.getLogger("radixlm.server")


class GenerateRequest(BaseModel):
    """Native /generate body (documented for OpenAPI; `parse_generate_body` does the exact validation)."""

    model_config = ConfigDict(extra="allow")
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
    app = FastAPI(title="radixlm", version="0.1.0")
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

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if args.api_key and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            expected = f"Bearer {args.api_key}"
            if not hmac.compare_digest(auth.encode(), expected.encode()):
                return error_response(401, "missing or invalid API key (use 'Authorization: Bearer KEY')")
        if request.method == "POST" and "json" not in request.headers.get("content-type", ""):
            # Bodies are always JSON here; accept clients (curl -d) that omit or mislabel the content type.
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            request.scope["headers"] = [*headers, (b"content-type", b"application/json")]
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return error_response(400, "invalid Content-Length header")
            if int(length) > args.max_request_bytes:
                return error_response(413, f"request body too large ({length} bytes; limit {args.max_request_bytes})")
        elif request.method == "POST" and request.headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            async for part in request.stream():
                body += part
                if len(body) > args.max_request_bytes:
                    return error_response(413, f"request body too large (limit {args.max_request_bytes} bytes)")
            request._body = body  # starlette caches the body here; handlers read it from the cache
        try:
            return await call_next(request)
        except RequestError as e:
            return error_response(e.status, e.message)

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
                raise RequestError("streaming with n > 1 is not supported on /generate; use /v1 endpoints", 400)
            tm.check_admission()
            # Validate before the 200 status goes out, so bad input is still a 4xx.
            agen = tm.generate(req)
            first = await _first_or_error(agen)

            async def events():
                try:
                    if first is not None:
                        yield sse(first)
                        async for out in agen:
                            yield sse(out)
                    yield SSE_DONE
                finally:
                    await agen.aclose()

            return StreamingResponse(sse_stream(events()), media_type="text/event-stream")
        results = await run_unless_disconnected(request, tm.generate_all(reqs))
        return results if is_batch or len(results) > 1 else results[0]

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
        reqs, _ = parse_generate_body({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        await asyncio.wait_for(tm.generate_all(reqs), timeout=60)
        return PlainTextResponse("ok")

    @app.get("/get_model_info")
    async def model_info():
        tok = tm.tokenizer
        return {"model_path": args.model, "model_dir": tm.model_dir, "served_model_name": args.model_name,
                "tokenizer_path": tm.model_dir, "is_generation": True, "chat_template": tok.chat_template,
                "bos_token": tok.bos_token, "eos_token": tok.eos_token, "context_length": tm.context_length,
                "vocab_size": tm.info.get("vocab_size")}

    @app.get("/get_server_info")
    async def server_info():
        info = await tm.server_info()
        server_args = dataclasses.asdict(args)
        if server_args.get("api_key"):
            server_args["api_key"] = "***"
        return {**server_args, **info, "requests_in_flight": tm.num_in_flight(), "model_dir": tm.model_dir,
                "load_seconds": tm.info.get("load_seconds")}

    @app.post("/flush_cache")
    async def flush_cache():
        resp = await tm.flush_cache()
        if not resp.success:
            return error_response(400, f"cache not flushed: {resp.message}")
        return PlainTextResponse("Cache flushed.")

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        tm.abort(body.rid)
        return {"success": True}

    @app.get("/metrics")
    async def prometheus_metrics():
        try:
            info = await tm.server_info()
        except RequestError:
            info = None
        return Response(metrics.render(info), media_type="text/plain; version=0.0.4")

    from runtime.openai_api import register_openai_routes

    register_openai_routes(app, tm, args)
    return app


async def _first_or_error(agen):
    """Pull the first item so validation errors raise before the response starts; None if it ended."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None


def _describe_validation(e: RequestValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
        else:
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"

