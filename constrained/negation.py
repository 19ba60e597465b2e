"""``not S`` spelled with the keywords every engine has: a list of schemas whose instances all fail S.

Used where a grammar needs the instances a schema rejects (``constrained.one_of``: the instances of one
branch that match no other; the llguidance backend: a ``not`` keyword, which llguidance lacks). S fails
when any of its conditions fails, so ``not S`` is the union of each condition's violations: a type outside
``type``, a ``required`` key absent, a listed property present with a value its subschema rejects
(recursively), a value of a type no ``enum`` / ``const`` value has (or the other boolean), an ``allOf`` item
failed. Conditions that cannot be spelled (a string outside a pattern, a number that is not an integer, a
value outside a string ``enum``, an unlisted key) are left out: the union is then a subset of ``not S``
(stricter, never an instance of S), and ``exact`` says so.
"""

from __future__ import annotations

from typing import Any

from constrained.schema_facts import ALL_TYPES, canon, type_of, types_and, types_minus
from constrained.schema_keywords import KEYWORDS

MAX_DEPTH = 8  # nested properties negated
MAX_BRANCHES = 32  # more violations than this: not spelled


def negate(schema: Any, depth: int = 0, within: Any = None) -> tuple[list, bool]:
    """(schemas whose instances all fail ``schema``, whether they are all of its failures). ``within``: a
    ``type`` every instance has anyway; schemas of other types are left out (a spelling that leaves
    nothing of that type is no spelling: `not` a string ``enum`` of a string is ``([], False)``)."""
    if schema is True or (isinstance(schema, dict) and not set(schema) & KEYWORDS):
        return [], True  # everything is valid: nothing fails it
    if schema is False:
        return [{}], True
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return [], False
    out: list = []
    exact = True
    keys = set(schema) & KEYWORDS
    declared = schema.get("type")
    if declared is not None:
        types = frozenset([declared] if isinstance(declared, str) else declared) & ALL_TYPES
        others, types_exact = types_minus(ALL_TYPES, types)
        exact = exact and types_exact
        if others:
            out.append({"type": _types(others)})
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        kinds = {type_of(v) for v in values}
        if "integer" in kinds:
            kinds.add("number")  # an integral number is one of these values' type: not spelled apart
        others = ALL_TYPES - kinds
        if others:
            out.append({"type": _types(others)})
        seen = {canon(v) for v in values}
        rest = [b for b in (True, False) if "boolean" in kinds and canon(b) not in seen]
        if rest:
            out.append({"enum": rest})
        exact = exact and kinds <= {"boolean", "null"}
    names = schema.get("required")
    if isinstance(names, list):
        out += [{"type": "object", "properties": {k: False}} for k in names if isinstance(k, str)]
    props = schema.get("properties")
    if isinstance(props, dict):
        for key, sub in props.items():
            fails, sub_exact = negate(sub, depth + 1)
            exact = exact and sub_exact
            if fails:
                value = fails[0] if len(fails) == 1 else {"anyOf": fails}
                out.append({"type": "object", "required": [key], "properties": {key: value}})
    items = schema.get("allOf")
    if isinstance(items, list):
        for sub in items:
            fails, sub_exact = negate(sub, depth + 1)
            exact = exact and sub_exact
            out += fails
    if keys - {"type", "const", "enum", "required", "properties", "allOf"}:
        exact = False  # a condition not spelled
    if within is not None:
        allowed = frozenset([within] if isinstance(within, str) else within) & ALL_TYPES
        out = [b for b in out if "type" not in b or types_and(_type_set(b), allowed)]
    unique = list({canon(b): b for b in out}.values())
    if len(unique) > MAX_BRANCHES:
        return [], False
    return unique, exact


def _types(types: frozenset) -> Any:
    names = sorted(types)
    return names[0] if len(names) == 1 else names


def _type_set(schema: dict) -> frozenset:
    declared = schema["type"]
    return frozenset([declared] if isinstance(declared, str) else declared)
