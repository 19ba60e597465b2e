"""The one internal conversation every chat-shaped front end converts to, and the one path it runs on.

Chat Completions, Responses and Messages differ only in how they spell a conversation and its answer. Each
front end turns its body into a `Conversation` (messages with text, tool calls and tool results; tools;
tool_choice; a JSON schema for the answer) and `Sampling`; `prepare` renders it (the one call to the tool
planner, `plan_tools`), builds the grammar and the request; the answer comes back as a `Reply` (finished) or
as `TurnStream` hooks (streamed), both read through the same tool-call parser, so streamed and finished
answers agree and a stored answer re-renders to the bytes the model produced (the radix prefix hits).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from fastapi import Request

from runtime.entrypoints.http_common import run_unless_disconnected
from runtime.entrypoints.tool_calls import ToolPlan, ToolRequestError, plan_chat
from runtime.entrypoints.tool_calls.output import new_call_id
from runtime.entrypoints.wire.reasoning import (
    ReasoningParser,
    Split,
    grammar_after_thoughts,
    history_text,
    keeps_special_tokens,
    resolve,
)
from runtime.errors import RequestError
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager
from runtime.messages import GenerateReq, RequestOptions
from runtime.sampling_params import SamplingParams, check_token_budget
from runtime.server_args import ServerArgs


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, verbatim as generated or sent


@dataclass
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    call_id: str | None = None  # a tool result: the id of the call it answers
    reasoning: str | None = None  # an assistant turn's thoughts
    reasoning_prefix: str | None = None  # the raw text the model wrote before the answer, when known

    def template_fields(self, keep_reasoning: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """(role + content, extra fields) as the chat-template renderer reads them; with `keep_reasoning`
        an assistant turn's thoughts stay in its content (the next prompt then extends this one)."""
        text = history_text(self.reasoning, self.text, self.reasoning_prefix) if keep_reasoning else self.text
        extra: dict[str, Any] = {}
        if self.tool_calls:
            extra["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.call_id is not None:
            extra["tool_call_id"] = self.call_id
        if self.reasoning is not None and not keep_reasoning:  # for templates that render thoughts
            extra["reasoning_content"] = self.reasoning
        return {"role": self.role, "content": text}, extra

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "text": self.text,
            "tool_calls": [[c.id, c.name, c.arguments] for c in self.tool_calls],
            "call_id": self.call_id,
            "reasoning": [self.reasoning, self.reasoning_prefix],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Message:
        calls = [ToolCall(*c) for c in d["tool_calls"]]
        return Message(d["role"], d["text"], calls, d["call_id"], *d["reasoning"])


@dataclass
class Conversation:
    """What to answer. `tools` and `tool_choice` are in Chat Completions' shape (the planner's input); the
    attribute names are the ones `plan_chat` reads from a request body."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    json_schema: dict[str, Any] | None = None  # the answer's JSON Schema (structured output)
    continue_final_message: bool = False
    separate_reasoning: bool = True  # False: thoughts stay in the answer (no reasoning parser)
    template_vars: dict[str, Any] = field(default_factory=dict)  # reasoning_effort, ... (plan_chat)
    # Anthropic's `cache_control`: the prompt's prefix through messages[:cache_breakpoint] stays pinned in the
    # cache for cache_ttl_s (`prepare`); None: no breakpoint
    cache_breakpoint: int | None = None
    cache_ttl_s: float = 0.0


@dataclass
class Sampling:
    max_tokens: int | None  # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    speculative_num_draft_tokens: int | None = None  # the request's own bound (0: no speculation)


@dataclass
class Reply:
    """A finished answer. `finish`: "stop", "length" or "tool_calls"; `stop_sequence`: the stop string that
    ended it, if one did."""

    text: str
    calls: list[ToolCall]
    finish: str
    stop_sequence: str | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    reasoning: str | None = None
    reasoning_prefix: str | None = None
    reasoning_tokens: int = 0  # the thoughts' text re-tokenized (tags and whitespace after them included)

    def message(self) -> Message:
        """The answer as the next turn's history renders it."""
        return Message("assistant", self.text, list(self.calls), None, self.reasoning, self.reasoning_prefix)


@dataclass
class Prepared:
    plan: ToolPlan
    req: GenerateReq
    prompt_tokens: int
    reasoning: ReasoningParser | None
    tokenizer: Any = None
    cache_prefix_tokens: int = 0  # tokens of a `cache_control` breakpoint's prefix (0: none)
    tm: TokenizerManager | None = None  # told the tools a finished answer called (`called`)

    def split(self, text: str, final: bool = True) -> Split:
        return self.reasoning.split(text, final) if self.reasoning else Split(None, text, "")

    def called(self, meta: dict[str, Any], calls: list[ToolCall]) -> None:
        """The answer (its meta_info `meta`) called `calls`: automatic retention learns which tools the
        program waits on. Before the answer goes out."""
        if self.tm is not None:
            self.tm.tool_calls_made(meta, [c.name for c in calls])

    def reasoning_tokens(self, prefix: str | None) -> int:
        if not prefix or self.tokenizer is None:
            return 0
        return len(self.tokenizer.encode(prefix, add_special_tokens=False))


def tool_request_error(e: ToolRequestError) -> RequestError:
    return RequestError(str(e), 400)


async def plan_tools(
    messages: list[dict[str, Any]],
    extras: list[dict[str, Any]],
    body: Any,
    tm: TokenizerManager,
    args: ServerArgs,
) -> ToolPlan:
    """The one call into the tool planner (prompt text, tool-call grammar, output parser) for every front
    end. `messages`: role + text content; `extras`: each message's tool_calls / tool_call_id; `body`: has
    tools, tool_choice, parallel_tool_calls, continue_final_message (a chat body or a `Conversation`).
    Raises ToolRequestError."""
    validator, backend = tm.grammar_validator, args.grammar_backend
    return await plan_chat(messages, extras, body, tm.tokenizer, args.tool_call_parser, validator, backend)


async def plan_conversation(conv: Conversation, tm: TokenizerManager, args: ServerArgs) -> ToolPlan:
    fields = [m.template_fields(args.reasoning_in_history) for m in conv.messages]
    return await plan_tools([f[0] for f in fields], [f[1] for f in fields], conv, tm, args)


NO_OPTIONS = RequestOptions()


def check_bounds(conv: Conversation, tm: TokenizerManager, stop: Sequence[str] = ()) -> None:
    """What every conversation route checks before rendering or tokenizing anything: a message at least,
    --max-prompt-chars, the stop strings' bounds, and admission (503 when overloaded or draining), so that
    counting tokens costs no more than a generation would be allowed to."""
    if not conv.messages:
        raise RequestError("the conversation is empty: give at least one message", 400)
    tm.check_prompt_chars(
        sum(len(m.text) + sum(len(c.arguments) for c in m.tool_calls) for m in conv.messages)
    )
    tm.check_stop(list(stop))
    tm.check_prompt_count(1)
    tm.check_admission(1)


async def prepare(
    conv: Conversation,
    sampling: Sampling,
    tm: TokenizerManager,
    args: ServerArgs,
    stream: bool,
    options: RequestOptions = NO_OPTIONS,
) -> Prepared:
    """Bounds and admission, then the prompt, the grammar and the request. Every bad field is a 400."""
    check_bounds(conv, tm, sampling.stop)
    try:
        plan = await plan_conversation(conv, tm, args)
    except ToolRequestError as e:
        raise tool_request_error(e) from None
    grammar: dict[str, Any] = {}
    if conv.json_schema is not None:
        grammar = {"json_schema": json.dumps(conv.json_schema)}
    if plan.grammar is not None:
        if grammar:
            raise RequestError(
                "forced tool calls (tools with tool_choice) cannot be combined with a JSON schema", 400
            )
        grammar = plan.grammar
    reasoning = (
        resolve(args.reasoning_parser, tm.tokenizer.chat_template, tm.tokenizer)
        if conv.separate_reasoning
        else None
    )
    grammar = await grammar_after_thoughts(reasoning, grammar)
    ids = (await tm.encode([plan.prompt], add_special_tokens=False))[0]
    try:
        max_tokens = sampling.max_tokens
        if max_tokens is None:
            max_tokens = check_token_budget(len(ids), None, tm.context_length)
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop=list(sampling.stop),
            seed=sampling.seed,
            speculative_num_draft_tokens=sampling.speculative_num_draft_tokens,
            skip_special_tokens=not keeps_special_tokens(plan, reasoning),
            **grammar,
        )
    except ValueError as e:
        raise RequestError(str(e), 400) from None
    prefix = await _cache_prefix_tokens(conv, ids, tm, args)
    if prefix and options.session_id is None:
        # the breakpoint's prefix is pinned as a session of its own, named by the prefix: every request
        # that repeats it renews the pin (a session's own pin is replaced, never counted twice)
        digest = hashlib.sha256(np.asarray(ids[:prefix], dtype=np.int64).tobytes()).hexdigest()[:32]
        session_id = f"cache_control:{digest}"
        options = msgspec.structs.replace(
            options, session_id=session_id, cache_ttl_s=conv.cache_ttl_s, pin_prefix_len=prefix
        )
    req = GenerateReq(rid=uuid.uuid4().hex, input_ids=ids, params=params, stream=stream, options=options)
    return Prepared(plan, req, len(ids), reasoning, tm.tokenizer, prefix, tm)


async def _cache_prefix_tokens(conv: Conversation, ids: list[int], tm: TokenizerManager, args) -> int:
    """Tokens of `ids` that the rendering of messages[:cache_breakpoint] shares: the prefix a `cache_control`
    breakpoint names (0: no breakpoint). Rendered, not guessed: a template may put anything between turns."""
    k = conv.cache_breakpoint
    if k is None:
        return 0
    head = dataclasses.replace(conv, messages=conv.messages[: max(k, 1)], json_schema=None)
    try:
        plan = await plan_conversation(head, tm, args)
    except ToolRequestError as e:
        raise tool_request_error(e) from None
    head_ids = (await tm.encode([plan.prompt], add_special_tokens=False))[0]
    n = min(len(head_ids), len(ids) - 1)  # the last prompt token is never cached (its logits are needed)
    a, b = np.asarray(head_ids[:n]), np.asarray(ids[:n])
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if differ.size else n


def _finish(meta: dict[str, Any], has_calls: bool) -> tuple[str, str | None]:
    reason = meta.get("finish_reason") or {}
    kind = "length" if reason.get("type") == "length" else "stop"
    matched = reason.get("matched")
    if kind == "stop" and has_calls:
        return "tool_calls", None
    return kind, matched if isinstance(matched, str) else None


def usage_numbers(meta: dict[str, Any]) -> tuple[int, int, int]:
    return meta["prompt_tokens"], meta["completion_tokens"], meta.get("cached_tokens", 0)


def reply_of(prepared: Prepared, result: dict[str, Any]) -> Reply:
    split = prepared.split(result["text"])
    msg = prepared.plan.message(split.answer)
    calls = [
        ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
        for c in msg.get("tool_calls", [])
    ]
    prepared.called(result["meta_info"], calls)
    finish, stop = _finish(result["meta_info"], bool(calls))
    usage = usage_numbers(result["meta_info"])
    prefix = split.prefix if split.reasoning is not None else None
    thoughts = prepared.reasoning_tokens(prefix)
    return Reply(msg.get("content") or "", calls, finish, stop, *usage, split.reasoning, prefix, thoughts)


async def count_prompt_tokens(conv: Conversation, tm: TokenizerManager, args: ServerArgs) -> int:
    """The prompt's length in tokens as `prepare` would render it (tools included)."""
    check_bounds(conv, tm)
    try:
        plan = await plan_conversation(conv, tm, args)
    except ToolRequestError as e:
        raise tool_request_error(e) from None
    return len((await tm.encode([plan.prompt], add_special_tokens=False))[0])


async def run(prepared: Prepared, tm: TokenizerManager, request: Request) -> Reply:
    """Generate the whole answer (cancelled if the client goes away)."""
    results = await run_unless_disconnected(request, tm.generate_all([prepared.req]))
    return reply_of(prepared, results[0])


class TurnStream:
    """A `StreamFormatter` for one streamed answer that speaks in semantic hooks: text deltas, a call's start
    and argument deltas, the end with the `Reply` the deltas add up to. Front ends override the hooks."""

    done_marker = False  # no trailing `data: [DONE]` (the Responses and Messages streams end with an event)

    def __init__(self, prepared: Prepared):
        self.prepared = prepared
        self.tool_stream = prepared.plan.stream()
        self.started = False
        self.reasoning: str | None = None
        self.answer_sent = 0  # characters of the answer fed on (no tool parser)
        self.text = ""
        self.calls: list[list[str]] = []  # [id, name, arguments] per call index

    # ---- hooks: each returns the events to send ----
    def on_start(self, meta: dict[str, Any]) -> list[bytes]:
        """Before the first delta; `meta`: the first output's meta_info (prompt and cached tokens)."""
        return []

    def on_reasoning(self, delta: str) -> list[bytes]:
        return []

    def on_text(self, delta: str) -> list[bytes]:
        return []

    def on_call_start(self, index: int, call_id: str, name: str) -> list[bytes]:
        return []

    def on_call_arguments(self, index: int, delta: str) -> list[bytes]:
        return []

    def on_finish(self, reply: Reply) -> list[bytes]:
        return []

    # ---- StreamFormatter ----
    def start(self, num_choices: int) -> list[bytes]:
        return []

    def update(self, index: int, out: dict[str, Any], text_delta: str, logprob_start: int) -> bytes | None:
        meta = out["meta_info"]
        events: list[bytes] = []
        if not self.started:
            self.started = True
            events += self.on_start(meta)
        finished = bool(meta["finish_reason"])
        split = self.prepared.split(out["text"], finished)
        if split.reasoning is not None and len(split.reasoning) > len(self.reasoning or ""):
            delta = split.reasoning[len(self.reasoning or "") :]
            self.reasoning = split.reasoning
            events += self.on_reasoning(delta)
        if self.tool_stream is None:
            if len(split.answer) > self.answer_sent:
                delta = split.answer[self.answer_sent :]
                self.answer_sent = len(split.answer)
                self.text += delta
                events += self.on_text(delta)
        else:
            for d in self.tool_stream.feed(split.answer, finished):
                if d.get("content"):
                    self.text += d["content"]
                    events += self.on_text(d["content"])
                for tc in d.get("tool_calls", []):
                    k, fn = tc["index"], tc["function"]
                    if "id" in tc:
                        self.calls.append([tc["id"] or new_call_id(), fn["name"], ""])
                        events += self.on_call_start(k, self.calls[k][0], fn["name"])
                    if fn.get("arguments"):
                        self.calls[k][2] += fn["arguments"]
                        events += self.on_call_arguments(k, fn["arguments"])
        if finished:
            calls = [ToolCall(*c) for c in self.calls]
            self.prepared.called(meta, calls)
            finish, stop = _finish(meta, bool(calls))
            prefix = split.prefix if split.reasoning is not None else None
            usage, thoughts = usage_numbers(meta), self.prepared.reasoning_tokens(prefix)
            reply = Reply(self.text, calls, finish, stop, *usage, split.reasoning, prefix, thoughts)
            events += self.on_finish(reply)
        return b"".join(events) or None

    def end(self, finals: list[dict[str, Any]]) -> list[bytes]:
        return []
