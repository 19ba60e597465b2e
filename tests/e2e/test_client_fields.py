"""Every field of the official clients' typed request params reaches the server and is taken (issue 47).

The fields are enumerated from the installed `openai` and `anthropic` packages, so a field a new client
release adds is sent here too: it needs a typical value in the tables below (the test fails and says so
until it has one). Each field is sent alone, through the client's own `create`, on top of a minimal request;
the answer must be a 200, or, for the few values radixlm cannot honour (listed in REFUSED with the reason
the 400 gives), a 400 that names the field and says why. No field may be refused as unknown. What each
field does here: docs/api_fields.md.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import message_create_params
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": TOOL["function"]["parameters"],
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
USER = [{"role": "user", "content": "Say hi."}]

# field -> the keyword arguments that send it with a typical value (a field that only means something with
# another one gets that one too)
# A field that forces a structure (a tool call, a JSON Schema answer) gets a budget its shortest output fits
# in: below that the request is a 400 by design (tests/e2e/test_closing_budget.py).
ROOM = {"max_tokens": 48}
CHAT: dict[str, dict[str, Any]] = {
    "messages": {"messages": [{"role": "system", "content": "Be brief."}, *USER]},
    "model": {"model": "default"},
    "audio": {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "function_call": {"function_call": "auto", "functions": [TOOL["function"]]},
    "functions": {"functions": [TOOL["function"]]},
    "logit_bias": {"logit_bias": {"42": 5}},
    "logprobs": {"logprobs": True},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "max_tokens": {"max_tokens": 3},
    "metadata": {"metadata": {"app": "walk", "run": "1"}},
    "modalities": {"modalities": ["text"]},
    "moderation": {"moderation": {"model": "omni-moderation-latest"}},
    "n": {"n": 2},
    "parallel_tool_calls": {"parallel_tool_calls": False, "tools": [TOOL]},
    "prediction": {"prediction": {"type": "content", "content": "Hi there."}},
    "presence_penalty": {"presence_penalty": 0.5},
    "prompt_cache_key": {"prompt_cache_key": "walk-chat"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "reasoning_effort": {"reasoning_effort": "low"},
    "response_format": {"response_format": {"type": "json_object"}},
    "safety_identifier": {"safety_identifier": "user-1234"},
    "seed": {"seed": 7},
    "service_tier": {"service_tier": "auto"},
    "stop": {"stop": ["\n\n"]},
    "store": {"store": True},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "temperature": {"temperature": 0.7},
    "tool_choice": {"tool_choice": "required", "tools": [TOOL], **ROOM},
    "tools": {"tools": [TOOL]},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "top_p": {"top_p": 0.9},
    "user": {"user": "user-1234"},
    "verbosity": {"verbosity": "low"},
    "web_search_options": {"web_search_options": {"search_context_size": "low"}},
}
COMPLETIONS: dict[str, dict[str, Any]] = {
    "model": {"model": "default"},
    "prompt": {"prompt": ["Once upon", "a time"]},
    "best_of": {"best_of": 1},
    "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"42": 5}},
    "logprobs": {"logprobs": 2},
    "max_tokens": {"max_tokens": 3},
    "n": {"n": 2},
    "presence_penalty": {"presence_penalty": 0.5},
    "seed": {"seed": 7},
    "stop": {"stop": "\n"},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "suffix": {"suffix": " the end."},
    "temperature": {"temperature": 0.7},
    "top_p": {"top_p": 0.9},
    "user": {"user": "user-1234"},
}
RESPONSES: dict[str, dict[str, Any]] = {
    "model": {"model": "default"},
    "input": {"input": [{"role": "user", "content": "Say hi."}]},
    "access_programs": {"access_programs": {"cyber": "standard"}},
    "background": {"background": False},
    "background_options": {"background_options": {"completion_window": "soonest"}},
    "context_management": {"context_management": [{"type": "compaction", "compact_threshold": 1000}]},
    "conversation": {"conversation": "conv_123"},
    "image": {"image": {"context_compression": "auto"}},
    "include": {"include": ["reasoning.encrypted_content"]},
    "instructions": {"instructions": "Be brief."},
    "max_output_tokens": {"max_output_tokens": 3},
    "max_tool_calls": {"max_tool_calls": 2},
    "metadata": {"metadata": {"app": "walk"}},
    "moderation": {"moderation": {"model": "omni-moderation-latest"}},
    "parallel_tool_calls": {"parallel_tool_calls": False, "tools": [RESPONSES_TOOL]},
    "previous_response_id": {},  # needs a stored response: sent by test_previous_response_id below
    "prompt": {"prompt": {"id": "pmpt_123"}},
    "prompt_cache_key": {"prompt_cache_key": "walk-responses"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
    "prompt_cache_retention": {"prompt_cache_retention": "in_memory"},
    "reasoning": {"reasoning": {"effort": "low", "summary": "auto"}},
    "safety_identifier": {"safety_identifier": "user-1234"},
    "service_tier": {"service_tier": "default"},
    "store": {"store": False},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_obfuscation": False}},
    "temperature": {"temperature": 0.7},
    "text": {
        "text": {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}, "verbosity": "low"},
        "max_output_tokens": ROOM["max_tokens"],
    },
    "tool_choice": {
        "tool_choice": "required",
        "tools": [RESPONSES_TOOL],
        "max_output_tokens": ROOM["max_tokens"],
    },
    "tools": {"tools": [RESPONSES_TOOL]},
    "top_logprobs": {"top_logprobs": 0},
    "top_p": {"top_p": 0.9},
    "truncation": {"truncation": "disabled"},
    "user": {"user": "user-1234"},
}
MESSAGES: dict[str, dict[str, Any]] = {
    "model": {"model": "default"},
    "messages": {"messages": USER},
    "max_tokens": {"max_tokens": 3},
    "cache_control": {"cache_control": {"type": "ephemeral", "ttl": "5m"}},
    "container": {"container": "container_123"},
    "diagnostics": {"diagnostics": {"previous_message_id": "msg_123"}},
    "inference_geo": {"inference_geo": "us"},
    "metadata": {"metadata": {"user_id": "user-1234"}},
    "output_config": {
        "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": SCHEMA}},
        **ROOM,
    },
    "service_tier": {"service_tier": "standard_only"},
    "speed": {"speed": "fast"},
    "stop_sequences": {"stop_sequences": ["\n\n"]},
    "stream": {"stream": True},
    "system": {"system": "Be brief."},
    "thinking": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
    "tool_choice": {"tool_choice": {"type": "any"}, "tools": [ANTHROPIC_TOOL], **ROOM},
    "tools": {"tools": [ANTHROPIC_TOOL]},
    "user_profile_id": {"user_profile_id": "prof_123"},
    "workspace_id": {"workspace_id": "wrkspc_123"},
}
# (api, field) -> what the 400 says besides the field's name: values radixlm cannot honour
REFUSED = {
    ("chat", "audio"): "audio output is not supported",
    ("chat", "moderation"): "no moderation model",
    ("chat", "web_search_options"): "no web search",
    ("completions", "suffix"): "not supported",
    ("responses", "context_management"): "does not compact",
    ("responses", "conversation"): "no Conversations API",
    ("responses", "moderation"): "no moderation model",
    ("responses", "prompt"): "no saved prompt templates",
    ("messages", "container"): "no code-execution containers",
}
UNKNOWN_FIELD_WORDS = ("Extra inputs are not permitted", "unknown field")


def client_fields(params: type) -> list[str]:
    return sorted(params.__annotations__)


APIS = {
    # api: (the client's typed params, the table, the minimal request)
    "chat": (
        chat_create_params.CompletionCreateParamsStreaming,
        CHAT,
        {"model": "default", "messages": USER, "max_tokens": 3},
    ),
    "completions": (
        completion_create_params.CompletionCreateParamsStreaming,
        COMPLETIONS,
        {"model": "default", "prompt": "Once upon a time", "max_tokens": 3},
    ),
    "responses": (
        response_create_params.ResponseCreateParamsStreaming,
        RESPONSES,
        {"model": "default", "input": "Say hi.", "max_output_tokens": 3},
    ),
    "messages": (
        message_create_params.MessageCreateParamsStreaming,
        MESSAGES,
        {"model": "default", "messages": USER, "max_tokens": 3},
    ),
}
CASES = [(api, f) for api, (params, _, _) in APIS.items() for f in client_fields(params)]


def send(api: str, oai: openai.OpenAI, claude: anthropic.Anthropic, kwargs: dict[str, Any]) -> Any:
    create = {
        "chat": oai.chat.completions.create,
        "completions": oai.completions.create,
        "responses": oai.responses.create,
        "messages": claude.messages.create,
    }[api]
    out = create(**kwargs)
    if kwargs.get("stream"):
        return list(out)  # the whole stream: an error inside it would raise here
    return out


@pytest.mark.parametrize("api, field", CASES, ids=[f"{a}.{f}" for a, f in CASES])
def test_every_client_field_is_taken(api, field, oai, claude):
    params, table, base = APIS[api]
    assert field in table, (
        f"the installed client's {params.__name__} has a field '{field}' that this test has no typical value "
        f"for: add it to {api.upper()} in tests/e2e/test_client_fields.py (and say what it does in "
        "docs/api_fields.md)"
    )
    if not table[field]:
        pytest.skip(f"{api}.{field} needs state; sent by its own test")
    kwargs = {**base, **table[field]}
    if (api, field) not in REFUSED:
        out = send(api, oai, claude, kwargs)
        assert out  # a 4xx / 5xx raised
        return
    errors = (openai.BadRequestError, anthropic.BadRequestError)
    with pytest.raises(errors) as e:
        send(api, oai, claude, kwargs)
    message = str(e.value)
    assert field in message and REFUSED[(api, field)] in message, message
    assert not any(w in message for w in UNKNOWN_FIELD_WORDS), message


def test_previous_response_id(oai):
    first = oai.responses.create(model="default", input="Say hi.", max_output_tokens=3)
    second = oai.responses.create(
        model="default", input="Again.", max_output_tokens=3, previous_response_id=first.id
    )
    assert second.previous_response_id == first.id


def test_service_tier_is_answered(oai, claude):
    chat = oai.chat.completions.create(model="default", messages=USER, max_tokens=2, service_tier="flex")
    assert chat.service_tier == "default"
    resp = oai.responses.create(model="default", input="Hi", max_output_tokens=2, service_tier="priority")
    assert resp.service_tier == "default"
    plain = oai.chat.completions.create(model="default", messages=USER, max_tokens=2)
    assert plain.service_tier is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"logit_bias": {"42": 101}}, "logit_bias"),
        ({"logit_bias": {"10000000": 1}}, "logit_bias"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"service_tier": "gold"}, "service_tier"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"verbosity": "chatty"}, "verbosity"),
        ({"safety_identifier": "x" * 129}, "safety_identifier"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"prediction": {"type": "diff", "content": "x"}}, "prediction"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"functions": [TOOL["function"]], "tools": [TOOL]}, "functions"),
        ({"stream_options": {"include_usage": True, "colour": "red"}}, "stream_options"),
    ],
)
def test_bad_values_are_400s_naming_the_field(oai, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="default", messages=USER, max_tokens=2, **kwargs)
    assert field in str(e.value), str(e.value)


def test_logit_bias_steers_chat_and_completions(oai, default_tokenizer):
    """+100 on one token: every greedy token is that token; -100 on the natural first token moves the answer
    off it (the sampler applies the bias at every step, greedy fast path included)."""
    tok = default_tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = default_tokenizer.decode([tok] * 3)
    chat = oai.chat.completions.create(
        model="default", messages=USER, max_tokens=3, temperature=0, logit_bias={str(tok): 100}
    )
    assert chat.choices[0].message.content == forced
    done = oai.completions.create(
        model="default", prompt="1, 2, 3,", max_tokens=3, temperature=0, logit_bias={str(tok): 100}
    )
    assert done.choices[0].text == forced
    natural = oai.completions.create(model="default", prompt="1, 2, 3,", max_tokens=1, temperature=0)
    first = default_tokenizer.encode(natural.choices[0].text, add_special_tokens=False)[0]
    banned = oai.completions.create(
        model="default", prompt="1, 2, 3,", max_tokens=1, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text not in ("", natural.choices[0].text)


def test_functions_are_tools_and_answer_as_function_call(oai):
    out = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=40,
        temperature=0,
        functions=[TOOL["function"]],
        function_call={"name": "get_weather"},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.function_call.name == "get_weather"
    assert "city" in choice.message.function_call.arguments


@pytest.mark.parametrize(
    "kwargs, field, why",
    [
        ({"truncation": "auto"}, "truncation", "does not drop input items"),
        ({"background": True}, "background", "no background mode"),
        ({"top_logprobs": 3}, "top_logprobs", "no logprobs yet"),
        ({"include": ["message.unknown"]}, "include", ""),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", ""),
        ({"background_options": {"completion_window": "2h"}}, "completion_window", ""),
        ({"service_tier": "gold"}, "service_tier", ""),
        ({"prompt_cache_key": ""}, "prompt_cache_key", ""),
    ],
)
def test_responses_values_it_cannot_honour_are_400s_naming_them(oai, kwargs, field, why):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="default", input="Hi", max_output_tokens=2, **kwargs)
    assert field in str(e.value) and why in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"output_config": {"colour": "red"}}, "output_config"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"metadata": {"team": "x"}}, "metadata"),
        ({"speed": "warp"}, "speed"),
    ],
)
def test_messages_bad_values_are_400s_naming_them(claude, kwargs, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="default", messages=USER, max_tokens=2, **kwargs)
    assert field in str(e.value), str(e.value)


def test_functions_stream_as_function_call(oai):
    kwargs = {
        "model": "default",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 40,
        "temperature": 0,
        "functions": [TOOL["function"]],
        "function_call": {"name": "get_weather"},
    }
    plain = oai.chat.completions.create(**kwargs).choices[0]
    name, arguments, finish = "", "", None
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            if c.delta.function_call is not None:
                name += c.delta.function_call.name or ""
                arguments += c.delta.function_call.arguments or ""
            finish = c.finish_reason or finish
    assert (name, arguments, finish) == (
        plain.message.function_call.name,
        plain.message.function_call.arguments,
        "function_call",
    )
