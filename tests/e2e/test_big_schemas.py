"""Real-size schemas through the server on the default (auto) grammar backend (issue 47, item 5): no static
limit refuses a 450-property or a 160k-character schema; the capped compile pool compiles them and the
answer is valid JSON under the schema. (A tool's parameters of that size go through the same engine, but
the tool block puts the whole schema in the prompt: thousands of tokens of prefill, too slow for this
suite; tests/unit/test_constrained_spec.py checks the limits themselves.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.big_schemas import long_schema, wide_schema


@pytest.mark.parametrize(
    "schema", [wide_schema(450), long_schema(160_000)], ids=["450-properties", "160k-chars"]
)
def test_real_size_schema_is_enforced(oai, schema):
    assert len(json.dumps(schema)) < 8 << 20  # inside the default body limit
    out = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Fill in the record."}],
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": schema}},
        max_tokens=200,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)
