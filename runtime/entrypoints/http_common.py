"""Pieces shared by the native and OpenAI-compatible HTTP routes: errors, SSE, disconnect handling."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.errors import RequestError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    500: "internal_error",
}


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """OpenAI's error object, used by every endpoint so clients parse one shape."""
    # A message may quote the client's input, which can hold lone surrogates that UTF-8 cannot encode.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": status,
        }
    }
    if status == 503 and headers is None:
        headers = {"Retry-After": "1"}
    return JSONResponse(body, status_code=status, headers=headers)


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


async def run_unless_disconnected(request: Request, coro: Awaitable[Any], poll_s: float = 0.2) -> Any:
    """Await `coro`, cancelling it (which aborts its requests and frees their KV) if the client goes away."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise RequestError("client disconnected", 499)
    finally:
        if not task.done():
            task.cancel()


async def sse_stream(gen: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Wrap an SSE generator so a failure mid-stream becomes an error event instead of a cut connection."""
    try:
        async for chunk in gen:
            yield chunk
    except RequestError as e:
        yield sse(
            {"error": {"message": e.message, "type": ERROR_TYPES.get(e.status, "error"), "code": e.status}}
        )
        yield SSE_DONE
