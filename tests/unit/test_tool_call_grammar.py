"""The tool-set Lark grammar (runtime/entrypoints/tool_calls/grammar.py), checked with llguidance's matcher
over a byte vocabulary (no model): per format it accepts the calls `format_calls` writes and nothing with a
wrong name, wrong arguments or another layout, exactly as the regex path (test_tool_calls.py) does."""

from __future__ import annotations

import copy
import json
import time

import pytest
from llguidance import LLMatcher, LLTokenizer
from llguidance._tokenizer import TokenizerWrapper

from bench.tool_grammar import ISSUE_TOOLS, tool_set
from runtime.entrypoints.tool_calls import grammar as tool_grammar
from runtime.entrypoints.tool_calls.base import Call, get_parser
from runtime.entrypoints.tool_calls.grammar import forced_lark
from runtime.entrypoints.tool_calls.schema import ToolChoice, ToolRequestError, parse_tools
from tests.tool_fixtures import CALC, TOOLS, WEATHER

PARSERS = ["hermes", "llama3", "mistral", "qwen"]


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes, plus EOS."""

    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


TOK = LLTokenizer(TokenizerWrapper(_Bytes()))


def accepts(lark: str, text: str) -> bool:
    assert LLMatcher.validate_grammar(lark, TOK) == ""
    m = LLMatcher(TOK, lark, log_level=0)
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


def one(p, name: str, args: dict) -> str:
    return p.format_calls([Call(name, json.dumps(args))])


@pytest.mark.parametrize("parser", PARSERS)
def test_lark_accepts_exactly_the_rendered_calls(parser):
    p = get_parser(parser)
    a = Call("get_weather", '{"city": "Paris", "days": 3}')
    b = Call("calc", '{"expr": "2*3"}')
    required = forced_lark(p, TOOLS, ToolChoice("required"), parallel=True)
    assert accepts(required, p.format_calls([a]))
    assert accepts(required, p.format_calls([a, b]))
    assert not accepts(required, "")
    assert not accepts(required, p.format_calls([Call("get_weather", '{"city": "Paris", "days": 0}')]))
    assert not accepts(required, p.format_calls([Call("get_weather", '{"city":"Paris", "days": 3}')]))
    assert not accepts(required, p.format_calls([Call("calc", '{"expr": "2", "x": 1}')]))  # unlisted key
    assert not accepts(required, p.format_calls([Call("nope", '{"expr": "2"}')]))
    assert not accepts(required, p.format_calls([a]) + " and more")
    single = forced_lark(p, TOOLS, ToolChoice("required"), parallel=False)
    assert accepts(single, p.format_calls([b])) and not accepts(single, p.format_calls([a, b]))
    named = forced_lark(p, TOOLS, ToolChoice("named", "calc"), parallel=True)
    assert accepts(named, p.format_calls([b])) and not accepts(named, p.format_calls([a]))
    assert not accepts(named, p.format_calls([b, b]))  # a named tool is called once
    assert forced_lark(p, TOOLS, ToolChoice("auto"), parallel=True) is None
    assert forced_lark(p, TOOLS, ToolChoice("none"), parallel=True) is None


@pytest.mark.parametrize("parser", PARSERS)
def test_strict_auto_lark_is_trigger_gated(parser):
    strict = parse_tools([{**CALC, "function": {**CALC["function"], "strict": True}}, WEATHER])
    p = get_parser(parser)
    lark = forced_lark(p, strict, ToolChoice("auto"), parallel=True)
    good, bad = Call("calc", '{"expr": "1"}'), Call("calc", '{"x": 1}')
    loose = Call("get_weather", '{"anything": [1, {"b": null}]}')  # not strict: any object
    assert accepts(lark, "Just text, no tools.") and accepts(lark, "")
    assert accepts(lark, p.format_calls([good])) and accepts(lark, p.format_calls([good, loose]))
    assert not accepts(lark, p.format_calls([bad]))
    assert not accepts(lark, p.format_calls([Call("get_weather", '{"a":1}')]))  # layout holds
    if parser == "llama3":  # calls are the whole reply: text must not look like one
        assert not accepts(lark, "{oops") and not accepts(lark, " " + p.format_calls([good]))
    else:  # text, then calls; text never holds the trigger but may end in a prefix of it
        assert accepts(lark, "Let me compute.\n" + p.format_calls([good]))
        assert not accepts(lark, "Let me compute.\n" + p.format_calls([bad]))
        assert accepts(lark, "a " + p.trigger[:-1])
        assert not accepts(lark, "a " + p.trigger + " b")


def test_the_six_ordinary_tools_of_the_issue():
    """Each shape's constraint holds inside one `required` grammar of all six tools."""
    p = get_parser("hermes")
    six = parse_tools(json.loads(ISSUE_TOOLS.read_text()))
    lark = forced_lark(p, six, ToolChoice("required"), parallel=True)
    good = {
        "get_weather": {"location": "Paris, France", "unit": "celsius"},
        "create_calendar_event": {
            "title": "Sync",
            "start": "2025-03-01T10:00:00Z",
            "end": "2025-03-01T11:00:00+01:00",
            "attendees": ["ana@example.com"],
        },
        "run_sql_query": {"query": "SELECT * FROM users"},
        "book_flight": {
            "origin": "CDG",
            "destination": "JFK",
            "date": "2025-05-02",
            "passengers": [{"name": "Ana", "age": 31}, {"name": "Bo", "age": 2}],
        },
        "set_thermostat": {"room": "kitchen", "target": "eco"},
        "search_products": {"query": "lamp", "filters": {"category": "home", "max_price": None}},
    }
    for name, args in good.items():
        assert accepts(lark, one(p, name, args)), name
    assert accepts(lark, one(p, "set_thermostat", {"room": "a", "target": 21.5}))
    assert accepts(
        lark, one(p, "search_products", {"query": "x", "filters": {"category": "c", "max_price": 9}})
    )
    bad = [
        ("get_weather", {"location": "Paris", "unit": "kelvin"}),
        ("create_calendar_event", {**good["create_calendar_event"], "start": "tomorrow"}),
        ("create_calendar_event", {**good["create_calendar_event"], "attendees": ["not an email"]}),
        ("run_sql_query", {"query": "DELETE FROM users"}),
        ("run_sql_query", {"query": "SELECT " + "x" * 61}),
        ("book_flight", {**good["book_flight"], "passengers": []}),
        ("book_flight", {**good["book_flight"], "passengers": [{"name": "Ana", "age": 130}]}),
        ("set_thermostat", {"room": "a", "target": 40}),
        ("set_thermostat", {"room": "a", "target": "hot"}),
        ("search_products", {"query": "x", "filters": {"category": "c", "max_price": "cheap"}}),
    ]
    for name, args in bad:
        assert not accepts(lark, one(p, name, args)), (name, args)


def test_grammar_text_is_deterministic_and_memoized():
    p, choice = get_parser("hermes"), ToolChoice("required")
    tools = parse_tools(tool_set(40))
    tool_grammar._memo.clear()
    first = forced_lark(p, tools, choice, True)
    again = parse_tools(copy.deepcopy(tool_set(40)))  # a new request with the same tools
    t = time.perf_counter()
    assert forced_lark(p, again, choice, True) is first  # memo hit: the same text object
    assert time.perf_counter() - t < 0.05
    tool_grammar._memo.clear()
    assert forced_lark(p, again, choice, True) == first  # rebuilt: byte-identical (grammar cache key)
    assert forced_lark(p, again[:39], choice, True) != first
    assert forced_lark(p, again, choice, False) != first
    assert forced_lark(get_parser("mistral"), again, choice, True) != first


def test_forty_tools_compile_in_llguidance():
    """The issue's 40-tool set (bench/tool_grammar.py measures the time over the real vocabulary)."""
    lark = forced_lark(get_parser("hermes"), parse_tools(tool_set(40)), ToolChoice("required"), True)
    assert LLMatcher.validate_grammar(lark, TOK) == ""
    assert not LLMatcher(TOK, lark, log_level=0).is_error()


def test_schema_rewrites_keep_the_regex_paths_meaning():
    p = get_parser("hermes")
    num = {"type": "number"}
    dims = {
        "type": "object",
        "properties": {"length": num, "width": num, "base": num, "height": num},
        "oneOf": [
            {"required": ["length", "width"], "not": {"required": ["base", "height"]}},
            {"required": ["base", "height"], "not": {"required": ["length", "width"]}},
        ],
    }
    params = {
        "type": "object",
        "properties": {"dims": dims, "id": {"type": "string", "format": "my-custom-id"}},
        "required": ["dims", "id"],
    }
    [tool] = parse_tools([{"type": "function", "function": {"name": "area", "parameters": params}}])
    lark = forced_lark(p, [tool], ToolChoice("required"), False)
    ok = {"dims": {"length": 2, "width": 3}, "id": "any text"}  # a custom format is ignored
    assert accepts(lark, one(p, "area", ok))
    assert not accepts(
        lark, one(p, "area", {**ok, "dims": {"length": 2, "width": 3, "base": 1, "height": 1}})
    )
    deps = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
        "required": ["a"],
        "dependencies": {"b": ["c"]},  # b needs c, which can never appear: b is left out
    }
    [tool] = parse_tools([{"type": "function", "function": {"name": "d", "parameters": deps}}])
    lark = forced_lark(p, [tool], ToolChoice("required"), False)
    assert accepts(lark, one(p, "d", {"a": "x"})) and not accepts(lark, one(p, "d", {"a": "x", "b": "y"}))
    deps["required"] = ["a", "b"]
    with pytest.raises(ToolRequestError, match=r"tools\[0\].function.parameters.*dependencies"):
        forced_lark(
            p,
            parse_tools([{"type": "function", "function": {"name": "d2", "parameters": deps}}]),
            ToolChoice("required"),
            False,
        )


class _InProcessValidator:
    """The HTTP-side check without its child process: the backends' own `check`."""

    def __init__(self):
        self.kinds = []

    async def validate(self, kind, spec):
        from constrained.backends import get_backend
        from constrained.errors import GrammarError
        from constrained.spec import DEFAULT_WHITESPACE

        self.kinds.append(kind)
        try:
            get_backend("llguidance" if kind == "lark" else "outlines").check(kind, spec, DEFAULT_WHITESPACE)
        except GrammarError as e:
            return str(e)
        return None


def _plan(tokenizer, tools, backend, validator=None, choice="required"):
    import asyncio
    from types import SimpleNamespace

    from runtime.entrypoints.tool_calls import plan_chat

    body = SimpleNamespace(
        tools=tools, tool_choice=choice, parallel_tool_calls=None, continue_final_message=False
    )
    msgs, extras = [{"role": "user", "content": "hi"}], [{}]
    return asyncio.run(
        plan_chat(msgs, extras, body, tokenizer, "hermes", validator or _InProcessValidator(), backend)
    )


def test_plan_uses_lark_unless_the_backend_is_outlines(default_tokenizer):
    six = json.loads(ISSUE_TOOLS.read_text())
    plan = _plan(default_tokenizer, six, "llguidance")
    assert list(plan.grammar) == ["lark"] and plan.regex is None and plan.constrained
    assert plan.grammar["lark"] == forced_lark(
        get_parser("hermes"), parse_tools(six), ToolChoice("required"), True
    )
    text = '<tool_call>\n{"name": "run_sql_query", "arguments": {"query": "SELECT 1"}}\n</tool_call>'
    assert accepts(plan.grammar["lark"], text)
    assert plan.message(text)["tool_calls"][0]["function"]["arguments"] == '{"query": "SELECT 1"}'
    assert _plan(default_tokenizer, six, "auto").grammar == plan.grammar  # any backend but outlines
    assert _plan(default_tokenizer, six, "llguidance", choice="auto").grammar is None  # no strict tool
    small = [WEATHER, CALC]
    regex_plan = _plan(default_tokenizer, small, "outlines")
    assert list(regex_plan.grammar) == ["regex"] and regex_plan.regex == regex_plan.grammar["regex"]


def test_a_tool_the_grammar_cannot_enforce_is_named(default_tokenizer):
    bad = {"type": "object", "properties": {"p": {"type": "string", "pattern": "(?=a)b"}}, "required": ["p"]}
    tools = [WEATHER, {"type": "function", "function": {"name": "lookahead", "parameters": bad}}]
    validator = _InProcessValidator()
    with pytest.raises(
        ToolRequestError, match=r"(?s)'tools\[1\]\.function\.parameters' cannot be enforced: .*look"
    ):
        _plan(default_tokenizer, tools, "llguidance", validator)
    assert validator.kinds == ["lark", "lark", "lark"]  # the set, then each tool alone until the culprit


@pytest.mark.parametrize("reasoning", ["qwen3", "deepseek-r1"])
def test_tool_grammar_after_thoughts(reasoning):
    """With a reasoning parser the forced-call Lark grammar constrains the answer after the thoughts only."""
    from runtime.entrypoints.wire.reasoning import lark_after_thoughts, resolve

    p = get_parser("hermes")
    call = p.format_calls([Call("calc", '{"expr": "2*3"}')])
    lark = lark_after_thoughts(resolve(reasoning, None), forced_lark(p, TOOLS, ToolChoice("required"), True))
    assert accepts(lark, "<think>\nany </thin text / here\n</think>\n\n" + call)
    assert not accepts(lark, "<think>\nthoughts\n</think>\n\nfree text")
    assert not accepts(lark, "<think>\nno close tag" + call)
    # qwen3 may skip the thoughts; deepseek-r1's output starts inside them (the template opened the tag)
    assert accepts(lark, call) == (reasoning == "qwen3")
    assert accepts(lark, "thoughts</think>\n" + call) == (reasoning == "deepseek-r1")
