"""Agent loops that never break (issue 47): each API runs a multi-turn loop with 4 tools against the default
model, at random max_tokens and temperature 0.8, replaying exactly what the server returned (calls cut by
max_tokens included) and answering every call with a tool result of some JSON type. Every request must be
a 200; every call that was finished (all calls of an answer that ended by itself, every call but the last
of one cut by max_tokens: a budget below the shortest call, 16 of [16, 28]) has arguments that validate
against its tool's schema. Strict tools: calls are enforced under tool_choice auto as under required, and
steered to close before the budget ends (`constrained.closing`).

RADIXLM_AGENT_LOOP_TURNS and RADIXLM_AGENT_LOOP_MAX_TOKENS raise the loop to the issue's 30 turns at up to
256 tokens (about 10 minutes on 2 CPUs); the default is a shorter loop of the same shape.
"""

from __future__ import annotations

import json
import os
import random

import jsonschema

TURNS = int(os.environ.get("RADIXLM_AGENT_LOOP_TURNS", "10"))
MAX_TOKENS = int(os.environ.get("RADIXLM_AGENT_LOOP_MAX_TOKENS", "96"))
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city"],
    },
    "search_web": {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        "required": ["query"],
    },
    "add_numbers": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
    "write_file": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
        "required": ["path", "text"],
    },
}
# strict: under tool_choice auto the calls are enforced too (a grammar gated by the call's start)
TOOLS = [{"type": "function", "function": {"name": n, "description": n.replace("_", " "), "parameters": s,
          "strict": True}} for n, s in SCHEMAS.items()]  # fmt: skip
RESULTS = ["done", {"ok": True, "value": 12}, [1, 2, 3], 7.5, "error: not found"]
TASK = "Plan a trip to Oslo: check the weather, search for hotels, add up costs and save a note."


def result_for(rng: random.Random):
    return rng.choice(RESULTS)


def finished_calls(calls: list, cut: bool) -> list:
    """The calls the model closed: an answer cut by max_tokens may have cut its last call."""
    return calls[:-1] if cut else calls


def check_finished_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_chat_completions_loop(oai):
    rng = random.Random(1)
    messages: list = [{"role": "user", "content": TASK}]
    calls = 0
    for _ in range(TURNS):
        out = oai.chat.completions.create(
            model="default",
            messages=messages,
            tools=TOOLS,
            tool_choice=rng.choice(["auto", "required"]),
            max_tokens=rng.randint(16, MAX_TOKENS),
            temperature=0.8,
        )
        choice = out.choices[0]
        message = choice.message.model_dump(exclude_none=True)  # replayed exactly as returned
        messages.append(message)
        for call in finished_calls(choice.message.tool_calls or [], choice.finish_reason == "length"):
            check_finished_call(call.function.name, call.function.arguments)
            calls += 1
        for call in choice.message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result_for(rng)})
        if not choice.message.tool_calls:
            messages.append({"role": "user", "content": "Go on."})
    assert calls > 0


def test_responses_loop(oai):
    rng = random.Random(2)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    items: list = [{"role": "user", "content": TASK}]
    calls = 0
    for _ in range(TURNS):
        out = oai.responses.create(
            model="default",
            input=items,
            tools=tools,
            tool_choice=rng.choice(["auto", "required"]),
            max_output_tokens=rng.randint(16, MAX_TOKENS),
            temperature=0.8,
            store=False,
        )
        fcs = [o for o in out.output if o.type == "function_call"]
        items += [o.model_dump(exclude_none=True) for o in out.output]  # replayed exactly as returned
        for fc in finished_calls(fcs, out.status == "incomplete"):
            check_finished_call(fc.name, fc.arguments)
            calls += 1
        for fc in fcs:
            items.append(
                {"type": "function_call_output", "call_id": fc.call_id, "output": json.dumps(result_for(rng))}
            )
        if not fcs:
            items.append({"role": "user", "content": "Go on."})
    assert calls > 0


def test_messages_loop(claude):
    rng = random.Random(3)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"], "strict": True} for t in TOOLS]  # fmt: skip
    messages: list = [{"role": "user", "content": TASK}]
    calls = 0
    for _ in range(TURNS):
        out = claude.messages.create(
            model="default",
            messages=messages,
            tools=tools,
            tool_choice={"type": rng.choice(["auto", "any"])},
            max_tokens=rng.randint(16, MAX_TOKENS),
            extra_body={"temperature": 0.8},
        )
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]}
        )
        uses = [b for b in out.content if b.type == "tool_use"]
        for use in finished_calls(uses, out.stop_reason == "max_tokens"):
            jsonschema.validate(use.input, SCHEMAS[use.name])
            calls += 1
        if uses:
            results = [
                {"type": "tool_result", "tool_use_id": u.id, "content": json.dumps(result_for(rng))}
                for u in uses
            ]
            messages.append({"role": "user", "content": results})
        else:
            messages.append({"role": "user", "content": "Go on."})
    assert calls > 0
