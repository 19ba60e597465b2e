"""Constrained decoding through the real scheduler on the default model: every output matches its regex or
validates against its schema, greedy and sampled, with and without jump-forward; jump-forward needs fewer
model forward passes, and gives the same greedy text where the forced text is what the model would write."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from runtime.managers.scheduler.scheduler import Scheduler
from runtime.messages import GenerateReq
from runtime.sampling_params import SamplingParams
from tests.scheduler_utils import make_scheduler

REGEXES = {
    "integer": r"-?[1-9]\d{0,5}",
    "float": r"-?\d{1,3}\.\d{1,3}",
    "date": r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "ipv4": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    "email": r"[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)",
    "enum": r"(red|green|blue)",
}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        },
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                    "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        },
        "required": ["city", "location", "tags"],
    },
    "flags": {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "level": {"enum": ["low", "mid", "high"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["ok", "level", "count"],
    },
}


pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def schedulers(default_model_dir, default_tokenizer):
    # make_scheduler pins float32 (token-exact comparisons) and no speculation (the tests count the forward
    # passes jump-forward alone saves)
    return {
        jf: make_scheduler(default_model_dir, default_tokenizer, disable_jump_forward=not jf)
        for jf in (True, False)
    }


def chat(tok, text: str) -> list[int]:
    p = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tok.encode(p, add_special_tokens=False)


def run(sched: Scheduler, tok, cases: dict[str, tuple[str, dict]]) -> tuple[dict[str, str], int]:
    """cases: rid -> (prompt, sampling params). Returns texts and the number of forward passes used."""
    ids, steps = run_ids(sched, tok, cases)
    return {rid: tok.decode(t, skip_special_tokens=True) for rid, t in ids.items()}, steps


def run_ids(sched: Scheduler, tok, cases: dict[str, tuple[str, dict]]) -> tuple[dict[str, list[int]], int]:
    """Like `run`, with output token ids (as the client sees them) instead of texts."""
    before = sched.stats["extend_steps"] + sched.stats["decode_steps"]
    for rid, (prompt, params) in cases.items():
        sched.handle(GenerateReq(rid=rid, input_ids=chat(tok, prompt), params=SamplingParams(**params)))
    ids: dict[str, list[int]] = {rid: [] for rid in cases}
    finish = {}
    while sched.has_work():
        for o in sched.step():
            assert o.error is None, o.error
            if o.replaced_tokens:
                del ids[o.rid][len(ids[o.rid]) - o.replaced_tokens :]
            ids[o.rid].extend(o.new_token_ids)
            if o.finished_reason:
                finish[o.rid] = o.finished_reason
    sched.check_accounting()
    assert all(f["type"] == "stop" for f in finish.values()), finish
    return ids, sched.stats["extend_steps"] + sched.stats["decode_steps"] - before


def test_regex_outputs_match(schedulers, default_tokenizer):
    for jf, sched in schedulers.items():
        for sampled in (False, True):
            extra = {"temperature": 1.0, "seed": 7} if sampled else {"temperature": 0.0}
            cases = {
                name: (f"Give me an example of: {name}.", {"regex": rx, "max_new_tokens": 40, **extra})
                for name, rx in REGEXES.items()
            }
            texts, _ = run(sched, default_tokenizer, cases)
            for name, text in texts.items():
                assert re.fullmatch(REGEXES[name], text), (jf, sampled, name, text)


@pytest.mark.parametrize("jump_forward", [True, False])
def test_json_schema_outputs_validate(schedulers, default_tokenizer, jump_forward):
    sched = schedulers[jump_forward]
    for sampled in (False, True):
        extra = {"temperature": 0.7, "seed": 3} if sampled else {"temperature": 0.0}
        cases = {
            name: (
                f"Describe a {name} as JSON.",
                {"json_schema": json.dumps(s), "max_new_tokens": 160, **extra},
            )
            for name, s in SCHEMAS.items()
        }
        texts, _ = run(sched, default_tokenizer, cases)
        for name, text in texts.items():
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_jump_forward_saves_forward_passes(schedulers, default_tokenizer):
    """Jump-forward must cut model passes and keep outputs valid. Its greedy text can differ from plain masked
    decoding: jump-forward appends the forced text as the tokenizer splits it (`{"`, `":`, ` "`), while the
    model may sample other splits (`{` then `"`) or merge a forced space with what follows (` -` of ` -7`),
    and then sees different context tokens."""
    results = {}
    for jf, sched in schedulers.items():
        steps_total = 0
        texts = {}
        for name, schema in SCHEMAS.items():  # one at a time, so the step counts are per request
            t, steps = run(
                sched,
                default_tokenizer,
                {
                    name: (
                        f"Describe a {name} as JSON.",
                        {"json_schema": json.dumps(schema), "max_new_tokens": 160, "temperature": 0.0},
                    )
                },
            )
            texts.update(t)
            steps_total += steps
        results[jf] = (texts, steps_total)
    for jf in (True, False):
        for name, text in results[jf][0].items():
            jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert results[True][1] < results[False][1], results
    assert schedulers[True].stats["jump_forward_tokens"] > 0


# The default layout (json.dumps's, DEFAULT_WHITESPACE) has no optional whitespace: separators and required
# keys are forced. Where the prompt shows that layout and the model splits the forced text as the tokenizer
# does, masked greedy decoding samples exactly the tokens jump-forward appends: the same tokens, hence the
# same text, in fewer forward passes. (Not so where the model would merge a forced space with what follows:
# after a forced `": ` it would write ` -7` as ` -`, `7`; nor where it splits `{"` as `{`, `"`: then only the
# text may agree.)
ONE_LINE = "Reply with one line of JSON, for example "
SAME_TEXT_CASES = {
    "date": (
        ONE_LINE + '{"year": 1999, "month": 4, "day": 17}. When did the first person walk on the moon?',
        {
            "type": "object",
            "properties": {
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                "month": {"type": "integer", "minimum": 1, "maximum": 12},
                "day": {"type": "integer", "minimum": 1, "maximum": 31},
            },
            "required": ["year", "month", "day"],
            "additionalProperties": False,
        },
    ),
    "color": (
        ONE_LINE + '{"r": 12, "g": 200, "b": 7}. Give the color of the sky.',
        {
            "type": "object",
            "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255} for c in "rgb"},
            "required": ["r", "g", "b"],
            "additionalProperties": False,
        },
    ),
    # the grammar admits one text: equal whatever tokens the model picks
    "constant": (
        "Give the status.",
        {
            "type": "object",
            "properties": {"status": {"const": "ok"}, "code": {"const": 200}},
            "required": ["status", "code"],
            "additionalProperties": False,
        },
    ),
}


@pytest.mark.parametrize("name", list(SAME_TEXT_CASES))
def test_jump_forward_text_equals_masked_greedy_where_forced_text_is_the_models_own(
    schedulers, default_tokenizer, name
):
    prompt, schema = SAME_TEXT_CASES[name]
    params = {"json_schema": json.dumps(schema), "max_new_tokens": 64, "temperature": 0.0}
    (ids_jf, steps_jf), (ids_plain, steps_plain) = (
        run_ids(schedulers[jf], default_tokenizer, {name: (prompt, params)}) for jf in (True, False)
    )
    text = default_tokenizer.decode(ids_jf[name], skip_special_tokens=True)
    assert text == default_tokenizer.decode(ids_plain[name], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)
    if name != "constant":  # the model's own split: jump-forward appended the very tokens it would sample
        assert ids_jf[name] == ids_plain[name], [default_tokenizer.decode([t]) for t in ids_plain[name]]
    assert steps_jf < steps_plain, (steps_jf, steps_plain)
