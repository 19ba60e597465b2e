"""The live cache dashboard (docs/dashboard.md): `GET /dashboard`, a static page shipped in the package
(`static/dashboard.{html,js,css}`, no build step, nothing fetched from elsewhere), which asks for the API key
and reads `GET /dashboard/state` and the server-sent events of `GET /dashboard/events` with it as a Bearer
header. The page and its two assets are the only routes the guard lets through without a key
(`security.PUBLIC_PATHS`): they hold no data.

The state is built in the scheduler process (`managers/scheduler/dashboard_state.py`) for one viewer: a
tenant's key sees its own tenant's prefixes, requests and misses; the admin key (or a server with no keys)
sees all. Viewers with the same view share one state per `SHARE_S`, so ten open pages cost the scheduler what
one does.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from runtime.entrypoints.security import require_admin
from runtime.errors import RequestError
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager
from runtime.server_args import ServerArgs
from runtime.tenants import tenant_name

EVENT_INTERVAL_S = 1.0  # one state per second on /dashboard/events
SHARE_S = 0.5  # a state this fresh is served again to a viewer with the same view
DEFAULT_MAX_NODES = 160
ASSETS = {  # path -> (file under static/, media type)
    "/dashboard": ("dashboard.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
# the page runs only its own script and style, and talks only to this server
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def asset_text(name: str) -> str:
    return resources.files("runtime.entrypoints").joinpath("static", name).read_text(encoding="utf-8")


def viewer(request: Request, args: ServerArgs) -> tuple[str | None, bool]:
    """(tenant, admin) of the request: admin as for the admin routes (`security.require_admin`)."""
    try:
        require_admin(request, args, "the dashboard's full view")
    except RequestError:
        return tenant_name(), False
    return tenant_name(), True


class SharedState:
    """The last state per view (tenant, admin, max_nodes), reused for SHARE_S; one call in flight per view."""

    def __init__(self, tm: TokenizerManager):
        self.tm = tm
        self.cache: dict[tuple, tuple[float, dict[str, Any]]] = {}
        self.locks: dict[tuple, asyncio.Lock] = {}

    async def get(self, tenant: str | None, admin: bool, max_nodes: int) -> dict[str, Any]:
        view = (tenant, admin, max_nodes)
        lock = self.locks.setdefault(view, asyncio.Lock())
        async with lock:
            hit = self.cache.get(view)
            if hit is not None and time.monotonic() - hit[0] < SHARE_S:
                return hit[1]
            state = await self.tm.dashboard_state(tenant, admin, max_nodes)
            if len(self.cache) > 256:  # views come and go with tenants: keep the map small
                self.cache.clear()
                self.locks = {view: lock}
            self.cache[view] = (time.monotonic(), state)
            return state


def _max_nodes(request: Request) -> int:
    raw = request.query_params.get("max_nodes")
    if raw is None:
        return DEFAULT_MAX_NODES
    if not raw.isdigit() or not 1 <= int(raw) <= 1000:
        raise RequestError("max_nodes must be an integer from 1 to 1000", 400)
    return int(raw)


def register_dashboard_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs) -> None:
    shared = SharedState(tm)
    bodies = {path: (asset_text(name), media) for path, (name, media) in ASSETS.items()}
    headers = {
        "Content-Security-Policy": CSP,
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
    }

    def asset(path: str):
        text, media = bodies[path]

        async def serve():
            return Response(text, media_type=media, headers=headers)

        return serve

    for path in ASSETS:
        app.get(path, include_in_schema=False)(asset(path))

    @app.get("/dashboard/state")
    async def dashboard_state(request: Request):
        """The dashboard's state as the caller's key may see it (docs/dashboard.md)."""
        tenant, admin = viewer(request, args)
        return await shared.get(tenant, admin, _max_nodes(request))

    @app.get("/dashboard/events", include_in_schema=False)  # endless: no fuzzer or route walk may call it
    async def dashboard_events(request: Request):
        """The same state as server-sent events, one `state` event about every second."""
        tenant, admin = viewer(request, args)
        max_nodes = _max_nodes(request)
        first = await shared.get(
            tenant, admin, max_nodes
        )  # a dead scheduler is a 503 here, not in the stream

        async def events():
            state = first
            while True:
                yield f"event: state\ndata: {json.dumps(state, separators=(',', ':'))}\n\n"
                await asyncio.sleep(EVENT_INTERVAL_S)
                # a draining server ends the stream: an open page must not hold SIGTERM's shutdown
                if tm.draining or await request.is_disconnected():
                    return
                try:
                    state = await shared.get(tenant, admin, max_nodes)
                except (RequestError, asyncio.TimeoutError) as e:
                    yield f"event: error\ndata: {json.dumps({'message': str(e)})}\n\n"
                    return

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
