"""Grammar specs without a tokenizer: validation messages, numeric ranges, schema rewrites."""

import json
import re
from decimal import Decimal

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from constrained import GrammarError, validate_spec
from constrained.json_schema import ascii_digit_word_classes, json_object_regex, strip_anchors
from constrained.numeric import integer_range_regex, natural_range_regex, number_range_regex
from constrained.spec import regex_accepts


@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        ("regex", "a(b", "invalid regex syntax"),
        ("regex", "[a-", "invalid regex syntax"),
        ("regex", "a{3,1}", "invalid regex syntax"),
        ("regex", "(?=a)b", "look-around"),
        ("regex", r"(a)\1", "backreferences"),
        ("regex", r"\bword", "word boundaries"),
        ("regex", "a^b", "never match"),
        ("json_schema", '{"type": "object",', "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("json_schema", '{"not": {"minimum": 3}}', "`not` can only be enforced around `type` or `required`"),
        ("json_schema", '{"type": "banana"}', "unsupported JSON schema"),
        ("json_schema", '{"$ref": "#/nowhere/x"}', "unsupported JSON schema"),
        ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "unsatisfiable"),
        ("json_schema", '{"type": "number", "minimum": 0.2, "maximum": 0.8}', "narrower"),
        ("json_schema", '{"type": "string", "pattern": "(?<=a)b"}', "look-around"),
        ("grammar", "x", "unknown grammar kind"),
    ],
)
def test_validate_spec_rejects_with_reason(kind, spec, reason):
    with pytest.raises(GrammarError, match=re.escape(reason)):
        validate_spec(kind, spec)


def test_grammar_error_is_a_value_error():
    assert issubclass(GrammarError, ValueError)


def test_validate_spec_returns_the_compiled_regex():
    assert validate_spec("regex", "^[0-9]+$") == "[0-9]+"  # anchors are implied
    assert validate_spec("regex", r"price: \$") == r"price: \$"  # an escaped $ stays
    regex = validate_spec("json_schema", '{"type": "object", "properties": {"a": {"type": "boolean"}}}')
    assert re.fullmatch(regex, '{"a": true}') and re.fullmatch(regex, "{}")  # json.dumps's layout
    assert not re.fullmatch(regex, '{"a": 1}') and not re.fullmatch(regex, '{"a":true}')
    assert validate_spec("json_object", "ignored") == validate_spec("json_object", "")
    assert validate_spec("json_schema", {"type": "boolean"}) == validate_spec(
        "json_schema", '{"type": "boolean"}'
    )


def test_strip_anchors_and_ascii_classes():
    assert strip_anchors("^abc$") == "abc"
    assert strip_anchors(r"abc\$") == r"abc\$"
    assert strip_anchors(r"abc\\$") == r"abc\\"
    assert ascii_digit_word_classes(r"\d+[\w.-]\\d") == r"[0-9]+[0-9A-Za-z_.-]\\d"
    assert ascii_digit_word_classes(r"[^\d]") == r"[^0-9]"


def _canonical_numbers(regex: str, values) -> set:
    return {v for v in values if re.fullmatch(regex, str(v))}


@settings(max_examples=60, deadline=None)
@given(
    lo=st.one_of(st.none(), st.integers(-5000, 5000)),
    span=st.one_of(st.none(), st.integers(0, 20000)),
    probes=st.lists(st.integers(-30000, 30000), min_size=5, max_size=40),
)
def test_integer_range_regex_is_exact(lo, span, probes):
    hi = None if span is None else (span if lo is None else lo + span)
    regex = integer_range_regex(lo, hi)
    near = [b + d for b in (lo, hi) if b is not None for d in (-11, -10, -1, 0, 1, 9, 10)]
    for v in probes + near + [0, -1, 1]:
        inside = (lo is None or v >= lo) and (hi is None or v <= hi)
        assert bool(re.fullmatch(regex, str(v))) == inside, (lo, hi, v)
    assert not re.fullmatch(regex, "-0") and not re.fullmatch(regex, "007")


def test_natural_range_regex_exhaustive_small():
    for lo in range(0, 130, 7):
        for hi in range(lo, 1300, 97):
            regex = natural_range_regex(lo, hi)
            assert _canonical_numbers(regex, range(0, 1400)) == set(range(lo, hi + 1)), (lo, hi)


@settings(max_examples=60, deadline=None)
@given(
    lo=st.one_of(st.none(), st.integers(-300, 300)),
    span=st.one_of(st.none(), st.integers(0, 600)),
    lo_excl=st.booleans(),
    hi_excl=st.booleans(),
    probes=st.lists(st.decimals(-1000, 1000, places=3, allow_nan=False), min_size=5, max_size=40),
)
def test_number_range_regex_is_exact_for_integer_bounds(lo, span, lo_excl, hi_excl, probes):
    hi = None if span is None else (span if lo is None else lo + span)
    if lo is not None and hi is not None and lo == hi and (lo_excl or hi_excl):
        with pytest.raises(GrammarError):
            number_range_regex(lo, lo_excl, hi, hi_excl)
        return
    regex = number_range_regex(lo, lo_excl, hi, hi_excl)
    near = [
        Decimal(b) + d
        for b in (lo, hi)
        if b is not None
        for d in map(Decimal, ("-1", "-0.5", "0", "0.25", "1"))
    ]
    for v in probes + near:
        text = _json_decimal(v)
        inside = (lo is None or (v > lo if lo_excl else v >= lo)) and (
            hi is None or (v < hi if hi_excl else v <= hi)
        )
        assert bool(re.fullmatch(regex, text)) == inside, (lo, lo_excl, hi, hi_excl, text)


def _json_decimal(v: Decimal) -> str:
    text = format(v, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".") if v != v.to_integral_value() else text.split(".")[0]
    return "0" if text in ("-0", "") else text


def test_number_range_tightens_fractional_bounds_soundly():
    regex = number_range_regex(0.5, False, 10.5, True)  # acts like [1, 10]
    assert re.fullmatch(regex, "1") and re.fullmatch(regex, "9.99") and re.fullmatch(regex, "10.0")
    assert (
        not re.fullmatch(regex, "0.7") and not re.fullmatch(regex, "10.25") and not re.fullmatch(regex, "11")
    )


@pytest.mark.parametrize(
    ("schema", "valid", "invalid"),
    [
        ({"type": "integer", "minimum": -3, "exclusiveMaximum": 40}, [-3, 0, 39], [-4, 40, 1.5]),
        ({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, [0.001, 0.5, 1], [0, -0.5, 1.01]),
        (
            {
                "$schema": "http://json-schema.org/draft-04/schema#",
                "type": "integer",
                "minimum": 0,
                "exclusiveMinimum": True,
            },
            [1, 99],
            [0, -1],
        ),
        ({"type": ["integer", "null"], "maximum": 9}, [None, 9, -100], [10, "x"]),
    ],
)
def test_bounded_number_schemas(schema, valid, invalid):
    regex = validate_spec("json_schema", json.dumps(schema))
    for value in valid:
        jsonschema.validate(value, schema)
        assert re.fullmatch(regex, json.dumps(value)), value
    for value in invalid:
        assert not re.fullmatch(regex, json.dumps(value)), value


def test_free_form_subschemas_use_compact_json():
    schema = {"type": "object", "properties": {"meta": {}, "tags": {"type": "array"}}, "required": ["meta"]}
    regex = validate_spec("json_schema", json.dumps(schema), whitespace_pattern="")  # no spaces at all
    assert re.fullmatch(regex, '{"meta":{"a":1,"b":"x"},"tags":[1,"k",null]}')
    assert re.fullmatch(regex, '{"meta":3.5}')
    assert not re.fullmatch(regex, '{"meta":{"a":[1]}}')  # below the root, free JSON nests one level
    assert not re.fullmatch(regex, '{"tags":[]}')  # meta is required


def test_boolean_subschemas():
    schema = {"type": "object", "properties": {"any": True, "never": False, "n": {"type": "integer"}}}
    regex = validate_spec("json_schema", json.dumps(schema), whitespace_pattern="")
    assert re.fullmatch(regex, '{"any":[1,"x"],"n":2}') and re.fullmatch(regex, '{"n":2}')
    assert not re.fullmatch(regex, '{"never":1}')


@pytest.mark.parametrize(
    "schema",
    [
        {
            "type": "object",
            "properties": {
                "a": {"type": "integer"},
                "b": {"type": "array", "items": {"type": "integer"}},
                "c": {"type": "object", "properties": {"d": {"type": "boolean"}, "e": {}}},
                "f": {"type": "string"},
            },
            "required": ["b"],
        },
        {"type": "array", "items": {"type": "object", "properties": {"x": {"enum": [1, 2]}}}, "minItems": 1},
        {"type": "object", "additionalProperties": {"type": "integer"}},
    ],
)
def test_default_layout_is_json_dumps(schema):
    """One space after every `,` and `:` between JSON tokens, nothing else: json.dumps's default output."""
    values = {
        "object": [
            {"b": []},
            {"a": 1, "b": [1, 2]},
            {"b": [3], "c": {"d": True, "e": {"k": 1}}, "f": "x, y: z"},
        ],
        "array": [[{}], [{"x": 1}, {"x": 2}]],
    }[schema["type"]]
    if "additionalProperties" in schema:
        values = [{}, {"k": 1}, {"k": 1, "l": -2}]
    regex = validate_spec("json_schema", schema)
    compact = validate_spec("json_schema", schema, whitespace_pattern="")
    for value in values:
        jsonschema.validate(value, schema)
        assert re.fullmatch(regex, json.dumps(value)), value
        assert re.fullmatch(compact, json.dumps(value, separators=(",", ":"))), value
        if json.dumps(value) != json.dumps(value, separators=(",", ":")):
            assert not re.fullmatch(regex, json.dumps(value, separators=(",", ":"))), value
            assert not re.fullmatch(regex, json.dumps(value, indent=1)), value
    any_object = validate_spec("json_object", "")
    assert re.fullmatch(any_object, json.dumps({"a": [1, "x", None], "b": {"c": 2.5}}))
    assert not re.fullmatch(any_object, '{"a":1}')


def test_properties_do_not_make_another_type_an_object():
    array = {"type": "array", "items": {"type": "integer"}, "properties": {}, "additionalProperties": False}
    regex = validate_spec("json_schema", array)
    assert re.fullmatch(regex, "[1, 2]") and not re.fullmatch(regex, "{}")
    nullable = {"type": ["string", "null"], "properties": {"a": {"type": "integer"}}}
    regex = validate_spec("json_schema", nullable)
    assert re.fullmatch(regex, '"x"') and re.fullmatch(regex, "null") and not re.fullmatch(regex, '{"a": 1}')
    for typed in ({"type": "object"}, {"type": ["object", "null"]}, {}):  # an object, or untyped: kept
        regex = validate_spec(
            "json_schema", {**typed, "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        )
        assert re.fullmatch(regex, '{"a": 1}'), typed


def test_json_object_regex():
    regex = json_object_regex("[ ]?", depth=2)
    for obj in [{}, {"a": 1}, {"a": {"b": 2.5e3, "s": "x\\n"}, "c": None, "d": [True, -1]}]:
        assert re.fullmatch(regex, json.dumps(obj, separators=(",", ":"))), obj
        assert re.fullmatch(regex, json.dumps(obj)), obj  # one space after , and :
    for text in ["[]", "1", '"x"', '{"a":{"b":{"c":1}}}', '{"a" : 1, }', "{'a': 1}"]:
        assert not re.fullmatch(regex, text), text


def test_served_semantics_agree_with_python_re():
    """The served automaton (regex + end marker) accepts what re.fullmatch accepts,
    alternation order aside.
    """
    cases = [
        ("ab|abc", ["ab", "abc", "abcd", "a"]),
        (r"[0-9]+(\.[0-9]+)?", ["12", "12.5", "12.", ".5"]),
        (integer_range_regex(1, 15), [str(v) for v in range(-2, 20)]),
        (number_range_regex(0, False, 10, False), ["0", "10", "10.0", "1.5", "10.5", "9.99", "-0.5", "00"]),
    ]
    for regex, texts in cases:
        for text in texts:
            assert regex_accepts(regex, text) == bool(re.fullmatch(regex, text)), (regex, text)


def test_static_size_limits_are_outlines_cores_alone():
    """Schemas of real size (450 properties; 160k characters) pass every engine's shared bounds and compile
    on llguidance; outlines-core, whose automaton grows with them, refuses them naming its limit and
    itself."""
    from constrained.backends import get_backend
    from constrained.spec import (
        MAX_SCHEMA_CHARS,
        OUTLINES_MAX_SCHEMA_CHARS,
        OUTLINES_MAX_SCHEMA_PROPERTIES,
        check_size_limits,
    )
    from tests.big_schemas import long_schema, wide_schema

    wide, long = json.dumps(wide_schema(450)), json.dumps(long_schema(160_000))
    assert len(long) >= 160_000
    llguidance = get_backend("llguidance")
    for spec in (wide, long):
        check_size_limits("json_schema", spec)
        assert llguidance.check("json_schema", spec, "json.dumps")
    with pytest.raises(GrammarError) as e:
        validate_spec("json_schema", wide)
    assert str(e.value) == (
        f"json_schema has too many properties for the outlines-core engine (450; its limit is "
        f"{OUTLINES_MAX_SCHEMA_PROPERTIES}, as its automaton grows with them); the other engines have no "
        "such limit"
    )
    with pytest.raises(
        GrammarError,
        match=f"too long for the outlines-core engine .*its limit is {OUTLINES_MAX_SCHEMA_CHARS}",
    ):
        validate_spec("json_schema", long)
    validate_spec(
        "json_schema", json.dumps(wide_schema(OUTLINES_MAX_SCHEMA_PROPERTIES))
    )  # at the limit: taken
    # the shared bound is the default body size: only a spec no HTTP body could carry reaches it
    huge = json.dumps({"type": "string", "description": "x" * MAX_SCHEMA_CHARS})
    with pytest.raises(GrammarError, match=f"json_schema is too long .*the limit is {MAX_SCHEMA_CHARS}"):
        llguidance.check("json_schema", huge, "json.dumps")
