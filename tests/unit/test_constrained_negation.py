"""``constrained.negation.negate``: every schema it returns admits only instances the negated schema rejects,
and all of them when it says ``exact`` (checked with ``jsonschema`` over a universe of scalars and small
objects). Then its two users: llguidance's ``not`` (which llguidance lacks) and ``oneOf`` branches whose
exclusive instances the facts could not spell (Github_trivial o41582, o21864)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from constrained.backends import get_backend, is_available
from constrained.errors import GrammarError
from constrained.negation import negate
from tests.grammar_walks import ascii_vocab, assert_agrees_with_jsonschema, compiled
from tests.unit.test_constrained_one_of import universe
from tests.unit.test_constrained_siblings import bundled

N = {"type": "number"}
S = {"type": "string"}
NEGATED = [  # (schema, exact)
    ({"type": "string"}, True),
    ({"type": ["object", "null"]}, True),
    ({"type": "integer"}, False),  # 2.5 fails it, and "a number that is not an integer" has no type
    ({"required": ["radius", "width"]}, True),
    ({"properties": {"radius": N, "width": {"type": ["string", "null"]}}, "required": ["radius"]}, True),
    ({"type": "object", "properties": {"radius": {"properties": {"width": S}}}}, True),
    ({"enum": [True, None]}, True),
    ({"const": "circle"}, False),  # every other string fails it too: not spelled
    ({"allOf": [{"required": ["radius"]}, {"properties": {"width": N}}]}, True),
    ({"type": "string", "minLength": 2}, False),
    ({"properties": {"radius": N}, "additionalProperties": False}, False),
    ({}, True),
    (False, True),
]


@pytest.mark.parametrize("schema,exact", NEGATED, ids=[json.dumps(s)[:40] for s, _ in NEGATED])
def test_negation_admits_only_failures_and_all_of_them_when_exact(schema, exact):
    fails, said_exact = negate(schema)
    assert said_exact == exact
    cls = jsonschema.Draft202012Validator
    original, negated = cls(schema), cls({"anyOf": fails} if fails else False)
    universe_of = universe(schema if isinstance(schema, dict) else {})
    for instance in universe_of:
        if negated.is_valid(instance):
            assert not original.is_valid(instance), (instance, fails)
        elif exact:
            assert original.is_valid(instance), (instance, fails)


def test_within_leaves_out_other_types():
    assert negate({"enum": ["x"]}, within="string") == ([], False)  # nothing spelled: no spelling
    fails, exact = negate({"required": ["a"]}, within=["object", "null"])
    assert fails == [{"type": "object", "properties": {"a": False}}] and exact


@pytest.fixture(scope="module")
def vocab():
    return ascii_vocab()


# schema -> (instances jsonschema rejects, instances it accepts; the llguidance grammar must agree)
NOT_CASES = {
    "not-required": (
        {"type": "object", "properties": {"a": N, "b": N}, "not": {"required": ["a", "b"]}},
        [{"a": 1, "b": 2}], [{"a": 1}, {"b": 2}, {}],
    ),
    "not-type": ({"type": ["integer", "string"], "not": {"type": "string"}}, ["x"], [1]),
    "Github_trivial-o21864": (  # anyOf [oneOf [FirstName, LastName], not {both, strings}]
        bundled("Github_trivial", "o21864"),
        [{"Age": 1, "FirstName": "a", "LastName": "b"}, {"FirstName": "a"}], [{"Age": 1}],
    ),
}  # fmt: skip


@pytest.mark.skipif(not is_available("llguidance"), reason="llguidance is not installed")
@pytest.mark.parametrize("name", sorted(NOT_CASES))
def test_llguidance_enforces_not_by_its_negation(name, vocab):
    schema, bad, good = NOT_CASES[name]
    assert_agrees_with_jsonschema(compiled("llguidance", schema, vocab), vocab, schema, bad, good)


@pytest.mark.skipif(not is_available("llguidance"), reason="llguidance is not installed")
def test_not_without_a_spelling_stays_a_400_naming_it():
    backend = get_backend("llguidance")
    for schema, word in (
        ({"type": "string", "not": {"enum": ["intramural"]}}, "not"),  # Github_easy o83707
        ({"type": "string", "not": {"pattern": "^a"}}, "not"),
    ):
        with pytest.raises(GrammarError, match=word):
            backend.check("json_schema", json.dumps(schema), "json.dumps")
    with pytest.raises(GrammarError):  # `not` of what every value meets: nothing is valid
        backend.check("json_schema", json.dumps({"type": "number", "not": {}}), "json.dumps")
