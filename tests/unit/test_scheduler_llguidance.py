"""JSON Schema and lark requests through the real scheduler on the llguidance backend, with jump-forward
(llguidance's forced bytes re-tokenized by plan_jump_forward): outputs validate, forced text is appended
without model passes, and the KV accounting invariant holds after every step (small pool: eviction)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from runtime.managers.scheduler.scheduler import Scheduler
from runtime.messages import GenerateReq
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SQL = {
    "type": "object",
    "properties": {"query": {"type": "string", "pattern": "^SELECT .{1,60}$"}},
    "required": ["query"],
    "additionalProperties": False,
}
CALENDAR = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "start": {"type": "string", "format": "date-time"},
        "attendees": {
            "type": "array",
            "items": {"type": "string", "format": "email", "maxLength": 24},
            "maxItems": 2,
        },
    },
    "required": ["title", "start", "attendees"],
    "additionalProperties": False,
}
LARK = 'start: "call " name "(" %json{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": false} ")"\nname: "get_weather" | "get_time"'  # noqa: E501


def test_llguidance_requests_with_jump_forward_keep_kv_accounting(default_model_dir, default_tokenizer):
    args = ServerArgs(
        model=default_model_dir,
        dtype="float32",
        quantization="none",
        kv_cache_dtype="float32",
        max_total_tokens=600,  # a few requests' worth: eviction happens
        chunked_prefill_size=16,
        log_interval=0,
        attention_backend="torch_native",
        grammar_backend="llguidance",
    )
    s = Scheduler(args, default_model_dir, tokenizer=default_tokenizer)
    cases = {
        "sql": ("Write a SQL query as JSON: ", {"json_schema": json.dumps(SQL)}),
        "cal": ("A calendar event as JSON: ", {"json_schema": json.dumps(CALENDAR)}),
        "cal2": ("Plan a meeting, JSON: ", {"json_schema": json.dumps(CALENDAR), "temperature": 1.0}),
        "lark": ("Call a tool: ", {"lark": LARK}),
    }
    for rid, (prompt, grammar) in cases.items():
        params = SamplingParams(**{"max_new_tokens": 160, "temperature": 0.0, "seed": 5, **grammar})
        ids = default_tokenizer.encode(prompt)
        s.handle(GenerateReq(rid=rid, input_ids=ids, params=params))
    outputs: dict[str, list[int]] = {rid: [] for rid in cases}
    finish: dict[str, dict] = {}
    steps = 0
    deadline = time.monotonic() + 600  # steps while grammars compile in the workers are empty and fast
    while s.has_work():
        for o in s.step():
            assert o.error is None, (o.rid, o.error)
            toks = outputs[o.rid]
            if o.replaced_tokens:
                del toks[len(toks) - o.replaced_tokens :]
            toks += o.new_token_ids
            if o.finished_reason is not None:
                finish[o.rid] = o.finished_reason
        s.check_accounting()
        steps += 1
        assert time.monotonic() < deadline, "requests did not finish"
    assert set(finish) == set(cases)
    assert s.stats["jump_forward_tokens"] > 0
    assert s.grammars.stats()["compiled_llguidance"] == 3  # three distinct grammars, cal shared
    texts = {rid: default_tokenizer.decode(t, skip_special_tokens=True) for rid, t in outputs.items()}
    for rid in ("sql", "cal", "cal2"):
        if rid == "cal2" and finish[rid]["type"] == "length":
            continue  # sampled: may ramble within the schema until max_new_tokens
        assert finish[rid]["type"] == "stop", (rid, finish[rid], texts[rid])
        jsonschema.validate(json.loads(texts[rid]), SQL if rid == "sql" else CALENDAR)
    assert re.fullmatch(r"SELECT .{1,60}", json.loads(texts["sql"])["query"])
    assert finish["lark"]["type"] == "stop", texts["lark"]
    m = re.fullmatch(r"call (get_weather|get_time)\((\{.*\})\)", texts["lark"], re.S)  # %json: free layout
    assert m and len(json.loads(m.group(2))["city"]) <= 12, texts["lark"]
