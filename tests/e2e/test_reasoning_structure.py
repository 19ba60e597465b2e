"""Reasoning, structure and tools together on every API (issue 47, item 4), on a tiny random model under a
DeepSeek-R1-style template: its generation prompt opens `<think>`, so the output starts inside the thoughts
(`--reasoning-parser auto` picks deepseek-r1). A random model never writes `</think>` by itself: its thoughts
run until the budget nears its end, when the closing steer writes the tag and then the shortest valid
answer. So every reply has unconstrained thoughts and a valid JSON answer or tool call, on chat
completions, Responses and Messages, plain and streamed, and a budget below tag + shortest answer is a 400.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.e2e.conftest import EXTERNAL_URL
from tests.e2e.server_utils import ServerProcess, assert_no_kv_leak, wait_idle
from tests.random_llama import save_full_vocab_llama

pytestmark = pytest.mark.timeout(900)

TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% else %}<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)
ANSWER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ASK = [{"role": "user", "content": "Plan a short trip to Oslo."}]
BUDGET = 72


@pytest.fixture(scope="module")
def server_url(tmp_path_factory, default_model_dir):
    if EXTERNAL_URL:
        pytest.skip("needs its own server (a tiny model with a reasoning template)")
    from runtime.models.model_loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)  # its own copy: the template is this test's
    tokenizer.chat_template = TEMPLATE
    folder = save_full_vocab_llama(
        tmp_path_factory.mktemp("tiny_reasoner"), tokenizer, max_position_embeddings=2048
    )
    srv = ServerProcess(
        model=folder, extra_args=["--reasoning-parser", "auto", "--max-total-tokens", "16000"]
    ).start()
    try:
        yield srv.url
        assert_no_kv_leak(wait_idle(srv.url))
    finally:
        assert srv.stop() == 0, srv.log_tail()


def test_chat_json_schema_after_free_thoughts(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "plan", "schema": ANSWER}}
    for seed in range(3):
        out = oai.chat.completions.create(
            model="default", messages=ASK, response_format=fmt, max_tokens=BUDGET, temperature=0.8, seed=seed
        )
        choice = out.choices[0]
        thoughts = choice.message.model_extra["reasoning_content"]
        assert choice.finish_reason == "stop" and out.usage.completion_tokens <= BUDGET, choice
        assert len(thoughts) > 20 and "</think>" not in thoughts, thoughts  # the model's own, unconstrained
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
    reasoning, content = "", ""
    stream = oai.chat.completions.create(
        model="default", messages=ASK, response_format=fmt, max_tokens=BUDGET, temperature=0.8, stream=True
    )
    for chunk in stream:
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert reasoning.strip()
    jsonschema.validate(json.loads(content), ANSWER)


def test_chat_tool_call_after_free_thoughts(oai):
    tool = {"type": "function", "function": {"name": "book_hotel", "parameters": PARAMS}}
    args = {"model": "default", "messages": ASK, "max_tokens": BUDGET, "temperature": 0.8}
    out = oai.chat.completions.create(tools=[tool], tool_choice="required", **args)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"].strip()
    (call,) = choice.message.tool_calls
    assert call.function.name == "book_hotel"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)


def test_responses_json_schema_and_tool_call_after_free_thoughts(oai):
    args = {"model": "default", "input": ASK, "max_output_tokens": BUDGET, "temperature": 0.8}
    fmt = {"format": {"type": "json_schema", "name": "plan", "schema": ANSWER}}
    out = oai.responses.create(text=fmt, **args)
    assert out.status == "completed" and [o.type for o in out.output] == ["reasoning", "message"], out
    assert out.output[0].content[0].text.strip()
    jsonschema.validate(json.loads(out.output_text), ANSWER)
    tool = {"type": "function", "name": "book_hotel", "parameters": PARAMS}
    out = oai.responses.create(tools=[tool], tool_choice="required", **args)
    calls = [o for o in out.output if o.type == "function_call"]
    assert out.output[0].type == "reasoning" and len(calls) == 1, out
    jsonschema.validate(json.loads(calls[0].arguments), PARAMS)


def test_messages_json_schema_and_tool_use_after_free_thoughts(claude):
    args = {"model": "default", "messages": ASK, "max_tokens": BUDGET, "extra_body": {"temperature": 0.8}}
    fmt = {"format": {"type": "json_schema", "schema": ANSWER}}
    msg = claude.messages.create(**{**args, "extra_body": {**args["extra_body"], "output_config": fmt}})
    assert [b.type for b in msg.content] == ["thinking", "text"] and msg.stop_reason == "end_turn", msg
    assert msg.content[0].thinking.strip()
    jsonschema.validate(json.loads(msg.content[1].text), ANSWER)
    tool = {"name": "book_hotel", "input_schema": PARAMS}
    msg = claude.messages.create(tools=[tool], tool_choice={"type": "any"}, **args)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.content[0].type == "thinking" and msg.stop_reason == "tool_use" and len(uses) == 1, msg
    jsonschema.validate(uses[0].input, PARAMS)


def test_a_budget_below_the_tag_and_the_shortest_answer_is_a_400(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "plan", "schema": ANSWER}}
    with pytest.raises(Exception) as refused:
        oai.chat.completions.create(model="default", messages=ASK, response_format=fmt, max_tokens=6)
    assert getattr(refused.value, "status_code", None) == 400 and "tokens" in str(refused.value)
