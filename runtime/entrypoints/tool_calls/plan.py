"""The HTTP layer's one entry to tool calling: from a chat request to prompt text + grammar, and from
generated text back to the message (`ToolPlan`)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from runtime.entrypoints.tool_calls.base import ToolCallParser, get_parser
from runtime.entrypoints.tool_calls.output import ToolStream, final_message
from runtime.entrypoints.tool_calls.prompt import render_messages, template_renders_tools
from runtime.entrypoints.tool_calls.schema import (
    ToolChoice,
    ToolRequestError,
    enforced_parameters,
    forced_regex,
    parse_tool_choice,
    parse_tools,
)

# Message keys besides role and content that reach the chat template.
_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")


@dataclass(frozen=True)
class ToolPlan:
    prompt: str
    regex: str | None  # constrained output (forced or trigger-gated calls), None when free
    parser: ToolCallParser
    choice: ToolChoice

    @property
    def parses_calls(self) -> bool:
        return self.choice.mode != "none"

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed `message` of a choice."""
        if not self.parses_calls:
            return {"role": "assistant", "content": text}
        content, calls = final_message(self.parser, text, self.regex is not None)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return msg

    def stream(self) -> ToolStream | None:
        return ToolStream(self.parser, self.regex is not None) if self.parses_calls else None


async def plan_chat(
    messages: list[dict[str, Any]],
    extras: list[dict[str, Any]],
    body: Any,
    tokenizer: Any,
    parser_name: str,
    grammar_validator: Any,
) -> ToolPlan:
    """Validate the tool fields of `body` (a ChatCompletionRequest), render the prompt and build the grammar.

    `messages`: role + text content per message; `extras`: each message's extra fields (tool_calls, ...).
    Raises ToolRequestError (400) naming the field.
    """
    tools = parse_tools(body.tools)
    choice = parse_tool_choice(body.tool_choice, tools)
    parser = get_parser(parser_name, tokenizer.chat_template)
    msgs = [
        {**m, **{k: e[k] for k in _MESSAGE_KEYS if e.get(k) is not None}}
        for m, e in zip(messages, extras, strict=True)
    ]
    native = template_renders_tools(tokenizer.chat_template)
    rendered, tool_arg = render_messages(msgs, tools, parser, native)
    cont = bool(getattr(body, "continue_final_message", False))
    if cont and rendered[-1]["role"] != "assistant":
        raise ToolRequestError("'continue_final_message' needs the last message to be the assistant's")
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": not cont}
    if cont:
        kwargs["continue_final_message"] = True
    if tool_arg:
        kwargs["tools"] = tool_arg
    try:
        # Off the event loop: rendering a long conversation takes a while.
        prompt = await asyncio.to_thread(tokenizer.apply_chat_template, rendered, **kwargs)
    except Exception as e:  # template errors are the request's fault (e.g. role order)
        raise ToolRequestError(f"cannot apply the chat template: {e}") from None
    regex = None
    if choice.mode in ("required", "named") or (choice.mode == "auto" and any(t.strict for t in tools)):
        for i, t in enumerate(tools):  # in the validator's child process, under its time limit
            enforced = {"required": True, "named": t.name == choice.name, "auto": t.strict}[choice.mode]
            if not enforced:
                continue
            schema = enforced_parameters(t, i)
            problem = await grammar_validator.validate("json_schema", json.dumps(schema))
            if problem:
                raise ToolRequestError(f"'tools[{i}].function.parameters' cannot be enforced: {problem}")
        parallel = body.parallel_tool_calls is not False
        regex = await asyncio.to_thread(forced_regex, parser, tools, choice, parallel)
        if regex is not None:
            problem = await grammar_validator.validate("regex", regex)
            if problem:
                raise ToolRequestError(f"'tools': the tool-call grammar cannot be used: {problem}")
    return ToolPlan(prompt, regex, parser, choice)
