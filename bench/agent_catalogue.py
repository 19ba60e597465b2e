"""The agent benchmark's tool catalogue (15 tools, ~1.6k prompt tokens as the hermes tool block of the default
model) and a deterministic fake implementation of each, plus the agents' seeded tasks.

The tools are hand-written in the shapes agent frameworks send (string fields with lengths, enums, bounded
integers, patterns, nested objects, arrays); string fields have a `maxLength` so that a forced call fits in a
short `max_tokens`. A fake tool answers a pure function of its name and arguments (digest-seeded values, a
real arithmetic evaluator for `calculator`), so every side of a comparison sees the same tool results for the
same calls and re-rendered histories stay byte-identical.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
from collections.abc import Callable
from typing import Any

_S = {"type": "string", "maxLength": 32}  # a short free-text field
_CITY = {"type": "string", "maxLength": 24}
_DATE = {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"}
_CURRENCY = {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY", "CHF"]}


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    params = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS: list[dict[str, Any]] = [
    _fn(
        "get_weather",
        "Current weather in a city.",
        {"city": _CITY, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city", "unit"],
    ),
    _fn(
        "get_forecast",
        "Daily forecast for a city.",
        {"city": _CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        ["city", "days"],
    ),
    _fn(
        "calculator",
        "Evaluate arithmetic, e.g. (12 + 30) * 7.",
        {"expression": {"type": "string", "maxLength": 40}},
        ["expression"],
    ),
    _fn(
        "convert_currency",
        "Convert money between currencies.",
        {
            "amount": {"type": "integer", "minimum": 0, "maximum": 1000000},
            "from_currency": _CURRENCY,
            "to_currency": _CURRENCY,
        },
        ["amount", "from_currency", "to_currency"],
    ),
    _fn(
        "search_web",
        "Search the web.",
        {"query": {**_S, "maxLength": 48}, "max_results": {"type": "integer", "minimum": 1, "maximum": 5}},
        ["query"],
    ),
    _fn(
        "lookup_encyclopedia",
        "Encyclopedia summary of a topic.",
        {"topic": _S},
        ["topic"],
    ),
    _fn(
        "get_stock_price",
        "Latest price of a stock ticker.",
        {"symbol": {"type": "string", "pattern": "^[A-Z]{1,5}$"}},
        ["symbol"],
    ),
    _fn(
        "send_email",
        "Send an email.",
        {
            "to": _S,
            "subject": _S,
            "body": {"type": "string", "maxLength": 64},
        },
        ["to", "subject", "body"],
    ),
    _fn(
        "create_calendar_event",
        "Add a calendar event.",
        {
            "title": _S,
            "date": _DATE,
            "start_time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
        },
        ["title", "date", "start_time"],
    ),
    _fn(
        "translate_text",
        "Translate a short text.",
        {
            "text": {"type": "string", "maxLength": 48},
            "target_language": {"type": "string", "enum": ["en", "fr", "de", "es", "it", "ja"]},
        },
        ["text", "target_language"],
    ),
    _fn(
        "get_local_time",
        "Local time in a city.",
        {"city": _CITY},
        ["city"],
    ),
    _fn(
        "find_restaurants",
        "Find restaurants (price 1 cheap .. 4 expensive).",
        {
            "city": _CITY,
            "cuisine": {
                "type": "string",
                "enum": ["italian", "japanese", "indian", "mexican", "french", "any"],
            },
            "max_price": {"type": "integer", "minimum": 1, "maximum": 4},
        },
        ["city", "cuisine"],
    ),
    _fn(
        "read_file",
        "Read a workspace file.",
        {"path": _S},
        ["path"],
    ),
    _fn(
        "get_news",
        "News headlines on a topic.",
        {"topic": _S, "count": {"type": "integer", "minimum": 1, "maximum": 5}},
        ["topic"],
    ),
    _fn(
        "set_reminder",
        "Set a reminder.",
        {
            "text": _S,
            "minutes_from_now": {"type": "integer", "minimum": 1, "maximum": 1440},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        ["text", "minutes_from_now"],
    ),
]
TOOL_SCHEMAS: dict[str, dict[str, Any]] = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# ------------------------------------------------------------------------------------------ fake tools
def _rng(name: str, args: dict[str, Any]) -> random.Random:
    """A generator seeded by the call itself: same call, same answer, on every side and every run."""
    key = name + json.dumps(args, sort_keys=True, ensure_ascii=False)
    return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def evaluate(expression: str) -> float:
    """+ - * / and parentheses over numbers; ValueError names anything else (no eval)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        return ev(ast.parse(expression, mode="eval"))
    except (SyntaxError, ZeroDivisionError, RecursionError) as e:
        raise ValueError(f"cannot evaluate {expression!r}: {e.__class__.__name__}") from None


def _calculator(r: random.Random, a: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"expression": a["expression"], "value": round(evaluate(a["expression"]), 6)}
    except ValueError as e:
        return {"error": str(e)}


_SKY = ["sunny", "cloudy", "light rain", "overcast", "windy", "snow"]
_FAKE: dict[str, Callable[[random.Random, dict[str, Any]], dict[str, Any]]] = {
    "get_weather": lambda r, a: {
        "city": a["city"],
        "temperature": r.randint(-5, 35),
        "unit": a.get("unit", "celsius"),
        "sky": r.choice(_SKY),
        "wind_kmh": r.randint(0, 60),
    },
    "get_forecast": lambda r, a: {
        "city": a["city"],
        "days": [{"day": d + 1, "high": r.randint(5, 35), "sky": r.choice(_SKY)} for d in range(a["days"])],
    },
    "calculator": _calculator,
    "convert_currency": lambda r, a: {
        "amount": a["amount"],
        "from": a["from_currency"],
        "to": a["to_currency"],
        "result": round(
            a["amount"] * (1.0 if a["from_currency"] == a["to_currency"] else r.uniform(0.5, 1.6)), 2
        ),
    },
    "search_web": lambda r, a: {
        "results": [
            {"title": f"{a['query']} - result {i + 1}", "url": f"https://example.org/{r.randint(100, 999)}"}
            for i in range(a.get("max_results", 3))
        ]
    },
    "lookup_encyclopedia": lambda r, a: {
        "topic": a["topic"],
        "summary": f"{a['topic']}: {r.randint(2, 40)} articles, first recorded {r.randint(1200, 1990)}.",
    },
    "get_stock_price": lambda r, a: {
        "symbol": a["symbol"],
        "price": round(r.uniform(5, 900), 2),
        "change_pct": round(r.uniform(-5, 5), 2),
    },
    "send_email": lambda r, a: {"sent": True, "to": a["to"], "message_id": f"m{r.randint(10000, 99999)}"},
    "create_calendar_event": lambda r, a: {"created": True, "event_id": f"e{r.randint(1000, 9999)}", **a},
    "translate_text": lambda r, a: {"language": a["target_language"], "translation": a["text"][::-1]},
    "get_local_time": lambda r, a: {
        "city": a["city"],
        "time": f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}",
    },
    "find_restaurants": lambda r, a: {
        "city": a["city"],
        "restaurants": [f"{a['cuisine'].title()} Place {r.randint(1, 99)}" for _ in range(2)],
    },
    "read_file": lambda r, a: {
        "path": a["path"],
        "content": f"line 1 of {a['path']}\nrows: {r.randint(1, 50)}",
    },
    "get_news": lambda r, a: {
        "headlines": [f"{a['topic']}: story {r.randint(1, 500)}" for _ in range(a.get("count", 2))]
    },
    "set_reminder": lambda r, a: {
        "reminder_id": f"r{r.randint(100, 999)}",
        "in_minutes": a["minutes_from_now"],
    },
}
assert set(_FAKE) == set(TOOL_SCHEMAS), "every tool has a fake implementation"


def run_tool(name: str, arguments: str) -> str:
    """The `tool` message content for a call: the fake tool's JSON answer, or a JSON error naming the problem
    (unknown tool, arguments that are not a JSON object or miss a required field)."""
    if name not in _FAKE:
        return json.dumps({"error": f"unknown tool {name!r}"})
    try:
        args = json.loads(arguments)
    except ValueError:
        return json.dumps({"error": "arguments are not valid JSON"})
    if not isinstance(args, dict):
        return json.dumps({"error": "arguments must be a JSON object"})
    missing = [k for k in TOOL_SCHEMAS[name].get("required", []) if k not in args]
    if missing:
        return json.dumps({"error": f"missing required arguments {missing}"})
    try:
        return json.dumps(_FAKE[name](_rng(name, args), args), ensure_ascii=False)
    except (TypeError, KeyError, ValueError) as e:  # a wrongly typed value the schema did not enforce
        return json.dumps({"error": f"bad arguments: {e.__class__.__name__}"})


# ------------------------------------------------------------------------------------------ tasks
_CITIES = ["Lisbon", "Oslo", "Kyoto", "Lima", "Nairobi", "Denver", "Porto", "Seoul", "Hanoi", "Quito"]
_TASKS = [
    "I am travelling to {city} on 2026-0{m}-1{d}. Check the weather and the forecast, find a restaurant, "
    "convert 300 USD to EUR and put the trip in my calendar.",
    "Prepare a briefing on {city}: look it up in the encyclopedia, get the latest news, the local time, and "
    "email a summary to team@example.com.",
    "Sales review for the {region} region: read reports/{region}.csv, compute the growth with the "
    "calculator, email it to boss@example.com and set a reminder to check it tomorrow.",
    "Compare stock prices of ACME and GLOBX, convert 1000 EUR to USD, and search the web for news on {city}.",
]


def tasks(num: int, seed: int) -> list[str]:
    """`num` seeded user tasks, each needing several tools."""
    rng = random.Random(seed)
    return [
        rng.choice(_TASKS).format(
            city=rng.choice(_CITIES),
            m=rng.randint(1, 9),
            d=rng.randint(0, 9),
            region=rng.choice(["north", "south", "east", "west"]),
        )
        for _ in range(num)
    ]


SYSTEM_PROMPT = (
    "You are an assistant that completes the user's task step by step with the tools provided. "
    "Call exactly one tool per step, then use its result to decide the next call."
)
