"""What every HTTP request passes before a handler runs, and where the API keys come from.

A web page the operator visits can send requests to the server: cross-site "simple" POSTs (text/plain,
form bodies, or no body; no preflight, so no CORS check) and, after DNS rebinding, anything at all under its
own host name. Hence: the Host header must name this server (`--allowed-hosts`), and a request with a body
must say it is JSON (a browser cannot send `application/json` cross-site without a preflight we never
grant). A body-less POST without a content type is accepted only without an `Origin` header: browsers send
Origin on every POST, while sglang-router's /flush_cache fan-out and `curl -X POST` send neither.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
from collections.abc import MutableMapping

from fastapi import Request

from runtime.entrypoints.http_common import error_response
from runtime.errors import RequestError
from runtime.server_args import ServerArgs
from runtime.tenants import Tenant, current_tenant, key_digest, load_keys_file

API_KEY_ENV = "RADIXLM_API_KEY"
ADMIN_API_KEY_ENV = "RADIXLM_ADMIN_API_KEY"
# (ServerArgs field, environment variable): the keys are read from --X, --X-file or the variable.
KEY_SOURCES = (("api_key", API_KEY_ENV), ("admin_api_key", ADMIN_API_KEY_ENV))
WILDCARD_BINDS = ("", "0.0.0.0", "::")
_SAFE_METHODS = (b"GET", b"HEAD", b"OPTIONS")
# served without a key: they hold no data (the dashboard page asks for the key, `entrypoints/dashboard.py`)
PUBLIC_PATHS = frozenset({"/health", "/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"})


def load_keys(args: ServerArgs, environ: MutableMapping[str, str] | None = None) -> ServerArgs:
    """`args` with each key taken from its file or environment variable when not given as an option.

    The variables are removed from `environ` (default: os.environ) so that child processes do not inherit
    them; ValueError names an unreadable or empty file, or a key given twice."""
    environ = os.environ if environ is None else environ
    found = {}
    for name, env in KEY_SOURCES:
        value, path = getattr(args, name), getattr(args, name + "_file")
        from_env = environ.pop(env, None)
        flag = "--" + name.replace("_", "-")
        if path is not None:
            if value is not None:
                raise ValueError(f"give {flag} or {flag}-file, not both")
            try:
                with open(path) as f:
                    value = f.read().strip()
            except OSError as e:
                raise ValueError(f"{flag}-file {path!r} cannot be read: {e.strerror}") from None
            if not value:
                raise ValueError(f"{flag}-file {path!r} is empty")
        elif value is None and from_env:
            value = from_env.strip()
        found[name] = value
    if args.api_keys_file is not None:
        load_keys_file(args.api_keys_file)  # a KeysFileError (ValueError) naming the problem, at start-up
    return dataclasses.replace(args, **found)


def normalize_host(value: str) -> str:
    """A Host header or --allowed-hosts entry as a lower-case name without port, brackets or final dot."""
    v = value.strip().lower()
    if v.startswith("["):  # [v6 address] or [v6 address]:port
        v = v[1:].partition("]")[0]
    elif v.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        v = v.partition(":")[0]
    return v.rstrip(".")


def allowed_hosts(args: ServerArgs) -> frozenset[str] | None:
    """The Host names this server answers to; None means any."""
    if args.allowed_hosts is not None:
        names = frozenset(normalize_host(h) for h in args.allowed_hosts.split(","))
        return None if "*" in names else names
    if args.host in WILDCARD_BINDS:  # reachable by every address of the machine: we cannot know them all
        return None
    return frozenset({normalize_host(args.host), "localhost", "127.0.0.1", "::1"})


def is_json_media_type(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _bearer_matches(authorization: bytes, key: str | None) -> bool:
    return key is not None and hmac.compare_digest(authorization, f"Bearer {key}".encode())


def _key_matches(authorization: bytes, x_api_key: bytes, key: str | None) -> bool:
    """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's) carries `key`. Both
    compared in constant time, both always (no short cut on which header is present)."""
    if key is None:
        return False
    return _bearer_matches(authorization, key) | hmac.compare_digest(x_api_key, key.encode())


def require_admin(request: Request, args: ServerArgs, what: str) -> None:
    """403 unless the request carries the admin key or an admin tenant's key (anyone may when neither
    --admin-api-key nor --api-keys-file is set)."""
    tenant = current_tenant.get()
    if tenant is not None and tenant.admin:
        return
    if args.admin_api_key is None and args.api_keys_file is None:
        return
    authorization = request.headers.get("authorization", "").encode("latin-1")
    x_api_key = request.headers.get("x-api-key", "").encode("latin-1")
    if not _key_matches(authorization, x_api_key, args.admin_api_key):
        raise RequestError(
            f"{what} is an admin operation: it needs 'Authorization: Bearer ADMIN_KEY' or "
            "'x-api-key: ADMIN_KEY' (--admin-api-key, or a key marked admin in --api-keys-file); the normal "
            "API key does not grant it",
            403,
        )


def presented_key(authorization: bytes, x_api_key: bytes) -> bytes:
    """The key a request carries: `Authorization: Bearer KEY`, else `x-api-key: KEY`."""
    scheme, _, token = authorization.partition(b" ")
    if scheme.lower() == b"bearer" and token:
        return token.strip()
    return x_api_key


class Guard:
    """Pure ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from the handlers):
    Host header, API key, JSON content type, body size limit, in that order. A key from --api-keys-file
    makes its tenant `current_tenant` for the handler."""

    def __init__(self, app, args: ServerArgs):
        self.app, self.args = app, args
        self.hosts = allowed_hosts(args)
        self.tenant_keys = load_keys_file(args.api_keys_file) if args.api_keys_file else {}
        self.needs_key = bool(args.api_key or self.tenant_keys)

    def _tenant(self, headers: dict[bytes, bytes]) -> tuple[bool, Tenant | None]:
        """(the request carries a valid key, the tenant of that key: None for --api-key / --admin-api-key)."""
        authorization, x_api_key = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
        if self.tenant_keys:
            tenant = self.tenant_keys.get(key_digest(presented_key(authorization, x_api_key)))
            if tenant is not None:
                return True, tenant
        args = self.args
        # The admin key grants everything the normal key does.
        valid = _key_matches(authorization, x_api_key, args.api_key) | _key_matches(
            authorization, x_api_key, args.admin_api_key
        )
        return valid, None

    def _refusal(self, scope, headers: dict[bytes, bytes], valid_key: bool) -> tuple[int, str] | None:
        if self.hosts is not None:
            host = headers.get(b"host")
            if host is None:
                return 400, "missing Host header"
            name = normalize_host(host.decode("latin-1"))
            if name not in self.hosts:
                return 421, (
                    f"Host {name!r} is not served here (DNS-rebinding protection); the operator can allow it "
                    "with --allowed-hosts"
                )
        if self.needs_key and not valid_key and scope["path"] not in PUBLIC_PATHS:
            return 401, "missing or invalid API key (use 'Authorization: Bearer KEY' or 'x-api-key: KEY')"
        if scope["method"].encode() not in _SAFE_METHODS:
            content_type = headers.get(b"content-type")
            if content_type is None:
                length = headers.get(b"content-length", b"0")
                bodyless = length == b"0" and b"transfer-encoding" not in headers
                if not bodyless or b"origin" in headers:
                    return 415, f"{scope['method']} needs 'Content-Type: application/json' (none was given)"
            elif not is_json_media_type(content_type):
                shown = content_type.decode("latin-1")[:100]
                return 415, f"{scope['method']} needs 'Content-Type: application/json', not {shown!r}"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope["headers"]}
        valid_key, tenant = self._tenant(headers) if self.needs_key else (True, None)
        refusal = self._refusal(scope, headers, valid_key)
        if refusal is not None:
            return await error_response(*refusal)(scope, receive, send)
        token = current_tenant.set(tenant)
        try:
            return await self._guarded(scope, receive, send, headers)
        finally:
            current_tenant.reset(token)

    async def _guarded(self, scope, receive, send, headers: dict[bytes, bytes]):
        args = self.args
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
