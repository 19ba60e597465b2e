"""Anthropic's Messages API as a front end of `conversation`: `POST /v1/messages` (plain and streamed) and
`POST /v1/messages/count_tokens`. Errors on these paths are in Anthropic's shape (`anthropic_error`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from runtime.entrypoints.api_fields import RequestOptionFields, template_vars
from runtime.entrypoints.generate_input import body_options, check_body_unicode
from runtime.entrypoints.http_common import FastJSONResponse, dumps
from runtime.entrypoints.streaming import stream_response
from runtime.entrypoints.wire.conversation import (
    Conversation,
    Message,
    Reply,
    Sampling,
    ToolCall,
    TurnStream,
    count_prompt_tokens,
    prepare,
    run,
)
from runtime.entrypoints.wire.responses import new_id
from runtime.errors import RequestError
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager
from runtime.messages import RequestOptions
from runtime.server_args import ServerArgs

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
PATH_PREFIX = "/v1/messages"
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
EFFORTS = ("low", "medium", "high", "xhigh", "max")


def anthropic_error(status: int, message: str) -> FastJSONResponse:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    headers = {"Retry-After": "1"} if status == 503 else None
    return FastJSONResponse(body, status_code=status, headers=headers)


class CountTokensRequest(BaseModel):
    """Every field of Anthropic's: what each does here is in docs/api_fields.md; a value radixlm cannot
    honour is a 400 naming the field."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # `format`: {"type": "json_schema", "schema": ...}; `effort`
    cache_control: dict[str, Any] | None = None  # automatic caching: a breakpoint at the prompt's end

    @property
    def template_vars(self) -> dict[str, Any]:
        """`output_config.effort` as the template's `reasoning_effort`; thinking disabled as
        `enable_thinking` false (the variables reasoning models' templates read)."""
        effort = (self.output_config or {}).get("effort")
        out = template_vars(effort)
        if (self.thinking or {}).get("type") == "disabled":
            out["enable_thinking"] = False
        return out


class MessagesRequest(CountTokensRequest, RequestOptionFields):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    metadata: MessagesMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None  # one speed here
    inference_geo: str | None = None  # it runs where this server runs
    user_profile_id: str | None = None  # attribution only
    workspace_id: str | None = None  # likewise
    diagnostics: dict[str, Any] | None = None  # no diagnostics block is returned
    container: str | dict[str, Any] | None = None

    @field_validator("container")
    @classmethod
    def _no_container(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("radixlm has no code-execution containers; leave container unset")
        return v


class MessagesMetadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = Field(default=None, max_length=256)


CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}  # cache_control.ttl (Anthropic's two) -> seconds pinned


class Breakpoints:
    """The `cache_control` breakpoints of a request: through which message the last one reaches, and the
    longest TTL asked (the last breakpoint's prefix holds every earlier one's)."""

    def __init__(self) -> None:
        self.through: int | None = None  # messages[:through] hold the last breakpoint
        self.ttl_s = 0.0

    def note(self, block: Any, where: str, through: int) -> None:
        """Record `block`'s cache_control (if any) as reaching through message `through`."""
        if not isinstance(block, dict) or block.get("cache_control") is None:
            return
        cc = block["cache_control"]
        if not isinstance(cc, dict) or cc.get("type") != "ephemeral" or set(cc) - {"type", "ttl"}:
            raise RequestError(
                f'\'{where}.cache_control\' must be {{"type": "ephemeral"}} with an optional ttl', 400
            )
        ttl = cc.get("ttl", "5m")
        if ttl not in CACHE_TTLS:
            raise RequestError(
                f"'{where}.cache_control.ttl' must be one of {sorted(CACHE_TTLS)}, got {ttl!r}", 400
            )
        self.ttl_s = max(self.ttl_s, CACHE_TTLS[ttl])
        self.through = max(self.through or 0, through)


def _text_blocks(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or a list of text blocks", 400)
    out = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else None
            raise RequestError(f"'{where}[{j}].type' {kind!r} is not supported here (only text blocks)", 400)
        out.append(b["text"])
    return "".join(out)


def _messages(body: CountTokensRequest, marks: Breakpoints) -> list[Message]:
    out: list[Message] = []
    if body.system is not None:
        out.append(Message("system", _text_blocks(body.system, "system")))
        if isinstance(body.system, list):
            for j, b in enumerate(body.system):
                marks.note(b, f"system[{j}]", 1)
    for j, t in enumerate(body.tools or []):  # tools render before the first message
        marks.note(t, f"tools[{j}]", 1)
    for i, m in enumerate(body.messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise RequestError(f"'messages[{i}].role' must be 'user' or 'assistant', got {role!r}", 400)
        if isinstance(content, str):
            out.append(Message(role, content))
            continue
        if not isinstance(content, list):
            raise RequestError(f"'messages[{i}].content' must be a string or a list of content blocks", 400)
        current = Message(role)
        marked = False  # a block of `current` carries a breakpoint
        for j, b in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "tool_result":
                marks.note(b, where, len(out) + 1)  # its own tool message, appended just below
            elif isinstance(b, dict) and b.get("cache_control") is not None:
                marks.note(b, where, 0)
                marked = True
            if kind == "text" and isinstance(b.get("text"), str):
                current.text += b["text"]  # after this message's tool results (a user turn of its own)
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise RequestError(f"'{where}': tool_use needs string 'id' and 'name'", 400)
                if not isinstance(b.get("input"), dict):
                    raise RequestError(f"'{where}.input' must be an object", 400)
                current.tool_calls.append(
                    ToolCall(b["id"], b["name"], json.dumps(b["input"], ensure_ascii=False))
                )
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise RequestError(f"'{where}.tool_use_id' must be a string", 400)
                text = _text_blocks(b.get("content", ""), f"{where}.content")
                if b.get("is_error") is True:
                    text = f"Error: {text}"
                out.append(Message("tool", text, call_id=b["tool_use_id"]))
            elif kind == "thinking" and role == "assistant" and isinstance(b.get("thinking"), str):
                current.reasoning = (current.reasoning or "") + b["thinking"]
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # another server's encrypted thoughts: nothing radixlm can render
            else:
                raise RequestError(f"'{where}.type' {kind!r} is not supported in a {role} message", 400)
        if current.text or current.tool_calls or not content:
            out.append(current)
        if marked:
            marks.through = max(marks.through or 0, len(out))
    if body.cache_control is not None:  # automatic caching: the whole prompt
        marks.note({"cache_control": body.cache_control}, "cache_control", len(out))
    return out


def _tools(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise RequestError(f"'tools[{i}]' must be an object", 400)
        if t.get("type", "custom") != "custom":
            raise RequestError(
                f"'tools[{i}].type' {t.get('type')!r} is not supported (only custom tools)", 400
            )
        extra = set(t) - {"type", "name", "description", "input_schema", "cache_control", "strict"}
        if extra:
            raise RequestError(f"'tools[{i}]': unknown field(s) {sorted(extra)}", 400)
        if "input_schema" not in t:
            raise RequestError(f"'tools[{i}].input_schema' is required", 400)
        fn = {"name": t.get("name"), "parameters": t["input_schema"], "strict": t.get("strict") is True}
        if "description" in t:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(Chat Completions' tool_choice, parallel_tool_calls)."""
    if raw is None:
        return None, None
    kind = raw.get("type")
    parallel = False if raw.get("disable_parallel_tool_use") is True else None
    if kind == "tool":
        if not isinstance(raw.get("name"), str):
            raise RequestError("'tool_choice.name' must be a string", 400)
        return {"type": "function", "function": {"name": raw["name"]}}, parallel
    mode = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mode is None:
        raise RequestError(f"'tool_choice.type' must be auto, any, tool or none, got {kind!r}", 400)
    return mode, parallel


def tool_error(message: str) -> str:
    return (
        message.replace("].function.parameters", "].input_schema")
        .replace("].function.", "].")
        .replace("tool_choice.function.name", "tool_choice.name")
    )


def conversation_of(body: CountTokensRequest) -> Conversation:
    if body.thinking is not None and body.thinking.get("type") not in THINKING_TYPES:
        raise RequestError(f"'thinking.type' must be one of {', '.join(THINKING_TYPES)}", 400)
    effort = (body.output_config or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise RequestError(f"'output_config.effort' must be one of {', '.join(EFFORTS)}", 400)
    choice, parallel = _tool_choice(body.tool_choice)
    marks = Breakpoints()
    conv = Conversation(
        _messages(body, marks),
        tools=_tools(body.tools),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        template_vars=body.template_vars,
        cache_breakpoint=marks.through,
        cache_ttl_s=marks.ttl_s,
    )
    extra = set(body.output_config or {}) - {"format", "effort"}
    if extra:
        raise RequestError(f"'output_config': unknown field(s) {sorted(extra)}", 400)
    fmt = (body.output_config or {}).get("format")
    if fmt is not None:
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise RequestError(
                '\'output_config.format\' must be {"type": "json_schema", "schema": {...}}', 400
            )
        conv.json_schema = fmt["schema"]
    return conv


def stop_reason(reply: Reply) -> str:
    if reply.finish == "tool_calls":
        return "tool_use"
    if reply.finish == "length":
        return "max_tokens"
    return "stop_sequence" if reply.stop_sequence is not None else "end_turn"


def call_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:  # cut off by max_tokens
        return {}
    return value if isinstance(value, dict) else {}


def usage(prompt: int, cached: int, output: int, breakpoint_prefix: int = 0) -> dict[str, Any]:
    """Anthropic's usage: read = the prompt tokens found cached; created = those of the `cache_control`
    breakpoint's prefix that were not (computed now, and pinned); input = the rest."""
    created = max(0, breakpoint_prefix - cached)
    return {
        "input_tokens": prompt - cached - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


def message_object(mid: str, model: str, reply: Reply, breakpoint_prefix: int = 0) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.text or not reply.calls:
        content.append({"type": "text", "text": reply.text})
    content += [
        {"type": "tool_use", "id": c.id, "name": c.name, "input": call_input(c.arguments)}
        for c in reply.calls
    ]
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(reply),
        "stop_sequence": reply.stop_sequence,
        "usage": usage(reply.prompt_tokens, reply.cached_tokens, reply.output_tokens, breakpoint_prefix),
    }


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **data}) + b"\n\n"


class MessagesStream(TurnStream):
    """message_start, then per block content_block_start / _delta (text_delta, input_json_delta) / _stop,
    message_delta (stop_reason, usage), message_stop."""

    def __init__(self, prepared, mid: str, model: str):
        super().__init__(prepared)
        self.mid, self.model = mid, model
        self.block = -1  # index of the open block
        self.open_kind: str | None = None

    def on_start(self, meta: dict[str, Any]) -> list[bytes]:
        msg = {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(
                meta["prompt_tokens"], meta.get("cached_tokens", 0), 0, self.prepared.cache_prefix_tokens
            ),
        }
        return [event("message_start", {"message": msg})]

    def _stop(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [event("content_block_stop", {"index": self.block})]

    def _begin(self, block: dict[str, Any]) -> list[bytes]:
        out = self._stop()
        self.block += 1
        self.open_kind = block["type"]
        return out + [event("content_block_start", {"index": self.block, "content_block": block})]

    def on_reasoning(self, delta: str) -> list[bytes]:
        block = {"type": "thinking", "thinking": "", "signature": ""}
        out = [] if self.open_kind == "thinking" else self._begin(block)
        d = {"type": "thinking_delta", "thinking": delta}
        return out + [event("content_block_delta", {"index": self.block, "delta": d})]

    def on_text(self, delta: str) -> list[bytes]:
        out = [] if self.open_kind == "text" else self._begin({"type": "text", "text": ""})
        return out + [
            event(
                "content_block_delta", {"index": self.block, "delta": {"type": "text_delta", "text": delta}}
            )
        ]

    def on_call_start(self, index: int, call_id: str, name: str) -> list[bytes]:
        return self._begin({"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def on_call_arguments(self, index: int, delta: str) -> list[bytes]:
        d = {"type": "input_json_delta", "partial_json": delta}
        return [event("content_block_delta", {"index": self.block, "delta": d})]

    def on_finish(self, reply: Reply) -> list[bytes]:
        out = self._stop()
        if not reply.text and not reply.calls:  # an empty answer is one empty text block, as the plain one
            out += self._begin({"type": "text", "text": ""}) + self._stop()
        u = usage(
            reply.prompt_tokens, reply.cached_tokens, reply.output_tokens, self.prepared.cache_prefix_tokens
        )
        delta = {"stop_reason": stop_reason(reply), "stop_sequence": reply.stop_sequence}
        return out + [event("message_delta", {"delta": delta, "usage": u}), event("message_stop", {})]


def register_messages_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs, model_options) -> None:
    """`model_options(model, options)`: the options for what `model` names (the base model or an adapter)."""

    async def guarded(coro):
        try:
            return await coro
        except RequestError as e:
            raise RequestError(tool_error(e.message), e.status) from None

    @app.post("/v1/messages")
    async def messages(request: Request, body: MessagesRequest):
        options = model_options(body.model, body_options(body, request.headers))
        check_body_unicode(body)
        conv = conversation_of(body)
        sampling = Sampling(
            body.max_tokens,
            body.temperature,
            body.top_p,
            body.top_k or -1,
            body.stop_sequences or [],
            speculative_num_draft_tokens=body.speculative_num_draft_tokens,
        )
        prepared = await guarded(prepare(conv, sampling, tm, args, body.stream, options))
        mid = new_id("msg")
        if body.stream:
            return await stream_response(tm, [prepared.req], MessagesStream(prepared, mid, args.model_name))
        reply = await run(prepared, tm, request)
        return FastJSONResponse(message_object(mid, args.model_name, reply, prepared.cache_prefix_tokens))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        model_options(body.model, RequestOptions())  # a served name, base or adapter (same template)
        check_body_unicode(body)
        return {"input_tokens": await guarded(count_prompt_tokens(conversation_of(body), tm, args))}
