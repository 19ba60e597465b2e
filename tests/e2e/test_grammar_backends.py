"""A real server with --grammar-backend llguidance: the schemas that broke the outlines-core path (a SQL
tool's `pattern: ^SELECT .{1,60}$`, which needed more than 2 GB to compile, and a nested calendar event
with date-time/email formats and an array, 70 s of compile) answer valid JSON quickly; lark grammars work
on the native /generate; bad specs are 400s naming the problem; server_info counts compiles per backend."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import requests

from tests.e2e.server_utils import HTTP_TIMEOUT_S, ServerProcess, server_info

SQL = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "pattern": "^SELECT .{1,60}$", "description": "a read-only SQL query"}
    },
    "required": ["query"],
    "additionalProperties": False,
}
CALENDAR = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "start": {"type": "string", "format": "date-time"},
        "end": {"type": "string", "format": "date-time"},
        "organizer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 30},
                "email": {"type": "string", "format": "email", "maxLength": 30},
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "attendees": {
            "type": "array",
            "items": {"type": "string", "format": "email", "maxLength": 30},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["title", "start", "end", "organizer", "attendees"],
    "additionalProperties": False,
}
# On the single-regex path (outlines-core) these are costly (float32, fresh server): SQL "needs more memory
# than the limit of 2048 MB", the calendar 72.6 s. Speed is bench/json_schema_coverage's and
# bench/tool_grammar's to measure; this test checks the answers and that llguidance compiled them.


@pytest.fixture(scope="module")
def srv():
    s = ServerProcess(extra_args=["--grammar-backend", "llguidance", "--max-total-tokens", "4096"]).start()
    try:
        yield s
    finally:
        code = s.stop()
    assert code == 0, f"server exited with {code}; log tail:\n{s.log_tail()}"


def _chat(url: str, prompt: str, schema: dict, max_tokens: int = 300) -> tuple[requests.Response, float]:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    start = time.monotonic()
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S * 4)
    return r, time.monotonic() - start


def test_sql_pattern_and_calendar_schemas_answer_valid_json(srv):
    for prompt, schema in (
        ("Write a SQL query that lists all users older than 30.", SQL),
        (
            "Schedule a 1-hour team sync on 2025-03-04 at 10:00 UTC organised by Ana (ana@example.com).",
            CALENDAR,
        ),
    ):
        r, seconds = _chat(srv.url, prompt, schema)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["message"]["content"])
        jsonschema.validate(value, schema)
        if schema is SQL:
            assert re.fullmatch(r"SELECT .{1,60}", value["query"]), value
        print(f"{'SQL' if schema is SQL else 'calendar'}: {seconds:.1f} s")
    grammar = server_info(srv.url)["grammar"]
    assert grammar["backend"] == "llguidance"
    assert grammar["compiled_llguidance"] == 2 and "compiled_outlines" not in grammar, grammar


def _generate(url: str, params: dict) -> requests.Response:
    body = {"text": "Call a tool:", "sampling_params": {"max_new_tokens": 60, "temperature": 0, **params}}
    return requests.post(url + "/generate", json=body, timeout=HTTP_TIMEOUT_S * 4)


def test_lark_on_native_generate_and_clear_400s(srv):
    lark = 'start: "get_weather(" %json{"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"], "additionalProperties": false} ")"'  # noqa: E501
    r = _generate(srv.url, {"lark": lark})
    assert r.status_code == 200, r.text
    m = re.fullmatch(r"get_weather\((\{.*\})\)", r.json()["text"], re.S)
    assert m and json.loads(m.group(1))["city"], r.json()["text"]
    for params, words in (
        ({"lark": 'start: "a" | ('}, "invalid lark"),
        ({"lark": lark, "regex": "a"}, "mutually exclusive"),
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"json_schema": {"type": "object", "propertyNames": {"pattern": "^a"}}}, "propertyNames"),
    ):
        r = _generate(srv.url, params)
        assert r.status_code == 400 and words in r.text, (params, r.status_code, r.text)
    assert _generate(srv.url, {"regex": "[0-9]{3}"}).status_code == 200  # still serving
