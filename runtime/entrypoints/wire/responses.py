"""OpenAI's Responses API as a front end of `conversation`: the request body, its input items and tools
converted to a `Conversation`, and a `Reply` converted to the `response` object and its output items."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from runtime.entrypoints.api_fields import (
    Metadata,
    PromptCacheKey,
    PromptCacheOptions,
    ReasoningEffort,
    RequestOptionFields,
    ServiceTier,
    template_vars,
)
from runtime.entrypoints.wire.conversation import Conversation, Message, Reply, Sampling, ToolCall
from runtime.errors import RequestError

UNSUPPORTED_TOOLS = {
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "computer",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
    "namespace",
    "tool_search",
}


class TextFormat(BaseModel):
    """`text.format`, as OpenAI's ResponseFormatText / JSONObject / TextConfig spell it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    """`text`: the output's format and verbosity (accepted; the model's own length is what it is)."""

    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    """`reasoning`: `effort` is a chat template variable (`template_vars`); the thoughts come back whole as a
    reasoning item (there is no summariser, so `summary` / `generate_summary` change nothing)."""

    model_config = ConfigDict(extra="forbid")
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]


class BackgroundOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    completion_window: Literal["soonest"] | None = None  # "2h" / "8h" need background, which is off here
    continuation_id: str | None = None


def _unset_only(name: str, why: str):
    """A field radixlm cannot honour: accepted as null, else a 400 naming it and why."""

    def check(v: Any) -> Any:
        if v is not None:
            raise ValueError(f"{why}; leave {name} unset")
        return v

    return field_validator(name)(classmethod(lambda cls, v: check(v)))


def _only(name: str, allowed: tuple[Any, ...], why: str):
    """A field radixlm honours only at these values: another is a 400 naming it and why."""

    def check(v: Any) -> Any:
        if v not in allowed:
            shown = ", ".join(json.dumps(a) for a in allowed)
            raise ValueError(f"{why}; {name} may only be {shown}, got {json.dumps(v)}")
        return v

    return field_validator(name)(classmethod(lambda cls, v: check(v)))


class ResponsesRequest(RequestOptionFields):
    """The `POST /v1/responses` body. Fields a client library sends by default are accepted (and say
    nothing radixlm must act on); anything else unknown is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: Metadata | None = Field(default=None, max_length=16)
    user: str | None = None
    include: list[Includable] | None = None  # the parts asked for that radixlm has are always included
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    service_tier: ServiceTier | None = None  # one tier here: the answer says "default"
    prompt_cache_key: PromptCacheKey | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = Field(default=None, max_length=128)
    stream_options: dict[Literal["include_obfuscation"], StrictBool] | None = None  # no padding is sent
    background: StrictBool | None = None
    background_options: BackgroundOptions | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = Field(default=None, ge=1)  # bounds built-in tool calls: radixlm has none
    access_programs: dict[Literal["cyber"], Literal["standard"]] | None = None
    image: dict[Literal["context_compression"], Literal["auto", "enabled", "disabled"]] | None = None
    context_management: list[dict[str, Any]] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    _no_truncation = _only(
        "truncation",
        ("disabled", None),
        "radixlm does not drop input items: an input past the context is a 400",
    )
    _no_background = _only(
        "background", (False, None), "radixlm runs a response while its request waits: no background mode"
    )
    _no_logprobs = _only(
        "top_logprobs", (0, None), "Responses answers carry no logprobs yet: chat completions' logprobs do"
    )
    _no_compaction = _unset_only("context_management", "radixlm does not compact a conversation")
    _no_conversations = _unset_only(
        "conversation", "radixlm has no Conversations API: chain answers with previous_response_id"
    )
    _no_saved_prompts = _unset_only("prompt", "radixlm has no saved prompt templates: send the input itself")
    _no_moderation = _unset_only("moderation", "radixlm has no moderation model")
    # radixlm's extras beside RequestOptionFields' (`prompt_cache_key` is the session when none is named)
    top_k: int = -1
    seed: int | None = None

    @property
    def template_vars(self) -> dict[str, Any]:
        effort = self.reasoning.effort if self.reasoning is not None else None
        return template_vars(effort, self.text.verbosity if self.text is not None else None)


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text / output_text / text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or a list of content parts", 400)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestError(
                f"'{where}[{j}].type' {kind!r} is not supported (only input_text / output_text parts)", 400
            )
        out.append(part["text"])
    return "".join(out)


def input_messages(raw: str | list[dict[str, Any]]) -> list[Message]:
    """The `input` items as messages: consecutive assistant text and function_call items form one assistant
    turn; each function_call_output is a tool result."""
    if isinstance(raw, str):
        return [Message("user", raw)]
    out: list[Message] = []
    thoughts: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(
                    f"'{where}.role' must be user, system, developer or assistant, got {role!r}", 400
                )
            text = _text_of(item.get("content"), f"{where}.content")
            role = "system" if role == "developer" else role
            if role == "assistant" and out and out[-1].role == "assistant" and not out[-1].tool_calls:
                out[-1].text += text
            else:
                out.append(Message(role, text))
                if role == "assistant":
                    out[-1].reasoning, thoughts = thoughts, None
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) for v in (name, args, call_id)):
                raise RequestError(
                    f"'{where}': a function_call needs string name, arguments and call_id", 400
                )
            if not (out and out[-1].role == "assistant"):
                out.append(Message("assistant", reasoning=thoughts))
                thoughts = None
            out[-1].tool_calls.append(ToolCall(call_id, name, args))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise RequestError(f"'{where}.call_id' must be a string", 400)
            output = item.get("output")
            if output is not None and not isinstance(output, (str, list)):  # a tool result of any JSON type
                output = json.dumps(output, ensure_ascii=False)
            out.append(Message("tool", _text_of(output or "", f"{where}.output"), call_id=call_id))
        elif kind == "reasoning":
            parts = item.get("content") or []
            thoughts = "".join(p.get("text", "") for p in parts if isinstance(p, dict)) or None
        else:
            raise RequestError(
                f"'{where}.type' {kind!r} is not supported (message, function_call, function_call_output)",
                400,
            )
    return out


def chat_tools(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in Chat Completions' shape. `strict` defaults to true, as OpenAI's."""
    if raw is None:
        return None
    out = []
    for i, t in enumerate(raw):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            why = "is not supported by radixlm" if kind in UNSUPPORTED_TOOLS else "is unknown"
            raise RequestError(f"'tools[{i}].type' {kind!r} {why} (only function tools)", 400)
        extra = set(t) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            raise RequestError(f"'tools[{i}]': unknown field(s) {sorted(extra)}", 400)
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        fn["strict"] = t.get("strict") if t.get("strict") is not None else True
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(raw: str | dict[str, Any] | None) -> Any:
    if raw is None or isinstance(raw, str):
        return raw
    if raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise RequestError(
        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}", 400
    )


def output_schema(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None:
        raise RequestError("'text.format.schema' must be a JSON Schema object", 400)
    return fmt.json_schema


def tool_error(message: str) -> str:
    """The planner names Chat Completions' fields; say them as Responses spells them."""
    return message.replace("].function.", "].").replace("tool_choice.function.name", "tool_choice.name")


def conversation_of(body: ResponsesRequest, history: list[Message]) -> Conversation:
    """`history`: the stored conversation of `previous_response_id` (its instructions are not carried over,
    as OpenAI's); the new instructions lead, then the history, then the new input."""
    lead = [Message("system", body.instructions)] if body.instructions is not None else []
    return Conversation(
        lead + history + input_messages(body.input),
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        json_schema=output_schema(body.text),
        template_vars=body.template_vars,
    )


def sampling_of(body: ResponsesRequest) -> Sampling:
    return Sampling(
        body.max_output_tokens,
        body.temperature,
        body.top_p,
        body.top_k,
        [],
        body.seed,
        body.speculative_num_draft_tokens,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def usage(reply: Reply) -> dict[str, Any]:
    return {
        "input_tokens": reply.prompt_tokens,
        "input_tokens_details": {"cached_tokens": reply.cached_tokens},
        "output_tokens": reply.output_tokens,
        "output_tokens_details": {"reasoning_tokens": reply.reasoning_tokens},
        "total_tokens": reply.prompt_tokens + reply.output_tokens,
    }


class ResponseShell:
    """The response object's fields that do not depend on the answer (what `response.created` carries)."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.body = body
        self.model = model

    def object(self, status: str, output: list[dict[str, Any]], reply: Reply | None = None) -> dict[str, Any]:
        b = self.body
        text = b.text.model_dump(by_alias=True, exclude_none=True) if b.text else {"format": {"type": "text"}}
        incomplete = reply is not None and reply.finish == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete else status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "store": b.store,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": text,
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [],
            "truncation": "disabled",
            "metadata": b.metadata or {},
            "user": b.user,
            "usage": usage(reply) if reply is not None else None,
            **({"service_tier": "default"} if b.service_tier is not None else {}),
        }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def output_items(reply: Reply) -> list[dict[str, Any]]:
    items = [reasoning_item(new_id("rs"), reply.reasoning)] if reply.reasoning is not None else []
    items += [message_item(new_id("msg"), reply.text)] if reply.text or not reply.calls else []
    return items + [call_item(new_id("fc"), c) for c in reply.calls]
