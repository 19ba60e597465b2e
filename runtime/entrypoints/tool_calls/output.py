"""Turn a choice's generated text into OpenAI's message fields: once at the end, or as stream deltas.

Both read the same `parser.split`, so the streamed deltas reassemble to the non-streamed message. Content is
the text outside calls with the outer whitespace stripped (None when there are calls and no text). Streaming:
- constrained output (a grammar guarantees that a begun call completes): the first delta of a call carries
  index, id, type and name as soon as the name is complete; argument fragments follow as they arrive;
- free output (non-strict `auto`): a call is sent when it is complete and parses (header, then its whole
  arguments), so text that only looked like a call goes out as content, never as a broken call.
A whole call arriving in one chunk still yields the header and then the arguments.
"""

from __future__ import annotations

import uuid
from typing import Any

from runtime.entrypoints.tool_calls.base import Call, Pending, ToolCallParser, partial_calls


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _content(segments: list) -> str:
    return "".join(s for s in segments if isinstance(s, str)).strip()


def _calls(parser: ToolCallParser, text: str, finished: bool, constrained: bool) -> tuple[str, list]:
    """(content, [(name, arguments)]). Constrained output read before it finished -- or cut off by
    max_tokens, which the grammar cannot prevent -- also yields the begun calls as far as they go (the
    finish_reason "length" says so, as OpenAI does); free output yields complete, parsed calls only."""
    segments = parser.split(text, final=finished and not constrained)
    calls = [(s.name, s.arguments) for s in segments if isinstance(s, Call)]
    if constrained:
        for i, s in enumerate(segments):
            if isinstance(s, Pending):
                begun = partial_calls(s.text)
                calls += begun
                if finished and not begun and not parser.begins_call(s.text):
                    segments[i] = s.text  # e.g. free text ending in "<tool_" under a gated grammar
    return _content(segments), calls


def final_message(
    parser: ToolCallParser, text: str, constrained: bool = False
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished choice."""
    content, calls = _calls(parser, text, True, constrained)
    tool_calls = [
        {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}
        for name, args in calls
    ]
    return (content or (None if calls else "")), tool_calls


class ToolStream:
    """One streamed choice: feed it the cumulative text, get the deltas to send (each a `delta` dict)."""

    def __init__(self, parser: ToolCallParser, constrained: bool) -> None:
        self.parser = parser
        self.constrained = constrained
        self.sent_content = 0
        self.sent: list[tuple[str, str]] = []  # (name, arguments sent so far) per call index
        self.has_calls = False

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        content, calls = _calls(self.parser, text, finished, self.constrained)
        deltas: list[dict[str, Any]] = []
        if not finished:  # trailing whitespace may end up stripped
            content = content[: len(content) - (len(content) - len(content.rstrip()))]
        if len(content) > self.sent_content:
            deltas.append({"content": content[self.sent_content :]})
            self.sent_content = len(content)
        for k, (name, args) in enumerate(calls):
            if k >= len(self.sent):
                self.sent.append((name, ""))
                self.has_calls = True
                deltas.append(self._call_delta(k, {"name": name, "arguments": ""}, new_call_id()))
            sent_name, sent_args = self.sent[k]
            if name == sent_name and args.startswith(sent_args) and len(args) > len(sent_args):
                deltas.append(self._call_delta(k, {"arguments": args[len(sent_args) :]}))
                self.sent[k] = (name, args)
        return deltas

    @staticmethod
    def _call_delta(index: int, function: dict[str, str], call_id: str | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"index": index}
        if call_id is not None:
            call.update(id=call_id, type="function")
        call["function"] = function
        return {"tool_calls": [call]}
