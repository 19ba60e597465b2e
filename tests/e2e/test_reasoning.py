"""`--reasoning-parser qwen3` on the default model (issue 26, item 3): thoughts split from the answer in all
three wire formats, streamed as they come, structured output applied after the thoughts, and
`--reasoning-in-history` keeping a continued response's prefix cached.

The 135M model has no thinking training; a few-shot history of `<think>...</think>` turns makes it write
thoughts at temperature 0 (deterministic on this model), which is all the parser needs.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.e2e.conftest import EXTERNAL_URL
from tests.e2e.server_utils import ServerProcess

SYSTEM = "You think step by step inside <think> and </think>, then give the answer."
SHOTS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nTwo plus two is four.\n</think>\n\n4"},
    {"role": "user", "content": "What is 3+3?"},
    {"role": "assistant", "content": "<think>\nThree plus three is six.\n</think>\n\n6"},
    {"role": "user", "content": "What is 5+5?"},
]
CHAT = [{"role": "system", "content": SYSTEM}, *SHOTS]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 1000}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server_url():
    if EXTERNAL_URL:
        pytest.skip("needs its own server (--reasoning-parser qwen3)")
    args = ["--max-total-tokens", "8000", "--reasoning-parser", "qwen3", "--reasoning-in-history"]
    srv = ServerProcess(extra_args=args).start()
    try:
        yield srv.url
    finally:
        assert srv.stop() == 0, srv.log_tail()


def chat(oai, **kw):
    args = {"model": "default", "messages": CHAT, "max_tokens": 40, "temperature": 0}
    return oai.chat.completions.create(**{**args, **kw})


def test_chat_reasoning_content_plain_and_streamed(oai):
    m = chat(oai).choices[0].message
    thoughts = m.model_extra["reasoning_content"]
    assert thoughts.strip() and m.content and "<think>" not in m.content and "</think>" not in m.content
    reasoning, content = "", ""
    for ch in chat(oai, stream=True):
        for c in ch.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (thoughts, m.content)


def test_chat_without_separation_keeps_the_tags(oai):
    m = chat(oai, extra_body={"separate_reasoning": False}).choices[0].message
    assert "</think>" in m.content and not (m.model_extra or {}).get("reasoning_content")


def test_structured_output_applies_after_the_thoughts(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
    m = chat(oai, response_format=fmt, max_tokens=60).choices[0].message
    assert m.model_extra["reasoning_content"].strip()
    jsonschema.validate(json.loads(m.content), ANSWER)


def test_responses_reasoning_items_and_cached_continuation(oai):
    args = {"model": "default", "instructions": SYSTEM, "max_output_tokens": 40, "temperature": 0}
    first = oai.responses.create(input=SHOTS, **args)
    assert [o.type for o in first.output] == ["reasoning", "message"]
    thoughts = first.output[0].content[0].text
    assert thoughts.strip() and first.output_text
    assert 0 < first.usage.output_tokens_details.reasoning_tokens < first.usage.output_tokens
    events = list(oai.responses.create(input=SHOTS, stream=True, **args))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (streamed, text) == (thoughts, first.output_text)
    second = oai.responses.create(input="What is 7+7?", previous_response_id=first.id, **args)
    previous = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.9 * previous


def test_messages_thinking_blocks(claude):
    client = claude
    args = {
        "model": "default",
        "system": SYSTEM,
        "messages": SHOTS,
        "max_tokens": 40,
        "extra_body": {"temperature": 0},
    }
    m = client.messages.create(**args)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking.strip()
    with client.messages.stream(**args) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in kinds and "text_delta" in kinds
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == [
        (b.type, getattr(b, "thinking", None) or b.text) for b in m.content
    ]
