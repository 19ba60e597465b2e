"""`RuntimeEndpoint`: run programs against a radixlm (or SGLang-compatible) server over its native HTTP
API.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import requests

from lang.backends.native import NativeBackend
from lang.errors import BackendError


class RuntimeEndpoint(NativeBackend):
    """Backend over `POST /generate` and `GET /get_model_info` of a server at `base_url`.

    One `requests.Session` per thread keeps connections alive without sharing a session across threads
    (run_batch calls in from many). `timeout` is per request, in seconds (None: wait as long as it takes).
    `options` and `lora` go with every request (see `NativeBackend`).
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:30000",
        api_key: str | None = None,
        timeout: float | None = None,
        options: dict[str, Any] | None = None,
        lora: str | None = None,
    ) -> None:
        super().__init__(options, lora)
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._local = threading.local()
        self._info: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers.update(self._headers)
        return session

    def _send(
        self, method: str, path: str, body: dict[str, Any] | None = None, stream: bool = False
    ) -> requests.Response:
        url = self.base_url + path
        try:
            resp = self._session().request(method, url, json=body, stream=stream, timeout=self.timeout)
        except requests.RequestException as e:
            raise BackendError(f"cannot reach {url}: {e}") from e
        if resp.status_code >= 400:
            message = error_message(resp.content)
            resp.close()
            raise BackendError(message, status=resp.status_code)
        return resp

    def request(self, body: dict[str, Any]) -> Any:
        resp = self._send("POST", "/generate", body)
        try:
            return resp.json()
        except ValueError as e:
            raise BackendError(f"server sent invalid JSON: {resp.text[:200]}") from e

    def request_stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        resp = self._send("POST", "/generate", body, stream=True)
        with resp:
            yield from parse_sse(resp.iter_lines(decode_unicode=False))

    def model_info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self._send("GET", "/get_model_info").json()
        return self._info

    def close(self) -> None:
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()


def error_message(body: bytes) -> str:
    """The server's explanation from an error body: `{"error": {"message"}}` (radixlm, OpenAI), FastAPI's
    `{"detail"}`, or the raw text."""
    text = body.decode("utf-8", errors="replace")
    try:
        obj = json.loads(text)
    except ValueError:
        return text.strip()[:2000] or "empty error response"
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if err is not None:
            return json.dumps(err)
    return text.strip()[:2000]


def parse_sse(lines: Any) -> Iterator[dict[str, Any]]:
    """Yield the JSON payloads of `data:` lines until `data: [DONE]`; an `{"error": ...}` payload raises."""
    for raw in lines:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        if not line.startswith("data:"):
            continue  # blank separators, comments (": ping"), event names
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            chunk = json.loads(payload)
        except ValueError as e:
            raise BackendError(f"malformed stream chunk: {payload[:200]}") from e
        if isinstance(chunk, dict) and "error" in chunk:
            raise BackendError(error_message(payload.encode()))
        yield chunk
