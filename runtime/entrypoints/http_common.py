"""Pieces shared by the native and OpenAI-compatible HTTP routes: JSON encoding, errors, SSE, disconnects.

Responses and SSE chunks are encoded with orjson. Measured on a 100-token x 20-top-logprob /generate response
(bench/results/json_serialize.json, 2 heavily loaded CPU cores): 25 ms through FastAPI's default path
(jsonable_encoder, then json.dumps), 5.4 ms for json.dumps alone, 0.14 ms with orjson.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.errors import RequestError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    500: "internal_error",
}


def dumps(data: Any) -> bytes:
    """Compact UTF-8 JSON (non-ASCII text as is, not \\u-escaped, as before). NaN and +-inf, which JSON
    cannot spell, become null; non-string dict keys become strings, as json.dumps does."""
    return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)


class FastJSONResponse(JSONResponse):
    """A JSONResponse rendered by orjson. Handlers return one directly (not a dict) so that FastAPI skips
    `jsonable_encoder`, which costs more than the encoding itself on logprob-heavy responses."""

    def render(self, content: Any) -> bytes:
        return dumps(content)


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
    return FastJSONResponse(body, status_code=status, headers=headers)


def sse(data: Any) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + dumps(data) + b"\n\n"


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
