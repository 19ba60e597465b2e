"""Randomized jump-forward through the real scheduler on the default model: schemas and regexes, greedy and
sampled, a small KV pool (eviction, retraction) and small prefill chunks; the KV accounting invariant is
checked after every step, not only when idle, so a slot freed or cached twice is caught where it happens."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from runtime.managers.scheduler.scheduler import Scheduler
from runtime.messages import GenerateReq
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NULLABLE = {"type": ["string", "null"]}
SCHEMAS = [
    {
        "type": "object",
        "properties": {k: NULLABLE for k in ("apiGroup", "kind", "name")},
        "required": ["apiGroup", "kind", "name"],
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "ok"],
    },
    {
        "type": "object",
        "properties": {"level": {"enum": ["low", "mid", "high"]}, "note": NULLABLE},
        "required": ["level", "note"],
    },
]
REGEXES = [r"(yes|no|maybe), because [a-z ]{1,20}\.", r"\{\"a\": [0-9]{1,3}, \"b\": \"[a-z]{1,6}\"\}"]
PROMPTS = ["JSON: ", "Answer in JSON. ", "Output: ", "Q: is it raining? A: "]


def test_kv_accounting_holds_after_every_step(default_model_dir, default_tokenizer):
    args = ServerArgs(
        model=default_model_dir,
        dtype="float32",
        quantization="none",
        kv_cache_dtype="float32",
        max_total_tokens=700,  # a few requests' worth: eviction and retraction happen
        chunked_prefill_size=8,
        log_interval=0,
        attention_backend="torch_native",
    )
    s = Scheduler(args, default_model_dir, tokenizer=default_tokenizer)
    rng = random.Random(1234)
    specs = {}
    pending = []
    for i in range(8):
        kind = rng.choice(["schema", "regex"])
        spec = rng.choice(SCHEMAS) if kind == "schema" else rng.choice(REGEXES)
        greedy = rng.random() < 0.5
        params = SamplingParams(
            max_new_tokens=rng.choice([24, 48, 64]),
            temperature=0.0 if greedy else 1.0,
            seed=None if greedy else rng.randrange(1 << 30),
            **({"json_schema": spec} if kind == "schema" else {"regex": spec}),
        )
        rid = f"r{i}"
        specs[rid] = (kind, spec)
        ids = default_tokenizer.encode(rng.choice(PROMPTS) * rng.randint(1, 3))
        pending.append(GenerateReq(rid=rid, input_ids=ids, params=params))
    outputs: dict[str, list[int]] = {}
    finish: dict[str, dict] = {}
    steps = 0
    while pending or s.has_work():
        if pending and steps % 3 == 0:  # staggered arrivals: extends interleave with decodes
            s.handle(pending.pop(0))
        for o in s.step():
            toks = outputs.setdefault(o.rid, [])
            if o.replaced_tokens:
                del toks[len(toks) - o.replaced_tokens :]
            toks += o.new_token_ids
            if o.finished_reason is not None:
                assert o.error is None, (o.rid, o.error)
                finish[o.rid] = o.finished_reason
        s.check_accounting()
        steps += 1
        assert steps < 20000
    assert set(finish) == set(specs)
    assert s.stats["jump_forward_tokens"] > 0
    for rid, (kind, spec) in specs.items():
        if finish[rid]["type"] != "stop":
            continue  # cut by max_new_tokens: a prefix of a valid output
        text = default_tokenizer.decode(outputs[rid], skip_special_tokens=True)
        if kind == "schema":
            jsonschema.validate(json.loads(text), spec)
