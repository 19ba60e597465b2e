"""Generated JSON Schemas the size of real ones that static limits used to refuse (issue 47, item 5:
JSONSchemaBench's Kubernetes and WashingtonPost schemas have 252 and 445 properties, another 155k chars)."""

from __future__ import annotations

import json
from typing import Any


def wide_schema(properties: int = 450) -> dict[str, Any]:
    """One object with `properties` optional string properties (the first required)."""
    props = {f"field_{i}": {"type": "string", "maxLength": 8} for i in range(properties)}
    return {"type": "object", "properties": props, "required": ["field_0"], "additionalProperties": False}


def long_schema(chars: int = 160_000) -> dict[str, Any]:
    """An object schema of at least `chars` characters of JSON: nested objects with long descriptions."""
    props: dict[str, Any] = {}
    schema = {"type": "object", "properties": props, "required": ["p0"], "additionalProperties": False}
    while len(json.dumps(schema)) < chars:
        props[f"p{len(props)}"] = {
            "type": "object",
            "description": "A nested record. " * 18,
            "properties": {"a": {"type": "integer"}, "b": {"type": "string", "enum": ["u", "v"]}},
            "additionalProperties": False,
        }
    return schema
