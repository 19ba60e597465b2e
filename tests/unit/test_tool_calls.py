"""Tool calling without a model: parsers (final and streamed), grammars, validation, prompt rendering."""

from __future__ import annotations

import json
import random

import pytest

from constrained.spec import regex_accepts
from runtime.entrypoints.tool_calls.base import Call, get_parser, text_without
from runtime.entrypoints.tool_calls.output import ToolStream, final_message
from runtime.entrypoints.tool_calls.prompt import render_messages
from runtime.entrypoints.tool_calls.schema import (
    ToolChoice,
    ToolRequestError,
    forced_regex,
    parse_tool_choice,
    parse_tools,
)
from tests.tool_fixtures import CALC, TOOLS, WEATHER


def reassemble(parser_name: str, text: str, constrained: bool, seed: int = 0) -> tuple[str, list]:
    """Stream `text` in random-sized pieces and rebuild (content, [(name, arguments)]) from the deltas."""
    rng, ts = random.Random(seed), ToolStream(get_parser(parser_name), constrained)
    content, calls, pos = "", {}, 0
    while True:
        pos = min(len(text), pos + rng.randint(1, 7))
        for d in ts.feed(text[:pos], pos == len(text)):
            content += d.get("content", "")
            for tc in d.get("tool_calls", []):
                entry = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
                if "id" in tc:
                    assert entry["name"] is None and tc["type"] == "function" and tc["function"]["name"]
                    entry["name"] = tc["function"]["name"]
                entry["arguments"] += tc["function"].get("arguments", "")
        if pos == len(text):
            return content, [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)]


HERMES_TWO = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n</tool_call>'
)


@pytest.mark.parametrize(
    "parser,text,content,calls",
    [
        (
            "hermes",
            HERMES_TWO,
            "Let me check.",
            [("get_weather", '{"city": "Paris", "days": 2}'), ("calc", '{"expr": "1+2"}')],
        ),
        (
            "qwen",
            '<tool_call>\n{"name": "calc", "arguments": {"expr": "2"}}\n</tool_call>',
            None,
            [("calc", '{"expr": "2"}')],
        ),
        ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
        (
            "hermes",
            '<tool_call>\n{"name": "calc", "arguments": {"expr": "2"}}',
            None,
            [("calc", '{"expr": "2"}')],
        ),
        ("hermes", "plain answer <tool_", "plain answer <tool_", []),
        (
            "llama3",
            '{"name": "calc", "parameters": {"expr": "3"}}; {"name": "calc", "parameters": {"expr": "4"}}',
            None,
            [("calc", '{"expr": "3"}'), ("calc", '{"expr": "4"}')],
        ),
        (
            "llama3",
            '<|python_tag|>{"name": "calc", "parameters": {"expr": "3"}}',
            None,
            [("calc", '{"expr": "3"}')],
        ),
        (
            "llama3",
            '{"name": "calc", "parameters": {"expr": "3"}} trailing',
            '{"name": "calc", "parameters": {"expr": "3"}} trailing',
            [],
        ),
        (
            "mistral",
            'Sure [TOOL_CALLS][{"name": "calc", "arguments": {"expr": "5"}}, '
            '{"name": "calc", "arguments": {"expr": "6"}}]',
            "Sure",
            [("calc", '{"expr": "5"}'), ("calc", '{"expr": "6"}')],
        ),
        ("mistral", '[{"name": "calc", "arguments": {"expr": "5"}}]', None, [("calc", '{"expr": "5"}')]),
        ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ],
)
def test_parse_final_and_streamed(parser, text, content, calls):
    got_content, got_calls = final_message(get_parser(parser), text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    for constrained in (False, True):
        if constrained and not calls:
            continue  # a grammar never lets a begun call break
        for seed in range(5):
            s_content, s_calls = reassemble(parser, text, constrained, seed)
            assert s_content == (content or "")
            assert s_calls == calls


@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("parser", ["hermes", "mistral"])
def test_whole_reply_in_one_chunk_loses_nothing(parser, constrained):
    """Jump-forward or a slow client can deliver a whole call (or all of them) in one chunk: the deltas of
    that single feed still carry each call's header (index, id, type, name) and then all of its arguments."""
    p = get_parser(parser)
    calls = [Call("get_weather", '{"city": "Paris", "days": 2}'), Call("calc", '{"expr": "1+2"}')]
    text = p.format_calls(calls)
    deltas = ToolStream(p, constrained).feed(text, True)
    got: dict[int, list] = {}
    for d in deltas:
        assert "content" not in d or not d["content"].strip()
        for tc in d.get("tool_calls", []):
            if tc["index"] not in got:
                assert tc["id"].startswith("call_") and tc["type"] == "function"
                got[tc["index"]] = [tc["function"]["name"], ""]
            got[tc["index"]][1] += tc["function"].get("arguments", "")
    assert [tuple(got[k]) for k in sorted(got)] == [(c.name, c.arguments) for c in calls]


def test_constrained_stream_sends_name_before_arguments_complete():
    ts = ToolStream(get_parser("hermes"), constrained=True)
    deltas = ts.feed('<tool_call>\n{"name": "calc", "arguments": {"expr": "1+', False)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "calc", "arguments": ""}
    assert deltas[1]["tool_calls"][0]["function"] == {"arguments": '{"expr": "1+'}


def test_constrained_output_cut_by_max_tokens_keeps_the_begun_call():
    text = (
        '<tool_call>\n{"name": "calc", "arguments": {"expr": "1"}}\n</tool_call>\n<tool_call>\n{"name": "ca'
    )
    content, calls = final_message(get_parser("hermes"), text, constrained=True)
    assert content is None and [c["function"]["name"] for c in calls] == ["calc"]
    text += 'lc", "arguments": {"ex'
    content, calls = final_message(get_parser("hermes"), text, constrained=True)
    assert [c["function"]["arguments"] for c in calls] == ['{"expr": "1"}', '{"ex']
    assert reassemble("hermes", text, True) == ("", [("calc", '{"expr": "1"}'), ("calc", '{"ex')])
    assert final_message(get_parser("hermes"), "free text <tool_", constrained=True) == (
        "free text <tool_",
        [],
    )


def test_free_stream_never_sends_a_broken_call():
    ts = ToolStream(get_parser("hermes"), constrained=False)
    assert ts.feed('<tool_call>\n{"name": "calc", "arguments": {"expr": "1+', False) == []
    out = ts.feed('<tool_call>\n{"name": "calc", "arguments": {"expr": "1+</tool_call>', True)
    assert out == [{"content": '<tool_call>\n{"name": "calc", "arguments": {"expr": "1+</tool_call>'}]
    assert not ts.has_calls


@pytest.mark.parametrize("trigger", ["<tool_call>", "[TOOL_CALLS]", "<|python_tag|>"])
def test_text_without_trigger(trigger):
    regex = text_without(trigger)
    rng = random.Random(1)
    alphabet = list(set(trigger)) + ["a", " ", "\n"]
    for _ in range(300):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        if rng.random() < 0.2:
            k = rng.randint(0, len(s))
            s = s[:k] + trigger[: rng.randint(1, len(trigger))] + s[k:]
        assert regex_accepts(regex, s) == (trigger not in s), s


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_forced_regex_accepts_exactly_the_rendered_calls(parser):
    p = get_parser(parser)
    a = Call("get_weather", '{"city": "Paris", "days": 3}')
    b = Call("calc", '{"expr": "2*3"}')
    required = forced_regex(p, TOOLS, ToolChoice("required"), parallel=True)
    assert regex_accepts(required, p.format_calls([a]))
    assert regex_accepts(required, p.format_calls([a, b]))
    assert not regex_accepts(required, p.format_calls([Call("get_weather", '{"city": "Paris", "days": 0}')]))
    assert not regex_accepts(required, p.format_calls([Call("nope", '{"expr": "2"}')]))
    single = forced_regex(p, TOOLS, ToolChoice("required"), parallel=False)
    assert not regex_accepts(single, p.format_calls([a, b]))
    named = forced_regex(p, TOOLS, ToolChoice("named", "calc"), parallel=True)
    assert regex_accepts(named, p.format_calls([b])) and not regex_accepts(named, p.format_calls([a]))
    assert forced_regex(p, TOOLS, ToolChoice("auto"), parallel=True) is None


@pytest.mark.parametrize("parser_name", ["hermes", "llama3", "mistral"])
def test_strict_auto_is_trigger_gated(parser_name):
    strict = parse_tools([{**CALC, "function": {**CALC["function"], "strict": True}}])
    p = get_parser(parser_name)
    regex = forced_regex(p, strict, ToolChoice("auto"), parallel=True)
    good, bad = Call("calc", '{"expr": "1"}'), Call("calc", '{"x": 1}')
    assert regex_accepts(regex, "Just text, no tools.")
    assert regex_accepts(regex, p.format_calls([good]))
    assert not regex_accepts(regex, p.format_calls([bad]))
    if parser_name != "llama3":  # llama3 calls are the whole reply; the others may follow text
        assert regex_accepts(regex, "Let me compute.\n" + p.format_calls([good]))
        assert not regex_accepts(regex, "Let me compute.\n" + p.format_calls([bad]))


@pytest.mark.parametrize(
    "tools,choice,needle",
    [
        ([{"type": "function", "function": {"name": "f"}}], None, "tools[0].function.parameters"),
        (
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": 3}},
                }
            ],
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "bad name", "parameters": {}}}],
            None,
            "tools[0].function.name",
        ),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([], "required", "tool_choice"),
    ],
)
def test_validation_names_the_field(tools, choice, needle):
    with pytest.raises(ToolRequestError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_tool_choice(choice, parse_tools(tools))


def test_plain_template_rendering_is_cache_stable():
    p = get_parser("hermes")
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2"}'}}
    msgs = [
        {"role": "user", "content": "2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2", "tool_call_id": "call_1"},
        {"role": "tool", "content": "3", "tool_call_id": "call_2"},
    ]
    out, tools_arg = render_messages(msgs, TOOLS, p, native=False)
    assert tools_arg is None
    assert out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert json.dumps(TOOLS[0].as_openai()) in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": p.format_calls([Call("calc", '{"expr": "2"}')])}
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\n2\n</tool_response>\n<tool_response>\n3\n</tool_response>",
    }
    assert render_messages(msgs, TOOLS, p, native=False) == (out, None)


def test_auto_detection_from_template():
    assert get_parser("auto", "{{ '<|im_start|>' }}").name == "hermes"
    assert get_parser("auto", "You are Qwen ... <tool_call>").name == "qwen"
    assert get_parser("auto", "{{ '[AVAILABLE_TOOLS]' }}").name == "mistral"
    assert get_parser("auto", "<|python_tag|>").name == "llama3"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_parser("nope")


# A Hermes/Qwen2.5-style template that renders `tools` itself.
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}\n"
    "# Tools\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n"
    "{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for tc in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_template_that_renders_tools_gets_them_and_the_parsed_history(default_tokenizer):
    """A chat template that references `tools` receives them (and assistant calls with parsed arguments)
    instead of the plain-template system block; `auto` picks the parser from the template's markers."""
    import asyncio
    import copy
    from types import SimpleNamespace

    from runtime.entrypoints.tool_calls import plan_chat

    tok = copy.deepcopy(default_tokenizer)
    tok.chat_template = NATIVE_TEMPLATE
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2"}'}}
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2?"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "2"},
    ]
    extras = [{}, {}, {"tool_calls": [call]}, {"tool_call_id": "c1"}]
    body = SimpleNamespace(
        tools=[WEATHER, CALC], tool_choice="auto", parallel_tool_calls=None, continue_final_message=False
    )
    plan = asyncio.run(plan_chat(msgs, extras, body, tok, "auto", grammar_validator=None))
    assert plan.parser.name == "hermes" and plan.regex is None  # the template's <tool_call> marker
    assert plan.prompt.startswith("<|im_start|>system\nBe brief.\n# Tools\n<tools>")
    block = plan.prompt[: plan.prompt.index("</tools>")]
    assert all(json.dumps(t.as_openai()) in block for t in TOOLS)  # rendered by the template's own loop
    assert "You may call one or more functions" not in plan.prompt  # not the plain-template block
    assert '<tool_call>\n{"name": "calc", "arguments": {"expr": "2"}}\n</tool_call>' in plan.prompt
    assert plan.prompt.endswith("<tool_response>\n2\n</tool_response><|im_end|><|im_start|>assistant\n")
    assert render_messages(msgs, TOOLS, get_parser("hermes"), native=True)[1] == [
        t.as_openai() for t in TOOLS
    ]


def test_history_calls_are_taken_verbatim_json_or_not():
    """Arguments cut by max_tokens (not JSON), a JSON value instead of its text, and none at all: each is
    rendered, never refused; a template that renders tools gets the text itself where it is not JSON (so a
    template that checks `is string` writes it verbatim), the parsed object where it is."""
    p = get_parser("hermes")
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2'}},
        {"id": "c2", "type": "function", "function": {"name": "calc", "arguments": {"expr": "3"}}},
        {"id": "c3", "type": "function", "function": {"name": "calc"}},
    ]
    msgs = [{"role": "user", "content": "2?"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    out, _ = render_messages(msgs, TOOLS, p, native=False)
    wanted = [Call("calc", '{"expr": "2'), Call("calc", '{"expr": "3"}'), Call("calc", "{}")]
    assert out[2] == {"role": "assistant", "content": p.format_calls(wanted)}
    assert '"arguments": {"expr": "2}' in out[2]["content"]  # the cut text as the model wrote it
    native, _ = render_messages(msgs, TOOLS, p, native=True)
    assert [c["function"]["arguments"] for c in native[1]["tool_calls"]] == ['{"expr": "2', {"expr": "3"}, {}]


class _InProcessValidator:
    """The HTTP-side grammar check without its child process: the same `validate_spec` call."""

    async def validate(self, kind, spec):
        from constrained.errors import GrammarError
        from constrained.spec import validate_spec

        try:
            validate_spec(kind, spec)
        except GrammarError as e:
            return str(e)
        return None


def test_request_check_judges_the_schema_the_grammar_enforces(default_tokenizer):
    """The "length and width, or base and height" idiom (oneOf branches of `required` + `not: {required}`
    beside `properties`, as in Glaive's calculate_area_1b3acb9f) is enforceable once expanded; the request
    check must judge that expanded schema, not reject the raw one (it did: one 400 in 200 real schemas)."""
    import asyncio
    from types import SimpleNamespace

    from runtime.entrypoints.tool_calls import plan_chat

    num = {"type": "number"}
    dims = {
        "type": "object",
        "properties": {"length": num, "width": num, "base": num, "height": num},
        "oneOf": [
            {"required": ["length", "width"], "not": {"required": ["base", "height"]}},
            {"required": ["base", "height"], "not": {"required": ["length", "width"]}},
        ],
    }
    params = {"type": "object", "properties": {"dimensions": dims}, "required": ["dimensions"]}
    tool = {"type": "function", "function": {"name": "area", "parameters": params}}
    body = SimpleNamespace(
        tools=[tool], tool_choice="required", parallel_tool_calls=False, continue_final_message=False
    )
    msgs, extras = [{"role": "user", "content": "area?"}], [{}]
    plan = asyncio.run(plan_chat(msgs, extras, body, default_tokenizer, "hermes", _InProcessValidator()))
    assert plan.regex is not None
    good = (
        '<tool_call>\n{"name": "area", "arguments": {"dimensions": {"length": 2, "width": 3}}}\n</tool_call>'
    )
    both = good.replace('"width": 3', '"width": 3, "base": 1, "height": 1')
    assert regex_accepts(plan.regex, good) and not regex_accepts(plan.regex, both)
