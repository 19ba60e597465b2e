"""What the llguidance backend's schema layer (``constrained.backends.llguidance._prepare``) hands the
engine: objects closed to their listed keys only where that keeps every instance valid and some instance
possible (a ``required`` name not listed, an object met by an ``allOf`` or a ``$ref`` from one, stay
satisfiable), ``dependencies`` / ``dependentRequired`` / ``dependentSchemas`` spelled exactly, and
``{"not": {}}`` as ``false``. Each shape was a 400 on jsonschemabench schemas (Github_easy: 22 "required
property is unsatisfiable", 14 ``dependencies``; Glaive: 17 ``dependencies``).

Random walks through the compiled grammar (tiny ASCII vocabulary) validate with ``jsonschema``; hand-written
instances are accepted or rejected as ``jsonschema`` says (keys in the order ``properties`` lists them, as
every backend emits them; objects with keys the schema does not list are left out on purpose: the closing
is a valid subset).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from constrained.backends import get_backend, is_available
from constrained.errors import GrammarError
from tests.grammar_walks import accepts, ascii_vocab, assert_agrees_with_jsonschema, compiled, walk

pytestmark = pytest.mark.skipif(not is_available("llguidance"), reason="llguidance is not installed")
DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "jsonschemabench"
AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
N = {"type": "number"}
D7 = "http://json-schema.org/draft-07/schema#"  # `dependencies` is a keyword up to draft 7

# name -> (schema, instances jsonschema rejects, instances it accepts; the grammar must agree)
CASES = {
    "required-name-not-listed": (  # Github_trivial o2058: `text` is required but not in `properties`
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["text", "name"]},
        [{"name": "x"}, {"text": 1}], [{"name": "x", "text": 1}, {"name": "x", "text": "t"}],
    ),
    "allOf-of-referenced-objects": (  # Github_easy o25976: each $ref'd object must stay open
        {"type": "object", "required": ["v"],
         "properties": {"v": {"allOf": [{"$ref": "#/definitions/A"}, {"$ref": "#/definitions/B"}]}},
         "definitions": {"A": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                         "B": {"type": "object", "properties": {"b": N}, "required": ["b"]}}},
        [{"v": {"a": "x"}}, {"v": {"b": 1}}], [{"v": {"a": "x", "b": 1}}],
    ),
    "allOf-ref-chain-and-oneOf-item": (  # Github_easy o78062 / o41639: a $ref to an allOf of a $ref
        {"definitions": {"named": {"type": "object", "properties": {"name": {"type": "string"}},
                                   "required": ["name"]},
                         "pets": {"allOf": [{"$ref": "#/definitions/named"},
                                            {"oneOf": [{"properties": {"dog": N}, "required": ["dog"]},
                                                       {"properties": {"cat": N}, "required": ["cat"]}]}]}},
         "type": "object", "properties": {"p": {"$ref": "#/definitions/pets"}}, "required": ["p"]},
        [{"p": {"name": "x"}}, {"p": {"name": "x", "dog": 1, "cat": 2}}, {"p": {"dog": 1}}],
        [{"p": {"name": "x", "dog": 1}}, {"p": {"name": "x", "cat": 2}}],
    ),
    "dependencies-names-optional-trigger": (  # Github_easy o68333
        {"$schema": D7, "type": "object", "properties": {"a": N, "b": N, "c": N},
         "dependencies": {"a": ["b", "c"], "b": ["a"]}},
        [{"a": 1}, {"a": 1, "b": 2}, {"b": 2}], [{}, {"c": 1}, {"a": 1, "b": 2, "c": 3}],
    ),
    "dependencies-names-required-trigger": (  # Glaive calculate_area_08e029cf: a needed name not listed
        {"$schema": D7, "type": "object", "properties": {"base": N, "height": N}, "required": ["base"],
         "dependencies": {"base": ["triangle"], "height": ["base"]}},
        [{"base": 1}, {"height": 1}],
        [{"base": 1, "triangle": True}, {"base": 1, "height": 2, "triangle": 0}],
    ),
    "dependencies-schema": (  # Glaive calculate_area_530837db's shape, with a const per trigger value
        {"$schema": D7, "type": "object",
         "properties": {"shape": {"enum": ["circle", "square"]}, "radius": N, "side": N},
         "dependencies": {"radius": {"properties": {"shape": {"const": "circle"}}, "required": ["shape"]}}},
        [{"radius": 1}, {"radius": 1, "shape": "square"}],
        [{}, {"shape": "square", "side": 2}, {"shape": "circle", "radius": 1}],
    ),
    "dependentRequired-and-dependentSchemas": (
        {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": AB,
         "dependentRequired": {"a": ["b"]}, "dependentSchemas": {"b": {"properties": {"a": {"minimum": 5}}}}},
        [{"a": 1}, {"a": 1, "b": 2}], [{}, {"b": 1}, {"a": 7, "b": 2}],
    ),
    "not-empty-property": (  # Glaive calculate_area_4c8e9fd1: `{"not": {}}` properties can never be present
        {"type": "object", "properties": {"r": N, "x": {"not": {}}}, "required": ["r"]},
        [{"r": 1, "x": 1}], [{"r": 1}],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def vocab():
    return ascii_vocab()


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_and_agrees_with_jsonschema(name, vocab):
    schema, bad, good = CASES[name]
    assert_agrees_with_jsonschema(compiled("llguidance", schema, vocab), vocab, schema, bad, good)


def test_listed_keys_only_where_nothing_else_meets_the_object(vocab):
    """The closing stays (a valid subset) on a plain object, on one whose dependencies are names, and on
    a tuple's item (positional: no other subschema meets it)."""
    for schema, wrap in (
        ({"type": "object", "properties": AB}, dict),
        ({"type": "object", "properties": AB, "dependencies": {"a": ["b"]}}, dict),
        ({"type": "array", "prefixItems": [{"type": "object", "properties": AB}], "items": False}, list),
    ):
        grammar = compiled("llguidance", schema, vocab)
        shape = (lambda o: [o]) if wrap is list else (lambda o: o)
        assert accepts(grammar, vocab, json.dumps(shape({"a": 1, "b": 2})))
        assert not accepts(grammar, vocab, json.dumps(shape({"a": 1, "b": 2, "z": 3})))


def test_unsatisfiable_schemas_stay_400s():
    backend = get_backend("llguidance")
    for schema in (
        {"type": "object", "properties": {"a": {"not": {}}}, "required": ["a"]},
        {"type": "object", "properties": {"a": N}, "required": ["a"], "additionalProperties": False,
         "dependencies": {"a": ["b"]}},
    ):  # fmt: skip
        with pytest.raises(GrammarError):
            backend.check("json_schema", json.dumps(schema), "json.dumps")


# jsonschemabench schemas llguidance refused before this layer (a required property "unsatisfiable" after
# closing, or `dependencies`): each compiles now and its walks validate
BUNDLED = {
    "Github_trivial": ["o2058"],
    "Github_easy": ["o10337", "o14479", "o21083", "o25976", "o27044", "o41639", "o47150", "o57603",
                    "o66053", "o70366", "o73930", "o78062", "o79650", "o68333"],
    "Glaiveai2K": ["calculate_area_08e029cf", "calculate_area_32f30fb2", "calculate_area_530837db",
                   "calculate_area_7eea9e32", "calculate_area_ba94e895", "calculate_area_4c8e9fd1",
                   "calculate_area_e1067200", "calculate_area_f5e0f7db"],
}  # fmt: skip


@pytest.mark.parametrize("subset", sorted(BUNDLED))
def test_bundled_schemas_refused_before_compile_and_walk_valid(subset, vocab):
    rows = [json.loads(line) for line in (DATA / f"{subset}.jsonl").read_text().splitlines() if line]
    schemas = {r["id"]: r["schema"] for r in rows}
    finished = 0
    for sid in BUNDLED[subset]:
        schema = schemas[sid]
        grammar = compiled("llguidance", schema, vocab)
        validator = jsonschema.validators.validator_for(schema)(schema)
        for seed in range(3):
            text = walk(grammar, vocab, seed)
            if text is not None:
                assert validator.is_valid(json.loads(text)), (sid, text)
                finished += 1
    assert finished >= len(BUNDLED[subset])
