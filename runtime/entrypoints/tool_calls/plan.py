"""The HTTP layer's one entry to tool calling: from a chat request to prompt text + grammar, and from
generated text back to the message (`ToolPlan`)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from runtime.entrypoints.tool_calls.base import ToolCallParser, get_parser
from runtime.entrypoints.tool_calls.grammar import arguments_grammar, forced_lark
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

# Message keys besides role and content that reach the chat template (reasoning_content: an assistant turn's
# thoughts, for templates that render them).
_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


# The one grammar backend whose tool-call grammar is a regex (one DFA over all tools); every other backend
# (auto, llguidance, xgrammar: a lark grammar goes to llguidance) gets the Lark grammar (grammar.py).
REGEX_BACKEND = "outlines"


def uses_lark(grammar_backend: str) -> bool:
    """Whether tool calls under this --grammar-backend are a Lark grammar (llguidance installed)."""
    from constrained.backends import is_available

    return grammar_backend != REGEX_BACKEND and is_available("llguidance")


@dataclass(frozen=True)
class ToolPlan:
    prompt: str
    # Constrained output (forced or trigger-gated calls) as sampling-params grammar fields: {"lark": text}
    # or, on the outlines backend, {"regex": text}; None when output is free.
    grammar: dict[str, str] | None
    parser: ToolCallParser
    choice: ToolChoice

    @property
    def regex(self) -> str | None:
        return (self.grammar or {}).get("regex")

    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    @property
    def parses_calls(self) -> bool:
        return self.choice.mode != "none"

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed `message` of a choice."""
        if not self.parses_calls:
            return {"role": "assistant", "content": text}
        content, calls = final_message(self.parser, text, self.constrained)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return msg

    def stream(self) -> ToolStream | None:
        return ToolStream(self.parser, self.constrained) if self.parses_calls else None


async def plan_chat(
    messages: list[dict[str, Any]],
    extras: list[dict[str, Any]],
    body: Any,
    tokenizer: Any,
    parser_name: str,
    grammar_validator: Any,
    grammar_backend: str = REGEX_BACKEND,
) -> ToolPlan:
    """Validate the tool fields of `body` (a ChatCompletionRequest), render the prompt and build the grammar.

    `messages`: role + text content per message; `extras`: each message's extra fields (tool_calls, ...).
    `grammar_backend`: the server's --grammar-backend (regex grammar for outlines, else Lark).
    Raises ToolRequestError (400) naming the field.
    """
    tools = parse_tools(body.tools)
    choice = parse_tool_choice(body.tool_choice, tools)
    parser = get_parser(parser_name, tokenizer.chat_template, tokenizer)
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
    # the request's template variables (reasoning_effort, enable_thinking, verbosity): a template that does
    # not read one renders as without it
    kwargs.update(getattr(body, "template_vars", None) or {})
    try:
        # Off the event loop: rendering a long conversation takes a while.
        prompt = await asyncio.to_thread(tokenizer.apply_chat_template, rendered, **kwargs)
    except Exception as e:  # template errors are the request's fault (e.g. role order)
        raise ToolRequestError(f"cannot apply the chat template: {e}") from None
    if choice.mode == "none" or (choice.mode == "auto" and not any(t.strict for t in tools)):
        return ToolPlan(prompt, None, parser, choice)
    parallel = body.parallel_tool_calls is not False
    if uses_lark(grammar_backend):
        lark = await asyncio.to_thread(forced_lark, parser, tools, choice, parallel)
        if lark is not None:
            await _check_lark(lark, tools, choice, grammar_validator)
        return ToolPlan(prompt, None if lark is None else {"lark": lark}, parser, choice)
    for i, t in enumerate(tools):  # in the validator's child process, under its time limit
        if not {"required": True, "named": t.name == choice.name, "auto": t.strict}[choice.mode]:
            continue
        schema = enforced_parameters(t, i)
        problem = await grammar_validator.validate("json_schema", json.dumps(schema))
        if problem:
            raise ToolRequestError(f"'tools[{i}].function.parameters' cannot be enforced: {problem}")
    regex = await asyncio.to_thread(forced_regex, parser, tools, choice, parallel)
    if regex is not None:
        problem = await grammar_validator.validate("regex", regex)
        if problem:
            raise ToolRequestError(f"'tools': the tool-call grammar cannot be used: {problem}")
    return ToolPlan(prompt, None if regex is None else {"regex": regex}, parser, choice)


async def _check_lark(lark: str, tools: list, choice: ToolChoice, grammar_validator: Any) -> None:
    """The whole tool-set grammar in the validator (its child process and limits); when it fails, each
    enforced tool's arguments alone, so the 400 names the tool at fault."""
    problem = await grammar_validator.validate("lark", lark)
    if not problem:
        return
    for i, t in enumerate(tools):
        if {"required": True, "named": t.name == choice.name, "auto": t.strict}[choice.mode]:
            own = await grammar_validator.validate("lark", arguments_grammar(t, i))
            if own:
                raise ToolRequestError(f"'tools[{i}].function.parameters' cannot be enforced: {own}")
    raise ToolRequestError(f"'tools': the tool-call grammar cannot be used: {problem}")
