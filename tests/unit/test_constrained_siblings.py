"""An ``anyOf`` beside other keywords and ``const`` beside ``enum`` are enforced exactly on every backend
(constrained.siblings), or refused with a 400 naming the keyword: outlines-core read one side of each, and
xgrammar read only ``const`` (it emitted a ``const`` outside the ``enum``).

Random walks through each backend's compiled grammar (tiny ASCII vocabulary, no model) validate with
``jsonschema`` against the original schema, and an instance violating the keyword beside is rejected.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from constrained.backends import BACKEND_NAMES, get_backend, is_available
from constrained.errors import GrammarError
from constrained.one_of import resolve_one_of
from tests.grammar_walks import accepts, ascii_vocab, assert_agrees_with_jsonschema, compiled
from tests.unit.test_constrained_one_of import compare

BACKENDS = [name for name in BACKEND_NAMES if is_available(name)]
DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "jsonschemabench"
AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}


def bundled(subset: str, sid: str) -> dict:
    rows = [json.loads(line) for line in (DATA / f"{subset}.jsonl").read_text().splitlines() if line]
    return next(r["schema"] for r in rows if r["id"] == sid)


# name -> (schema, instances it rejects, instances it accepts)
CASES = {
    "anyOf-required-beside-closed-object": (
        {"type": "object", "properties": AB, "additionalProperties": False,
         "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
        [{}], [{"a": 1}, {"b": 2}],
    ),
    "anyOf-const-property-beside-required": (
        {"properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False,
         "anyOf": [{"properties": {"a": {"const": 1}}}, {"properties": {"a": {"const": 2}}}]},
        [{"a": 3}, {}], [{"a": 1}, {"a": 2}],
    ),
    "anyOf-consts-beside-type": ({"type": "string", "anyOf": [{"const": "x"}, {"const": 1}]}, [1], ["x"]),
    "anyOf-folded-from-allOf": (  # outlines folds the allOf into the node: the anyOf lands beside `type`
        {"type": "object", "properties": AB, "additionalProperties": False,
         "allOf": [{"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}]},
        [{}], [{"a": 1}],
    ),
    "Github_trivial-o65442": (
        bundled("Github_trivial", "o65442"),
        [{"region": "x"}, {}], [{"street_address": "x"}, {"locality": "x", "country": "y"}, None, "ab"],
    ),
    "allOf-ref-beside-closed-object": (  # outlines-core read the properties, not the allOf
        {"$defs": {"p": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
         "type": "object", "properties": AB, "additionalProperties": False, "allOf": [{"$ref": "#/$defs/p"}]},
        [{}, {"b": 1}], [{"a": 1}, {"a": 1, "b": 2}],
    ),
    "property-whose-enum-the-type-excludes": (  # Github_easy o30275 (NetScaler): never present, exactly
        {"type": "object", "properties": {"a": {"type": "object", "enum": ["x"]}, "b": {"type": "integer"}},
         "required": ["b"]},
        [{"a": "x", "b": 1}], [{"b": 1}],
    ),
    "const-in-enum": ({"enum": ["a", "b"], "const": "b"}, ["a"], ["b"]),
    "required-name-not-listed": (  # Github_trivial o2058: outlines-core and xgrammar emitted only `name`
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["text", "name"]},
        [{"name": "x"}], [{"name": "x", "text": 1}],
    ),
    "enum-beside-type": ({"type": "string", "enum": ["a", 1]}, [1], ["a"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def vocab():
    return ascii_vocab()


@pytest.mark.parametrize("name", sorted(CASES))
def test_rewrite_is_exact(name):
    schema = CASES[name][0]
    assert compare(schema, resolve_one_of(schema)) == 0


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_walks_validate_and_the_keyword_beside_is_enforced(backend, name, vocab):
    schema, bad, good = CASES[name]
    try:
        grammar = compiled(backend, schema, vocab)
    except GrammarError as err:  # xgrammar refuses an `allOf` beside other keywords, by name
        assert backend == "xgrammar" and "`allOf` beside other keywords" in str(err), str(err)
        return
    assert_agrees_with_jsonschema(grammar, vocab, schema, bad, good, min_finished=3, seeds=6)


def test_const_outside_the_enum_is_a_400_everywhere():
    schema = {"enum": ["a", "b"], "const": "c"}
    for name in BACKENDS:
        with pytest.raises(GrammarError, match='`const` "c" is not among the `enum` values'):
            get_backend(name).check("json_schema", json.dumps(schema), "json.dumps")


def test_anyof_whose_branches_cannot_take_the_keywords_beside_is_enforced_or_a_400(vocab):
    """``maxLength`` on both sides is not merged: llguidance enforces the node itself; outlines-core (which
    read only the anyOf) and xgrammar refuse it by name."""
    schema = {"type": "string", "maxLength": 3, "anyOf": [{"maxLength": 5}, {"pattern": "^a"}]}
    assert resolve_one_of(schema) == schema
    for name in BACKENDS:
        if name == "llguidance":
            grammar = compiled(name, schema, vocab)
            assert not accepts(grammar, vocab, json.dumps("bbbb"))
            assert accepts(grammar, vocab, json.dumps("bbb"))
            continue
        with pytest.raises(GrammarError, match="`anyOf` beside other keywords"):
            get_backend(name).check("json_schema", json.dumps(schema), "json.dumps")


def test_anyof_no_branch_of_which_meets_the_keywords_beside_is_a_400():
    with pytest.raises(GrammarError, match="`anyOf`: no branch is compatible"):
        resolve_one_of({"type": "string", "anyOf": [{"type": "integer"}, {"const": 1}]})
    # a dead branch inside another anyOf is only left out (Github_trivial o2140)
    nested = {"anyOf": [{"type": "string"}, {"type": "array", "anyOf": [{"type": "string"}]}]}
    assert resolve_one_of(nested) == {"anyOf": [{"type": "string"}, False]}


def test_a_required_property_no_value_satisfies_is_a_400_everywhere():
    """outlines-core and xgrammar left the required name out of every output object."""
    schema = {"type": "object", "properties": {"a": {"type": "object", "enum": ["x"]}}, "required": ["a"]}
    for name in BACKENDS:
        with pytest.raises(GrammarError, match="required property 'a' accepts no value"):
            get_backend(name).check("json_schema", json.dumps(schema), "json.dumps")


@pytest.mark.parametrize("subset", ("Github_trivial", "Glaiveai2K"))
def test_bundled_anyof_beside_keywords_is_rewritten_soundly(subset):
    rows = [json.loads(line) for line in (DATA / f"{subset}.jsonl").read_text().splitlines() if line]
    rewritten = 0
    for row in rows:
        schema = row["schema"]
        if '"anyOf"' not in json.dumps(schema) and '"const"' not in json.dumps(schema):
            continue
        try:
            out = resolve_one_of(schema)
        except GrammarError:
            continue
        compare(schema, out)
        rewritten += out != schema
    assert rewritten >= 1
