"""A real server on a tiny random gpt-oss (tests/random_gpt_oss.py) whose tokenizer has harmony's tags and a
harmony chat template, on the default attention backend (cpu: sink layers take torch_native's path): greedy
output equals transformers', `auto` picks the harmony tool-call and reasoning parsers, and a forced tool call
(tool_choice required) comes back as a valid call whose turn, sent back, extends the cached prompt."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.server_utils import ServerProcess, assert_no_kv_leak, generate, wait_idle
from tests.random_gpt_oss import harmony_tokenizer, save_random_gpt_oss
from tests.unit.test_model_parity import hf_greedy

pytestmark = pytest.mark.timeout(600)

UNIT = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "description": "Set the temperature unit.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "digits": {"enum": [0, 1, 2]}},
            "required": ["unit", "digits"],
        },
    },
}


def test_gpt_oss_server_greedy_and_forced_tool_call(tmp_path, default_tokenizer):
    tok = harmony_tokenizer(default_tokenizer)
    ends = [tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")]
    hf = save_random_gpt_oss(tmp_path, tok, vocab_size=len(tok), eos_token_id=ends)
    prompt = [17, 250, 33, 400, 91, 5, 128, 77, 300, 12, 9, 44]
    want = hf_greedy(hf, prompt, 6)
    # --quantization none: auto would measure the folder first, and every quantized mode refuses gpt-oss
    args = ["--max-total-tokens", "4096", "--quantization", "none"]
    srv = ServerProcess(model=str(tmp_path), extra_args=args).start()
    try:
        greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        assert generate(srv.url, {"input_ids": prompt, "sampling_params": greedy})["output_ids"] == want
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        messages = [{"role": "user", "content": "Use Fahrenheit with one digit."}]
        reply = client.chat.completions.create(
            model="default",
            messages=messages,
            tools=[UNIT],
            tool_choice="required",
            max_tokens=48,
            temperature=0,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "set_unit"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, UNIT["function"]["parameters"])
        # the call and its result sent back: the template renders the turn as the model wrote it, so the
        # next prompt extends this one and the radix cache serves it
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "done"},
        ]
        second = client.chat.completions.create(
            model="default", messages=messages, tools=[UNIT], max_tokens=4, temperature=0
        )
        assert second.usage.prompt_tokens > reply.usage.prompt_tokens
        turn = reply.usage.prompt_tokens + reply.usage.completion_tokens
        assert second.usage.prompt_tokens_details.cached_tokens >= turn - 1, second.usage
        assert_no_kv_leak(wait_idle(srv.url))
    finally:
        code = srv.stop()
    assert code == 0, f"server exited with {code} after SIGTERM; log tail:\n{srv.log_tail()}"
