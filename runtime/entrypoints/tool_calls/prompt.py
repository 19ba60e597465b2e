"""Render a chat history with tools into the prompt text.

Templates that reference `tools` (Qwen2.5, Llama 3.1, Mistral, Hermes) get the tools and the OpenAI-shaped
history (assistant `tool_calls` with parsed arguments, `tool` messages) and render them their own way. Plain
templates (the default model's ChatML) get the parser's documented tool block appended to the system message,
assistant calls written in the parser's wire format (`format_calls`, the same text the grammar forces) and
tool results as a user turn of `<tool_response>` blocks. Rendering is deterministic, so turn k+1's prompt
starts with exactly turn k's prompt + output, and the radix cache reuses it.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.entrypoints.tool_calls.base import Call, ToolCallParser
from runtime.entrypoints.tool_calls.schema import Tool, ToolRequestError


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def tools_block(parser: ToolCallParser, tools: list[Tool]) -> str:
    return parser.instruction("\n".join(json.dumps(t.as_openai()) for t in tools))


def history_calls(message: dict[str, Any], index: int) -> list[Call]:
    """The assistant message's `tool_calls` as Calls, the arguments' text verbatim (outer whitespace aside),
    valid JSON or not: a call cut by max_tokens comes back as the client was given it, and renders as the
    model wrote it, so the next turn's prompt extends this one. Arguments sent as a JSON value rather than
    its text are written as JSON text."""
    raw = message.get("tool_calls") or []
    if not isinstance(raw, list):
        raise ToolRequestError(f"'messages[{index}].tool_calls' must be a list")
    calls = []
    for j, tc in enumerate(raw):
        where = f"messages[{index}].tool_calls[{j}]"
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolRequestError(f"'{where}.function.name' must be a string")
        args = fn.get("arguments")
        if args is None:
            args = "{}"
        elif not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(Call(fn["name"], args.strip()))
    return calls


def template_arguments(arguments: str) -> Any:
    """A call's arguments as a template that renders tools reads them: the parsed object when they are JSON
    (templates write it with `tojson`), else the text itself (a template that checks `is string` writes it
    verbatim)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def render_messages(
    messages: list[dict[str, Any]], tools: list[Tool], parser: ToolCallParser, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for apply_chat_template, its `tools` argument). `messages` have role and text content
    (plus `tool_calls` / `tool_call_id` / `name` where the client sent them)."""
    if native:
        out = []
        for i, m in enumerate(messages):
            m = dict(m)
            if m["role"] == "assistant" and m.get("tool_calls"):
                m["tool_calls"] = [
                    {
                        "type": "function",
                        "function": {"name": c.name, "arguments": template_arguments(c.arguments)},
                    }
                    for c in history_calls(m, i)
                ]
            out.append(m)
        return out, ([t.as_openai() for t in tools] or None)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        thoughts = {"reasoning_content": m["reasoning_content"]} if "reasoning_content" in m else {}
        if role == "assistant" and m.get("tool_calls"):
            calls = parser.format_calls(history_calls(m, i))
            text = f"{content}\n{calls}" if content else calls
            out.append({"role": "assistant", "content": text, **thoughts})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": role, "content": content, **thoughts})
    if tools:
        block = tools_block(parser, tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out], None
