"""A tool call or a JSON answer is never cut by max_tokens when the budget can hold one (issue 47, item 3):
near the end of its budget a constrained request is steered to close its grammar (`constrained.closing`),
on chat completions, Responses and Messages alike, through the official clients. The tiny model would
otherwise write a long note until the budget ends. A budget below the shortest valid output is a 400."""

from __future__ import annotations

import json

import jsonschema
import pytest

PARAMS = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
TOOL = {
    "type": "function",
    "function": {"name": "write_note", "description": "Save a note.", "parameters": PARAMS},
}
ASK = [{"role": "user", "content": "Write a very long note about the history of Rome."}]
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "years": {"type": "array", "items": {"type": "integer"}}},
    "required": ["title", "years"],
}
SHORTEST_CALL = 29  # tokens of the shortest whole call: `<tool_call>\n{"name": "write_note", ...}` + EOS
BUDGETS = [SHORTEST_CALL, SHORTEST_CALL + 3, 40, 64]


@pytest.mark.parametrize("budget", BUDGETS)
def test_chat_tool_call_closes_inside_the_budget(oai, budget):
    out = oai.chat.completions.create(
        model="default",
        messages=ASK,
        tools=[TOOL],
        tool_choice="required",
        max_tokens=budget,
        temperature=0.8,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and out.usage.completion_tokens <= budget, choice
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS)


@pytest.mark.parametrize("budget", BUDGETS)
def test_responses_and_messages_tool_calls_close_inside_the_budget(oai, claude, budget):
    tool = {"type": "function", "name": "write_note", "parameters": PARAMS}
    out = oai.responses.create(
        model="default",
        input=ASK,
        tools=[tool],
        tool_choice="required",
        max_output_tokens=budget,
        temperature=0.8,
    )
    calls = [o for o in out.output if o.type == "function_call"]
    assert out.status == "completed" and calls, out
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), PARAMS)
    tool = {"name": "write_note", "description": "Save a note.", "input_schema": PARAMS}
    msg = claude.messages.create(
        model="default",
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "any"},
        max_tokens=budget,
        extra_body={"temperature": 0.8},
    )
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and uses, msg
    for use in uses:
        jsonschema.validate(use.input, PARAMS)


@pytest.mark.parametrize("budget", [16, 20, 32])
def test_json_schema_answer_closes_inside_the_budget(oai, budget):
    out = oai.chat.completions.create(
        model="default",
        messages=ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA}},
        max_tokens=budget,
        temperature=0.8,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and out.usage.completion_tokens <= budget, choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def _refusal(call) -> str:
    with pytest.raises(Exception) as caught:
        call()
    assert getattr(caught.value, "status_code", None) == 400, caught.value
    return str(caught.value)


def test_a_budget_no_call_fits_is_a_400_naming_the_shortest_call(oai, claude):
    """Below the shortest call no output could be valid: every API answers 400 with the count it needs, and
    a budget of exactly that count still gets a whole call (the parametrized tests above)."""
    small = SHORTEST_CALL - 5
    chat = _refusal(
        lambda: oai.chat.completions.create(
            model="default", messages=ASK, tools=[TOOL], tool_choice="required", max_tokens=small
        )
    )
    assert f"takes {SHORTEST_CALL} tokens" in chat and f"budget of {small}" in chat, chat
    responses = _refusal(
        lambda: oai.responses.create(
            model="default",
            input=ASK,
            tools=[{"type": "function", "name": "write_note", "parameters": PARAMS}],
            tool_choice="required",
            max_output_tokens=small,
        )
    )
    assert f"takes {SHORTEST_CALL} tokens" in responses, responses
    messages = _refusal(
        lambda: claude.messages.create(
            model="default",
            messages=ASK,
            tools=[{"name": "write_note", "input_schema": PARAMS}],
            tool_choice={"type": "any"},
            max_tokens=small,
        )
    )
    assert f"takes {SHORTEST_CALL} tokens" in messages, messages
    # a grammar that may end at once (free text before an optional call) needs no more than one token
    out = oai.chat.completions.create(model="default", messages=ASK, tools=[TOOL], max_tokens=2)
    assert out.choices[0].finish_reason == "length"
