"""LoRA adapters over HTTP: vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (admin routes
when an admin key is set), and the served names that the OpenAI routes accept as `model` and list in
`/v1/models`.

The scheduler owns the adapters (`managers/scheduler/lora_manager.py`): it reads and checks a new one, and
answers with the names it serves afterwards, which this process keeps (`ServedAdapters`). A request that
names an adapter unloaded since is the scheduler's 400.

Under `--dp-size N`, sglang-router does not forward these two routes (a 404 on the public port): an admin
sends them to any replica's port, 127.0.0.1:(--dp-base-port + i). That replica does it, then passes it on
to the others (their URLs come from the front, `data_parallel.REPLICAS_ENV`) with the caller's key and
REPLICA_LOCAL_HEADER, which makes a replica act on itself only. Either every replica succeeds, or the
answer names each replica that failed and why, after the change is undone on those that made it (an
unload is undone by loading the same path again); if undoing fails too, the answer says the replicas now
differ and which.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from runtime.entrypoints.data_parallel import REPLICAS_ENV
from runtime.entrypoints.security import require_admin
from runtime.errors import RequestError
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager
from runtime.messages import LoadLoraReq, UnloadLoraReq
from runtime.server_args import ServerArgs

REPLICA_LOCAL_HEADER = "x-radixlm-replica-local"  # on a replica's hand-on: act on this replica only
PEER_TIMEOUT_S = 300.0  # a replica's load waits for its scheduler, which may be busy with a long batch
_PASSED_HEADERS = ("authorization", "x-api-key")


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body (`load_inplace` is refused: unload, then load)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; accepted and unused (names identify adapters here)


class ServedAdapters:
    """The adapters the scheduler serves, as this process last heard: name -> path."""

    def __init__(self, args: ServerArgs):
        self.enabled = args.lora_enabled
        self.model_name = args.model_name
        self.base_names = {args.model_name, args.model, "default"}
        self.paths = dict(spec.partition("=")[::2] for spec in args.lora_modules)
        self.lock = asyncio.Lock()  # one load / unload at a time, so replies arrive in order
        self.url = f"http://127.0.0.1:{args.port}"
        self.peers = sibling_replicas(args, self.url)

    def update(self, listing: list[dict[str, Any]]) -> None:
        self.paths = {a["name"]: a["path"] for a in listing}

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's `model` names (None: the base model); 404 for neither."""
        if model in self.base_names:
            return None
        if model in self.paths:
            return model
        served = ", ".join(repr(n) for n in [self.model_name, *sorted(self.paths)])
        raise RequestError(f"the model '{model}' does not exist; this server serves {served}", 404)

    def models(self, parent: str, created: int, max_model_len: int) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters (vLLM's shape: `parent` is the base model, `root` the path)."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "radixlm",
                "root": path,
                "parent": parent,
                "max_model_len": max_model_len,
            }
            for name, path in sorted(self.paths.items())
        ]


def sibling_replicas(args: ServerArgs, own_url: str, environ=os.environ) -> list[str]:
    """The other --dp-size replicas' URLs (none for a server that is not a replica)."""
    if args.dp_rank is None:
        return []
    return [u for u in environ.get(REPLICAS_ENV, "").split(",") if u and u != own_url]


def _error_of(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text.strip() or f"HTTP {r.status_code}"


async def _post_each(urls: list[str], route: str, body: dict, headers: dict) -> dict[str, tuple[int, str]]:
    """POST `body` to `route` of every URL at once; URL -> (status, error) of those that did not answer 200
    (status 502 when unreachable)."""
    async with httpx.AsyncClient(timeout=PEER_TIMEOUT_S) as client:

        async def one(url: str) -> tuple[int, str] | None:
            try:
                r = await client.post(url + route, json=body, headers=headers)
            except httpx.HTTPError as e:
                return 502, f"unreachable ({type(e).__name__}: {e})"
            return None if r.status_code == 200 else (r.status_code, _error_of(r))

        results = await asyncio.gather(*(one(u) for u in urls))
    return {u: res for u, res in zip(urls, results) if res is not None}


def register_lora_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs) -> ServedAdapters:
    served = ServedAdapters(args)
    app.state.loras = served

    async def control(msg) -> None:
        if not served.enabled:
            raise RequestError("this server serves no LoRA adapters (start it with --enable-lora)", 400)
        async with served.lock:
            resp = await tm.lora_control(msg)
            served.update(resp.adapters)
        if resp.error:
            raise RequestError(resp.error, 400)

    async def pass_on(request: Request, what: str, route: str, body: dict, undo) -> None:
        """Do on the other replicas what this one has just done (`route` with `body`); on a failure, undo it
        (`undo`: (route, body, local message)) where it was done and raise a RequestError naming each
        failed replica."""
        if not served.peers or request.headers.get(REPLICA_LOCAL_HEADER):
            return
        headers = {h: request.headers[h] for h in _PASSED_HEADERS if h in request.headers}
        headers[REPLICA_LOCAL_HEADER] = "1"
        failed = await _post_each(served.peers, route, body, headers)
        if not failed:
            return
        done = [u for u in served.peers if u not in failed]
        undo_route, undo_body, undo_msg = undo
        undo_failed = await _post_each(done, undo_route, undo_body, headers)
        try:
            await control(undo_msg)
        except RequestError as e:
            undo_failed[served.url] = (e.status, e.message)
        reasons = "; ".join(f"replica {u}: {err} (HTTP {code})" for u, (code, err) in failed.items())
        message = f"{what} failed on {len(failed)} of {len(served.peers) + 1} replicas: {reasons}. "
        if undo_failed:
            differ = "; ".join(f"replica {u}: {err}" for u, (_, err) in undo_failed.items())
            message += f"Undoing it where it succeeded failed too, so the replicas now differ: {differ}"
        else:
            undone = ", ".join([served.url, *done])
            message += f"It was undone on {undone}: every replica serves the same adapters as before"
        codes = {code for code, _ in failed.values()}
        raise RequestError(message, codes.pop() if len(codes) == 1 and codes <= {400, 403, 404} else 502)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request, body: LoadLoraAdapterRequest):
        require_admin(request, args, "/v1/load_lora_adapter")
        if body.load_inplace:
            raise RequestError("'load_inplace' is not supported: unload the adapter, then load it", 400)
        if body.lora_name in served.base_names:
            raise RequestError(f"'lora_name' {body.lora_name!r} is the base model's name", 400)
        await control(LoadLoraReq(name=body.lora_name, path=body.lora_path))
        unload = {"lora_name": body.lora_name}
        undo = ("/v1/unload_lora_adapter", unload, UnloadLoraReq(name=body.lora_name))
        load = {"lora_name": body.lora_name, "lora_path": body.lora_path}
        what = f"loading LoRA adapter {body.lora_name!r}"
        await pass_on(request, what, "/v1/load_lora_adapter", load, undo)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request, body: UnloadLoraAdapterRequest):
        require_admin(request, args, "/v1/unload_lora_adapter")
        path = served.paths.get(body.lora_name)
        await control(UnloadLoraReq(name=body.lora_name))
        load = {"lora_name": body.lora_name, "lora_path": path}
        undo = ("/v1/load_lora_adapter", load, LoadLoraReq(name=body.lora_name, path=path))
        unload = {"lora_name": body.lora_name}
        what = f"unloading LoRA adapter {body.lora_name!r}"
        await pass_on(request, what, "/v1/unload_lora_adapter", unload, undo)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return served
