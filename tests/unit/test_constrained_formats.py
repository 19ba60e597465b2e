"""Format regexes and bounded schemas: random walks over the byte-level automaton must give valid instances.

A walk starts at the automaton's initial state and picks a random allowed byte until it stops at a final
state, so every walk output is a text the grammar accepts; each is then checked by Python's own parsers and
by ``jsonschema`` (with its FormatChecker where it has a checker for the format).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import random
import re
import urllib.parse
import uuid

import jsonschema
import outlines_core
import pytest

from constrained import GrammarError, validate_spec
from constrained.formats import FORMAT_REGEXES, STRING_LENGTH_CAP, format_width

WALKS = 150


def _byte_index(regex: str) -> outlines_core.Index:
    vocab = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(128)})  # ASCII is enough here
    return outlines_core.Index(regex, vocab)


def random_walks(regex: str, n: int, seed: int, stop: float = 0.15, max_len: int = 600) -> list[str]:
    index = _byte_index(regex)
    finals = set(index.get_final_states())
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        state, text = index.get_initial_state(), bytearray()
        while True:
            allowed = [t for t in index.get_allowed_tokens(state) if t < 256]
            can_end = 256 in index.get_allowed_tokens(state) or state in finals
            if can_end and (not allowed or rng.random() < stop or len(text) > max_len):
                break
            assert allowed, f"dead end after {bytes(text)!r}"
            byte = rng.choice(allowed)
            text.append(byte)
            state = index.get_next_state(state, byte)
        out.append(text.decode("utf-8"))
    return out


def _check(fmt: str, text: str) -> None:
    """Raise if ``text`` is not a valid ``fmt`` per the standard library."""
    if fmt == "date":
        datetime.date.fromisoformat(text)
    elif fmt == "date-time":
        assert text[-1] == "Z" or text[-6] in "+-", text  # RFC 3339: an offset is required
        datetime.datetime.fromisoformat(text)
    elif fmt == "time":
        assert text[-1] == "Z" or text[-6] in "+-", text
        datetime.time.fromisoformat(text)
    elif fmt == "uuid":
        assert str(uuid.UUID(text)) == text
    elif fmt == "ipv4":
        ipaddress.IPv4Address(text)
    elif fmt == "uri":
        parts = urllib.parse.urlsplit(text)
        assert parts.scheme in ("http", "https") and parts.netloc, text
    elif fmt in ("email", "hostname"):
        host = text.rsplit("@", 1)[-1]
        labels = host.split(".")
        assert all(0 < len(lb) <= 63 and lb[0] != "-" and lb[-1] != "-" for lb in labels), text
        if fmt == "email":
            local = text.rsplit("@", 1)[0]
            assert local and ".." not in local and local[0] != "." and local[-1] != ".", text
    elif fmt == "json-pointer":
        assert text == "" or text.startswith("/"), text
        assert all(s.replace("~0", "").replace("~1", "").find("~") < 0 for s in text.split("/")), text
    else:
        raise AssertionError(f"no check for {fmt}")


@pytest.mark.parametrize("fmt", sorted(FORMAT_REGEXES))
def test_format_walks_are_valid(fmt):
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    walks = random_walks(FORMAT_REGEXES[fmt], WALKS, seed=hash(fmt) % 1000)
    lo, hi = format_width(fmt)
    for text in walks:
        _check(fmt, text)
        assert lo <= len(text) <= hi
        if fmt in checker.checkers:
            checker.check(text, fmt)  # raises FormatError
    assert len(set(walks)) > WALKS // 3  # walks explore the format, not one fixed text


def _schema_walks(schema: dict, n: int = WALKS) -> list:
    regex = validate_spec("json_schema", json.dumps(schema))
    return [json.loads(t) for t in random_walks(regex, n, seed=1, stop=0.3)]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 8192},
        {"type": "string", "minLength": 3, "maxLength": 5},
        {"type": "string", "minLength": 70},
        {"type": "object", "properties": {"u": {"type": "string", "format": "uri", "maxLength": 2048}}},
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 1000},
        {"type": "integer", "minimum": -1e300, "maximum": 1e300},
        {"type": "number", "exclusiveMinimum": -1e20},
        {"not": {"type": ["string", "null", "object", "array"]}},
        {"type": ["string", "null"], "format": "date"},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "AllOf": [{"required": ["a"]}]},
        {"allOf": [{"properties": {"a": {"type": "boolean"}}}, {"required": ["a"], "type": "object"}]},
        {"type": "array", "items": False},
        {"patternProperties": {"^[a-z]+$": {"type": "integer"}}, "additionalProperties": False},
        {"anyOf": [False, {"type": "string", "format": "uuid"}]},
    ],
)
def test_bounded_and_new_keywords_validate(schema):
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    for instance in _schema_walks(schema):
        validator.validate(instance)
    if schema.get("maxLength") == 8192:
        assert max(len(s) for s in _schema_walks(schema, 50)) <= STRING_LENGTH_CAP


def test_all_of_is_enforced_not_dropped():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "AllOf": [{"required": ["a"]}]}
    assert all("a" in inst for inst in _schema_walks(schema, 30))


@pytest.mark.parametrize(
    "schema, reason",
    [
        ({"type": "string", "format": "ipv6"}, "format 'ipv6' cannot be enforced"),
        ({"type": "string", "format": "uuid", "maxLength": 10}, "cannot be enforced together with minLength"),
        ({"type": "string", "format": "date", "pattern": "^2"}, "together with a `pattern`"),
        ({"type": "string", "minLength": 100000}, "minLength 100000 is above the supported limit"),
        ({"type": "array", "minItems": 5000}, "minItems 5000 is above the supported limit"),
        ({"not": {"enum": [1]}}, "`not` can only be enforced around `type`"),
        ({"not": {"type": ["string", "number", "object", "array", "boolean", "null"]}}, "excludes every"),
        ({"anyOf": [False]}, "only `false` subschemas"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "`allOf` subschemas set `type` differently"),
    ],
)
def test_unenforceable_keywords_are_errors_naming_why(schema, reason):
    with pytest.raises(GrammarError, match=reason.replace("(", r"\(").replace("[", r"\[")):
        validate_spec("json_schema", json.dumps(schema))


def test_custom_format_is_ignored_as_the_spec_says():
    plain = validate_spec("json_schema", json.dumps({"type": "string"}))
    assert validate_spec("json_schema", json.dumps({"type": "string", "format": "non-blank"})) == plain


REFS_UNDER_DATA = {  # a `$ref` into a top-level key that is no keyword, holding a miscased `AllOf`
    "type": "object",
    "refs": {"item": {"AllOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}]}},
    "properties": {"x": {"$ref": "#/refs/item"}},
    "required": ["x"],
}
TWO_INTS = {"a": {"type": "integer"}, "b": {"type": "integer"}}


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"f": {"typeof": "function"}}, "required": ["f"]},
        {"id": "urn:x", "title": "bag", "type": "object", "additionalProperties": {}},
        {"type": "object", "properties": TWO_INTS, "required": ["a"], "not": {"required": ["a", "b"]}},
        {"type": "object", "not": {"required": ["body", "bodyValue"]}},
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"not": {}}}},
        {"properties": {"c": {"const": {"$data": "1/p", "x": [1, "a.b"]}}}, "required": ["c"]},
        {"enum": [[1, 2], {"k": "v+(x)"}, "s"]},
        REFS_UNDER_DATA,
        {"type": "object", "patternProperties": {"^abc.+$": {"type": "string", "maxLength": 3}}},
        {"type": "object", "patternProperties": {"a": {"type": "integer"}, "b": {"minimum": 3}}},
        {
            "type": "object",
            "patternProperties": {".*": {"properties": {"u": {"$ref": "#/$defs/s"}}, "required": ["u"]}},
            "$defs": {"s": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
        },
        {"type": "object", "minProperties": 1},
        {"type": "string", "pattern": "^mystring-[a-zA-Z0-9]+$", "minLength": 10, "maxLength": 24},
        {"type": "string", "pattern": "^https?://[a-z]+$", "maxLength": 1024},
        {"type": "string", "pattern": "^a(b|cd)$", "minLength": 2, "maxLength": 3},
        {"type": "string", "pattern": "^[0-9a-z-]*$", "minLength": 4, "maxLength": 63},
        {"type": "string", "pattern": "^[0-9a-z_-]{1,255}$"},  # counted repeat capped (stricter)
    ],
)
def test_keyword_rewrites_validate(schema):
    validator = jsonschema.Draft202012Validator(schema)
    walks = _schema_walks(schema, 60)
    for instance in walks:
        validator.validate(instance)
    if schema.get("not") == {"required": ["a", "b"]}:
        assert all("b" not in inst for inst in walks)  # the optional one of the pair is left out
    if schema.get("minProperties") == 1:
        assert all(inst for inst in walks) and any(len(inst) > 1 for inst in walks)
    if "$defs" in schema:  # pattern-keyed members are emitted, each with the required array
        assert any(inst for inst in walks) and all(
            isinstance(v["u"], list) for i in walks for v in i.values()
        )
    if "pattern" in schema:  # the pattern is kept, not dropped for the length bounds
        assert all(re.fullmatch(schema["pattern"].strip("^$"), inst) for inst in walks)
        assert len(set(walks)) > 1
        assert max(map(len, walks)) <= 64 and min(map(len, walks)) >= schema.get("minLength", 0)
    if schema is REFS_UNDER_DATA:
        assert all(isinstance(inst["x"]["a"], int) for inst in walks)  # the target's AllOf is enforced


def test_free_form_object_with_unknown_keys_uses_the_compact_regex():
    # a draft-4 `id` is no keyword: the object is free-form (outlines-core's own took > 30 s to compile)
    bare = validate_spec("json_schema", json.dumps({"type": "object"}))
    assert validate_spec("json_schema", json.dumps({"id": "urn:x", "type": "object"})) == bare


@pytest.mark.parametrize(
    "schema, reason",
    [
        ({"not": {}}, "`not: {}` accepts no value"),
        (
            {
                "type": "object",
                "properties": TWO_INTS,
                "required": ["a", "b"],
                "not": {"required": ["a", "b"]},
            },
            "`not` forbids the properties",
        ),
        ({"type": "string", "not": {"required": ["a"]}}, "admits only objects"),
        ({"type": "object", "required": ["a"], "not": {"required": ["a", "b"]}}, "lists `required` names"),
        ({"not": {"required": ["a"], "properties": {}}}, "around `type` or `required` alone"),
        ({"type": "string", "pattern": "^(http|https)://x", "minLength": 20}, "shorter than minLength 20"),
        ({"type": "string", "pattern": "^abcdef$", "maxLength": 3}, "cannot be bounded"),
        ({"type": "string", "pattern": "^[a-z]{1,3}$", "minLength": 5}, "shorter than minLength 5"),
    ],
)
def test_unenforceable_not_is_an_error_naming_why(schema, reason):
    with pytest.raises(GrammarError, match=reason.replace("(", r"\(").replace("[", r"\[")):
        validate_spec("json_schema", json.dumps(schema))


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "number", "multipleOf": 0.5}, "`multipleOf: 0.5`"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "`uniqueItems: true`"),
        ({"type": "object", "properties": TWO_INTS, "minProperties": 3}, "`minProperties: 3`"),
        ({"type": "integer", "multipleOf": 3}, "`multipleOf: 3`"),
        ({"additionalProperties": {"type": "integer"}, "maxProperties": 1}, "maxProperties"),
        (
            {"type": "object", "properties": TWO_INTS, "required": ["a"], "dependencies": {"a": ["c"]}},
            "`dependencies` of the required 'a'",
        ),
        ({"additionalProperties": True, "dependencies": {"a": ["b"]}}, "`dependencies` of 'a'"),
        ({"type": "array", "contains": {"type": "integer"}}, "`contains`"),
        ({"if": {"type": "string"}, "then": {"minLength": 2}}, "`if`/`then`/`else`"),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, "`propertyNames`"),
    ],
)
def test_unenforced_keywords_are_errors_not_silent_drops(schema, keyword):
    with pytest.raises(GrammarError, match=re.escape(keyword) + ".*cannot be enforced"):
        validate_spec("json_schema", json.dumps(schema))


@pytest.mark.parametrize(
    "schema",
    [  # each keyword is implied by the rest of the schema: accepted, and the output satisfies it
        {"type": "integer", "multipleOf": 1, "minimum": 0, "maximum": 50},
        {"type": "number", "multipleOf": 1.0},  # integers
        {"type": "object", "properties": TWO_INTS, "minProperties": 1},  # `a` made required
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 1},
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "maxItems": 3},
        {"type": "object", "properties": TWO_INTS, "required": ["a", "b"], "minProperties": 2},
        {"type": "object", "properties": TWO_INTS, "maxProperties": 2},
        {"type": "object", "properties": TWO_INTS, "required": ["b"], "dependencies": {"a": ["b"]}},
        {"type": "object", "properties": TWO_INTS, "dependentRequired": {"zzz": ["a"]}},
        {"type": "object", "properties": TWO_INTS, "dependencies": {"a": ["zzz"]}},  # `a` left out
        {"type": "object", "properties": TWO_INTS, "required": ["a"], "dependencies": {"a": ["b"]}},
        {"type": "string", "if": {"minLength": 3}},
    ],
)
def test_implied_keywords_compile_and_hold(schema):
    validator = jsonschema.Draft202012Validator(schema)
    walks = _schema_walks(schema, 60)
    for instance in walks:
        validator.validate(instance)
    if schema.get("dependencies") == {"a": ["b"]}:
        assert all("b" in inst for inst in walks)  # required `a` made `b` required
