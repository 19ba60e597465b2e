"""Agent loops that never break (issue 47): each API runs a multi-turn loop with 4 tools against the default
model, at random max_tokens and temperature 0.8, replaying exactly what the server returned (calls cut by
max_tokens included) and answering every call with a tool result of some JSON type. Every request must be
a 200; every call that was finished (all calls of an answer that ended by itself, every call but the last
of one cut by max_tokens: under `auto` a call may start too late to close) has arguments that validate
against its tool's schema. Strict tools: calls are enforced under tool_choice auto as under required, and
steered to close before the budget ends (`constrained.closing`). A forced call's budget is drawn from
[shortest call, MAX_TOKENS]: below the shortest call the server answers 400 saying so, by design
(test_closing_budget.py); the loop reads that count from the server once.

The three loops run side by side: 30 turns each at max_tokens up to 256 (RADIXLM_AGENT_LOOP_TURNS and
RADIXLM_AGENT_LOOP_MAX_TOKENS shorten them for a quick look).
"""

from __future__ import annotations

import json
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.timeout(1200)

TURNS = int(os.environ.get("RADIXLM_AGENT_LOOP_TURNS", "30"))
MAX_TOKENS = int(os.environ.get("RADIXLM_AGENT_LOOP_MAX_TOKENS", "256"))
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


@pytest.fixture(scope="module")
def shortest_call(oai) -> int:
    """Tokens of the shortest forced call over TOOLS, as the server's 400 for a 1-token budget states it."""
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": TASK}],
            tools=TOOLS,
            tool_choice="required",
            max_tokens=1,
        )
    match = re.search(r"takes (\d+) tokens", str(refused.value))
    assert match, refused.value
    return int(match.group(1))


def budget(rng: random.Random, forced: bool, shortest: int) -> int:
    """max_tokens in [16, MAX_TOKENS]; a forced call's at least the shortest call."""
    return rng.randint(max(16, shortest) if forced else 16, max(MAX_TOKENS, shortest))


def result_for(rng: random.Random):
    return rng.choice(RESULTS)


def finished_calls(calls: list, cut: bool) -> list:
    """The calls the model closed: an answer cut by max_tokens may have cut its last call."""
    return calls[:-1] if cut else calls


def check_finished_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def chat_completions_loop(oai, shortest_call: int) -> int:
    rng = random.Random(1)
    messages: list = [{"role": "user", "content": TASK}]
    calls = 0
    for _ in range(TURNS):
        choice = rng.choice(["auto", "required"])
        out = oai.chat.completions.create(
            model="default",
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=budget(rng, choice == "required", shortest_call),
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
    return calls


def responses_loop(oai, shortest_call: int) -> int:
    rng = random.Random(2)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    items: list = [{"role": "user", "content": TASK}]
    calls = 0
    for _ in range(TURNS):
        choice = rng.choice(["auto", "required"])
        out = oai.responses.create(
            model="default",
            input=items,
            tools=tools,
            tool_choice=choice,
            max_output_tokens=budget(rng, choice == "required", shortest_call),
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
    return calls


def messages_loop(claude, shortest_call: int) -> int:
    rng = random.Random(3)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"], "strict": True} for t in TOOLS]  # fmt: skip
    messages: list = [{"role": "user", "content": TASK}]
    calls = 0
    for _ in range(TURNS):
        choice = rng.choice(["auto", "any"])
        out = claude.messages.create(
            model="default",
            messages=messages,
            tools=tools,
            tool_choice={"type": choice},
            max_tokens=budget(rng, choice == "any", shortest_call),
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
    return calls


def test_three_apis_loop_side_by_side(oai, claude, shortest_call):
    """The three loops run at once, as three agents sharing a server would (and batched, in a third of the
    time one after another takes); each must make finished calls."""
    with ThreadPoolExecutor(3) as pool:
        runs = {
            "chat": pool.submit(chat_completions_loop, oai, shortest_call),
            "responses": pool.submit(responses_loop, oai, shortest_call),
            "messages": pool.submit(messages_loop, claude, shortest_call),
        }
        calls = {api: run.result() for api, run in runs.items()}
    assert all(n > 0 for n in calls.values()), calls
