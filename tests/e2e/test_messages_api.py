"""Anthropic's Messages API through the official `anthropic` client against the shared server (issue 26).

The installed client no longer takes `temperature` as an argument; it goes in `extra_body` (the server still
reads it, as older clients and other tools send it).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

CALC = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression such as 12 * 7.",
    "input_schema": {
        "type": "object",
        "properties": {"expression": {"type": "string", "maxLength": 24}},
        "required": ["expression"],
    },
}
QUESTION = [{"role": "user", "content": "What is 12 times 7?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server_url: str) -> anthropic.Anthropic:
    c = anthropic.Anthropic(base_url=server_url, api_key="unused", timeout=300, max_retries=0)
    yield c
    c.close()


def ask(client, **kw):
    args = {"model": "default", "messages": QUESTION, "max_tokens": 40, "extra_body": GREEDY}
    return client.messages.create(**{**args, **kw})


def test_text_answer(client):
    m = ask(client, system="Be brief.", messages=[{"role": "user", "content": "Say hello."}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 0 and m.usage.output_tokens > 0


def test_max_tokens_and_stop_sequences(client):
    m = ask(client, max_tokens=2)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    m = ask(client, stop_sequences=[" "], max_tokens=30)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " "


def test_tool_use_any(client):
    m = ask(client, tools=[CALC], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["tool_use"]
    jsonschema.validate(m.content[0].input, CALC["input_schema"])


def test_tool_result_round_trip_hits_the_cache(client):
    first = ask(client, tools=[CALC], tool_choice={"type": "tool", "name": "calculator"})
    use = first.content[-1]
    assert use.type == "tool_use" and use.name == "calculator"
    history = [
        *QUESTION,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "84"}]},
    ]
    second = ask(client, tools=[CALC], messages=history, tool_choice={"type": "none"})
    assert [b.type for b in second.content] == ["text"]
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= 0.9 * prompt


@pytest.mark.parametrize(
    "kw",
    [
        {"tools": [CALC], "tool_choice": {"type": "tool", "name": "calculator"}},
        {"tools": [CALC], "tool_choice": {"type": "auto"}, "max_tokens": 60},
        {"messages": [{"role": "user", "content": "Say hello."}]},
    ],
)
def test_stream_matches_the_plain_answer(client, kw):
    plain = ask(client, **kw)
    args = {"model": "default", "messages": QUESTION, "max_tokens": 40, "extra_body": GREEDY, **kw}
    with client.messages.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [
        b.model_dump(exclude={"id"}) for b in plain.content
    ]
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


def test_streamed_input_json_deltas_reassemble(client, server_url):
    body = {"model": "default", "messages": QUESTION, "max_tokens": 40, "temperature": 0, "stream": True}
    body |= {"tools": [CALC], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    blocks: dict[int, list] = {}
    kinds = []
    with httpx.stream("POST", f"{server_url}/v1/messages", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[7:])
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == kinds[-1]
                if ev["type"] == "content_block_start":
                    blocks[ev["index"]] = [ev["content_block"], ""]
                elif ev["type"] == "content_block_delta":
                    assert ev["delta"]["type"] == "input_json_delta"
                    blocks[ev["index"]][1] += ev["delta"]["partial_json"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert list(blocks) == [0] and blocks[0][0]["type"] == "tool_use" and blocks[0][0]["name"] == "calculator"
    jsonschema.validate(json.loads(blocks[0][1]), CALC["input_schema"])


def test_count_tokens_matches_usage(client):
    counted = client.messages.count_tokens(model="default", messages=QUESTION, tools=[CALC])
    m = ask(client, tools=[CALC], tool_choice={"type": "any"})
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_structured_output(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    m = ask(
        client, extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    )
    jsonschema.validate(json.loads(m.content[0].text), schema)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"tools": [{**CALC, "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [CALC], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tools": [CALC], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ],
)
def test_errors_in_anthropic_shape(client, kw, field):
    with pytest.raises(anthropic.BadRequestError) as info:
        ask(client, **kw)
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"]
    assert ask(client, max_tokens=2).content  # still serving


def test_validation_and_not_found_errors_in_anthropic_shape(client, server_url):
    r = httpx.post(f"{server_url}/v1/messages", json={"model": "default", "messages": QUESTION}, timeout=60)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        ask(client, model="no-such-model")
    assert info.value.body["error"]["type"] == "not_found_error"


def test_count_tokens_and_messages_check_bounds_and_unicode_like_chat(server_url):
    """count_tokens is bounded like a generation (--max-prompt-chars before rendering), and a lone surrogate
    is a 400 naming its field on both routes (it was a 500 after generating)."""
    url = server_url + "/v1/messages"
    huge = {"model": "default", "messages": [{"role": "user", "content": "a" * 1_000_001}]}
    r = httpx.post(url + "/count_tokens", json=huge, timeout=300)
    assert r.status_code == 400 and "--max-prompt-chars" in r.text, r.text
    lone = '{"model": "default", %s"messages": [{"role": "user", "content": "hi \\ud800"}]}'
    for path, extra in (("", '"max_tokens": 4, '), ("/count_tokens", "")):
        body = lone % extra
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=300)
        assert r.status_code == 400 and "lone surrogate" in r.text and "messages" in r.text, (path, r.text)
