"""LoRA adapters over HTTP: vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (admin routes
when an admin key is set), and the served names that the OpenAI routes accept as `model` and list in
`/v1/models`.

The scheduler owns the adapters (`managers/scheduler/lora_manager.py`): it reads and checks a new one, and
answers with the names it serves afterwards, which this process keeps (`ServedAdapters`). A request that
names an adapter unloaded since is the scheduler's 400.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from runtime.entrypoints.security import require_admin
from runtime.errors import RequestError
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager
from runtime.messages import LoadLoraReq, UnloadLoraReq
from runtime.server_args import ServerArgs


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

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request, body: LoadLoraAdapterRequest):
        require_admin(request, args, "/v1/load_lora_adapter")
        if body.load_inplace:
            raise RequestError("'load_inplace' is not supported: unload the adapter, then load it", 400)
        if body.lora_name in served.base_names:
            raise RequestError(f"'lora_name' {body.lora_name!r} is the base model's name", 400)
        await control(LoadLoraReq(name=body.lora_name, path=body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request, body: UnloadLoraAdapterRequest):
        require_admin(request, args, "/v1/unload_lora_adapter")
        await control(UnloadLoraReq(name=body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return served
