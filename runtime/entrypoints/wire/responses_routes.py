"""`POST /v1/responses` (plain and streamed), `GET` / `DELETE /v1/responses/{id}`.

A stored response keeps the conversation it ended; `previous_response_id` continues it, rendered by the same
template from the same messages, so the new prompt starts with the bytes of the previous prompt + output and
the radix cache serves that prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from runtime.entrypoints.generate_input import body_options, check_body_unicode
from runtime.entrypoints.http_common import FastJSONResponse, dumps
from runtime.entrypoints.streaming import stream_response
from runtime.entrypoints.wire.conversation import Message, Reply, ToolCall, TurnStream, prepare, run
from runtime.entrypoints.wire.responses import (
    ResponseShell,
    ResponsesRequest,
    call_item,
    conversation_of,
    message_item,
    new_id,
    output_items,
    reasoning_item,
    sampling_of,
    tool_error,
)
from runtime.entrypoints.wire.store import ResponseStore
from runtime.errors import RequestError
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager
from runtime.server_args import ServerArgs
from runtime.tenants import tenant_name


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **data}) + b"\n\n"


class ResponsesStream(TurnStream):
    """The semantic events the official client reads: created, in_progress, output_item.added, then per item
    content_part.added / output_text.delta / function_call_arguments.delta and their .done events,
    output_item.done, and response.completed (the same response object a non-streamed request returns)."""

    def __init__(self, prepared, shell: ResponseShell, finished: Callable[[Reply, dict[str, Any]], None]):
        super().__init__(prepared)
        self.shell, self.finished = shell, finished
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # items, completed ones in their final form
        self.open: tuple[str, int] | None = None  # ("message" | "call", output index)

    def _ev(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        return event(kind, {"sequence_number": self.seq - 1, **data})

    def on_start(self, meta: dict[str, Any]) -> list[bytes]:
        resp = self.shell.object("in_progress", [])
        return [self._ev("response.created", response=resp), self._ev("response.in_progress", response=resp)]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        kind, i = self.open
        self.open = None
        item = self.output[i]
        item["status"] = "completed"
        out = []
        if kind in ("message", "reasoning"):
            part = item["content"][0]
            common = {"item_id": item["id"], "output_index": i, "content_index": 0}
            if kind == "message":
                out.append(self._ev("response.output_text.done", **common, text=part["text"], logprobs=[]))
            else:
                out.append(self._ev("response.reasoning_text.done", **common, text=part["text"]))
            out.append(self._ev("response.content_part.done", **common, part=part))
        else:
            common = {"item_id": item["id"], "output_index": i}
            out.append(
                self._ev("response.function_call_arguments.done", **common, arguments=item["arguments"])
            )
        return out + [self._ev("response.output_item.done", output_index=i, item=item)]

    def _open_message(self) -> list[bytes]:
        i = len(self.output)
        item = message_item(new_id("msg"), "", "in_progress")
        self.output.append(item)
        self.open = ("message", i)
        added = {**item, "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._ev("response.output_item.added", output_index=i, item=added),
            self._ev(
                "response.content_part.added", item_id=item["id"], output_index=i, content_index=0, part=part
            ),
        ]

    def on_reasoning(self, delta: str) -> list[bytes]:
        out = []
        if not (self.open and self.open[0] == "reasoning"):
            out = self._close()
            i = len(self.output)
            item = reasoning_item(new_id("rs"), "", "in_progress")
            self.output.append(item)
            self.open = ("reasoning", i)
            part = {"type": "reasoning_text", "text": ""}
            out += [
                self._ev("response.output_item.added", output_index=i, item={**item, "content": []}),
                self._ev(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    part=part,
                ),
            ]
        i = self.open[1]
        item = self.output[i]
        item["content"][0]["text"] += delta
        data = {"item_id": item["id"], "output_index": i, "content_index": 0, "delta": delta}
        return out + [self._ev("response.reasoning_text.delta", **data)]

    def on_text(self, delta: str) -> list[bytes]:
        out = [] if self.open and self.open[0] == "message" else self._close() + self._open_message()
        i = self.open[1]
        item = self.output[i]
        item["content"][0]["text"] += delta
        data = {"item_id": item["id"], "output_index": i, "content_index": 0, "delta": delta, "logprobs": []}
        return out + [self._ev("response.output_text.delta", **data)]

    def on_call_start(self, index: int, call_id: str, name: str) -> list[bytes]:
        out = self._close()
        i = len(self.output)
        item = call_item(new_id("fc"), ToolCall(call_id, name, ""), "in_progress")
        self.output.append(item)
        self.open = ("call", i)
        return out + [self._ev("response.output_item.added", output_index=i, item=dict(item))]

    def on_call_arguments(self, index: int, delta: str) -> list[bytes]:
        i = self.open[1]
        item = self.output[i]
        item["arguments"] += delta
        return [
            self._ev(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=delta
            )
        ]

    def on_finish(self, reply: Reply) -> list[bytes]:
        out = self._close()
        if not reply.text and not reply.calls:  # an empty answer is one empty message, as the non-streamed
            out += self._open_message() + self._close()
        resp = self.shell.object("completed", self.output, reply)
        self.finished(reply, resp)
        kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
        return out + [self._ev(kind, response=resp)]


def register_responses_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs, model_options) -> None:
    """`model_options(model, options)`: the options for what `model` names (the base model or an adapter)."""
    store = ResponseStore(
        args.responses_store_max_count,
        args.responses_store_max_mb * 2**20,
        args.tenant_max_stored_responses,
        args.tenant_max_stored_mb * 2**20,
    )

    def stored(rid: str, field: str) -> Any:
        item = store.get(rid, tenant_name())  # another tenant's response is not found, as a missing one
        if item is None:
            raise RequestError(
                f"'{field}': no stored response with id {rid!r}", 404 if field == "id" else 400
            )
        return item

    @app.post("/v1/responses")
    async def create_response(request: Request, body: ResponsesRequest):
        options = model_options(body.model, body_options(body, request.headers))
        check_body_unicode(body)
        history: list[Message] = []
        if body.store and (problem := store.quota_problem(tenant_name())):
            raise RequestError(problem, 429)
        if body.previous_response_id is not None:
            history = list(stored(body.previous_response_id, "previous_response_id").history)
        conv = conversation_of(body, history)
        try:
            prepared = await prepare(conv, sampling_of(body), tm, args, body.stream, options)
        except RequestError as e:
            raise RequestError(tool_error(e.message), e.status) from None
        shell = ResponseShell(body, args.model_name)
        owner = tenant_name()  # read now: a stream's last chunk may be sent outside this request's context
        lead = 1 if body.instructions is not None else 0

        def finished(reply: Reply, response: dict[str, Any]) -> None:
            if body.store:
                store.put(response, conv.messages[lead:] + [reply.message()], owner)

        if body.stream:
            return await stream_response(tm, [prepared.req], ResponsesStream(prepared, shell, finished))
        reply = await run(prepared, tm, request)
        response = shell.object("completed", output_items(reply), reply)
        finished(reply, response)
        return FastJSONResponse(response)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return FastJSONResponse(stored(response_id, "id").response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        stored(response_id, "id")
        store.delete(response_id, tenant_name())
        return {"id": response_id, "object": "response", "deleted": True}
