"""JSON Schema keyword rules the schema rewriter (``constrained.json_schema``) applies before outlines-core.

Kept apart from the rewriter's walk because each rule is a statement about JSON Schema semantics, checked by
its own tests (tests/unit/test_constrained_formats.py: random walks validate with ``jsonschema``):

* a key that is no keyword of drafts 4 to 2020-12 is ignored by validators, so a subschema with no keyword at
  all (``{"typeof": "function"}``, a draft-4 ``id`` plus annotations) accepts any value (outlines-core
  rejects it as an "unsupported structure");
* ``{"not": {}}`` (or ``not: true``) accepts no value: as a property it means the property is never present;
* ``not`` is enforced around ``type`` (the complementary types) and around ``required`` (one of the named
  properties is left out of ``properties``; outlines-core emits only the listed ones);
* ``const`` / ``enum`` object and array values become escaped literal regexes: outlines-core leaves regex
  metacharacters in object keys unescaped (``{"$data": ...}`` made an unmatchable ``$``).
"""

from __future__ import annotations

import json
from typing import Any

from constrained.errors import GrammarError

# Every keyword of drafts 4 to 2020-12 that constrains a value, or points at a schema that does.
# ``definitions``/``$defs`` are not among them: they only hold subschemas for ``$ref``.
KEYWORDS = frozenset(
    {
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
        "type",
        "enum",
        "const",
        "properties",
        "patternProperties",
        "additionalProperties",
        "required",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "unevaluatedProperties",
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "minItems",
        "maxItems",
        "uniqueItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
    }
)
JSON_TYPES = ("string", "number", "integer", "object", "array", "boolean", "null")
# Characters outlines-core's regex syntax (Rust regex) treats as meta; each may be escaped with a backslash.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def has_keyword(node: dict) -> bool:
    """False when no key of ``node`` is a keyword: validators ignore the rest, so it accepts any value."""
    return not KEYWORDS.isdisjoint(node)


def accepts_nothing(sub: Any) -> bool:
    """``false``, or ``{"not": {}}`` / ``{"not": true}`` beside annotations only: no value satisfies it."""
    if sub is False:
        return True
    if not isinstance(sub, dict) or set(sub) & KEYWORDS != {"not"}:
        return False
    inner = sub["not"]
    return inner is True or (isinstance(inner, dict) and not has_keyword(inner))


def literal_regex(value: Any, spaced: bool) -> str:
    """The regex of one JSON text of ``value``: json.dumps's spacing when ``spaced``, else compact."""
    text = json.dumps(value) if spaced else json.dumps(value, separators=(",", ":"))
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def const_enum_regex(node: dict, spaced: bool) -> str | None:
    """A literal regex for a ``const`` / ``enum`` that holds an object or an array, else None (outlines-core
    builds the others correctly). GrammarError for an empty or non-list ``enum``."""
    if "const" in node:
        values = [node["const"]]
    elif "enum" in node:
        values = node["enum"]
        if not isinstance(values, list) or not values:
            raise GrammarError(f"`enum` must be a non-empty array, got {values!r}")
    else:
        return None
    if not any(isinstance(v, (dict, list)) for v in values):
        return None
    return "|".join(literal_regex(v, spaced) for v in values)


def apply_not(node: dict) -> dict:
    """Enforce ``node["not"]`` by rewriting ``node``; GrammarError where it cannot be (the 400 says which).

    ``not: {"type": ...}`` -> the complementary ``type``; ``not: {"required": [...]}`` -> an object in which
    one named property (not required by ``node`` itself) is left out of ``properties``, or the empty object
    when ``node`` lists no properties (stricter than the schema: the output stays valid).
    """
    sub = node["not"]
    keys = set(sub) & KEYWORDS if isinstance(sub, dict) else None
    if keys == {"type"}:
        return _not_type(node, sub["type"])
    if keys == {"required"}:
        return _not_required(node, sub["required"])
    if keys == set() or sub is True:
        raise GrammarError("`not: {}` accepts no value")
    shown = sorted(keys) if keys is not None else sub
    raise GrammarError(f"`not` can only be enforced around `type` or `required` alone (got {shown!r})")


def _declared_types(node: dict) -> list[str]:
    declared = node.get("type", list(JSON_TYPES))
    return declared if isinstance(declared, list) else [declared]


def _not_type(node: dict, banned: Any) -> dict:
    banned = banned if isinstance(banned, list) else [banned]
    if "number" in banned or "integer" in banned:
        banned = [*banned, "number", "integer"]  # our numbers include integers: exclude both (stricter)
    declared = _declared_types(node)
    allowed = [t for t in declared if t not in banned]
    if not allowed:
        raise GrammarError(f"`not` excludes every allowed type ({declared!r}): no value is valid")
    out = {k: v for k, v in node.items() if k != "not"}
    out["type"] = allowed[0] if len(allowed) == 1 else allowed
    return out


def _not_required(node: dict, names: Any) -> dict:
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise GrammarError(f"`required` must be an array of strings, got {names!r}")
    if not names:
        raise GrammarError("`not: {required: []}` accepts no value (every object has no required names)")
    # a non-object passes `required`, so it fails the `not`: only objects are valid
    if "object" not in _declared_types(node):
        raise GrammarError("`not: {required: ...}` admits only objects, which the schema's `type` excludes")
    own = node.get("required") or []
    out = {k: v for k, v in node.items() if k != "not"}
    out["type"] = "object"
    props = node.get("properties")
    if isinstance(props, dict):
        if any(n not in props for n in names):
            return out  # a name outlines-core never emits: the named set is never complete
        optional = [n for n in names if n not in own]
        if not optional:
            raise GrammarError(f"`not` forbids the properties {names!r} that `required` demands together")
        out["properties"] = {k: v for k, v in props.items() if k != optional[0]}
        return out
    if own:
        raise GrammarError(
            "`not: {required: ...}` cannot be enforced on an object that lists `required` names but no "
            "`properties`"
        )
    out["properties"] = {}  # the empty object: no named property is present
    out.pop("additionalProperties", None)
    return out


def pattern_properties_as_additional(node: dict) -> dict:
    """``patternProperties`` (which outlines-core ignores) on an object without ``properties`` ->
    ``additionalProperties`` holding every pattern's subschema (and the node's own ``additionalProperties``)
    under ``allOf``: each emitted value satisfies whichever patterns its key matches, so the output is valid
    (stricter than the schema: keys are free, values meet all the subschemas). Unchanged when ``properties``
    is present, ``additionalProperties`` is false (only ``{}`` is then emitted), or a subschema accepts
    nothing. Before this, such an object compiled to outlines-core's free JSON (~25 s) and ignored the
    patterns.
    """
    patterns = node.get("patternProperties")
    extra = node.get("additionalProperties", True)
    if not isinstance(patterns, dict) or not patterns or "properties" in node or extra is False:
        return node
    if "object" not in _declared_types(node):
        return node
    subs = [sub for sub in [*patterns.values(), extra] if sub is not True and sub != {}]
    if any(accepts_nothing(sub) or not isinstance(sub, dict) for sub in subs):
        return node
    out = {k: v for k, v in node.items() if k != "patternProperties"}
    out["type"] = "object"
    out["additionalProperties"] = subs[0] if len(subs) == 1 else {"allOf": subs}
    if not subs:
        out.pop("additionalProperties")
    return out


# Keywords outlines-core's regex builder does not enforce. Each is accepted only where the schema already
# implies it (``enforce_keywords``); elsewhere the request gets a 400 naming it, never a silent drop.
_NEVER_ENFORCED = (
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "dependentSchemas",
)


def enforce_keywords(node: dict) -> dict:
    """``node`` (a rewritten subschema) with ``dependencies`` enforced; GrammarError naming the first keyword
    that the grammar cannot enforce and that the rest of ``node`` does not already imply (no silent drops)."""
    for key in _NEVER_ENFORCED:
        if key in node and node[key] not in (True, {}):
            raise GrammarError(f"`{key}` cannot be enforced by the grammar")
    if "if" in node and ("then" in node or "else" in node):
        raise GrammarError("`if`/`then`/`else` cannot be enforced by the grammar")
    step = node.get("multipleOf")
    if step is not None:
        if step != 1 or node.get("type") not in ("integer", "number"):
            raise GrammarError(f"`multipleOf: {step}` cannot be enforced by the grammar (only 1, on numbers)")
        node = {**node, "type": "integer"}  # a multiple of 1 is an integer
        del node["multipleOf"]
    at_most_one = isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1
    if node.get("uniqueItems") is True and not at_most_one:
        raise GrammarError("`uniqueItems: true` cannot be enforced by the grammar (only with maxItems <= 1)")
    node = _enforce_property_counts(node)
    return enforce_dependencies(node)


def _emitted_names(node: dict) -> set[str] | None:
    """The property names an output object can hold: those of ``properties`` when no other key may appear
    (outlines-core emits only the listed ones then), else None (unbounded)."""
    props = node.get("properties")
    if not isinstance(props, dict) or node.get("additionalProperties", False) not in (False, None):
        return None
    return set(props)


def _enforce_property_counts(node: dict) -> dict:
    """``minProperties`` beyond the ``required`` names makes the first optional listed properties required
    (stricter, so valid); ``maxProperties`` holds only where no more names than that can be emitted."""
    low, high = node.get("minProperties"), node.get("maxProperties")
    required = node.get("required") if isinstance(node.get("required"), list) else []
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    optional = [name for name in props if name not in required]
    if isinstance(low, int) and len(set(required)) < low <= len(set(required)) + len(optional):
        node = {**node, "required": [*required, *optional[: low - len(set(required))]]}
        required = node["required"]
    if isinstance(low, int) and low > len(set(required)):
        raise GrammarError(
            f"`minProperties: {low}` cannot be enforced by the grammar (the object lists only "
            f"{len(set(required))} names it can require)"
        )
    if isinstance(high, int):
        names = _emitted_names(node)
        if names is None or len(names) > high:
            raise GrammarError(
                f"`maxProperties: {high}` cannot be enforced by the grammar (only when `properties` lists at "
                "most that many names and no others may appear)"
            )
    return node


def enforce_dependencies(node: dict) -> dict:
    """``dependencies`` / ``dependentRequired`` (lists of names) on an object whose emitted names are known:
    a trigger whose needed names are all required is fine; an optional trigger is left out of
    ``properties``; a required trigger makes its needed names required. Each rewrite is stricter than the
    schema, so output stays valid; a required trigger needing a name that is never emitted is a GrammarError.
    """
    names = _emitted_names(node)
    for key in ("dependencies", "dependentRequired"):
        deps = node.get(key)
        if not isinstance(deps, dict):
            continue
        for trigger, needs in deps.items():
            required = set(node.get("required") or []) if isinstance(node.get("required"), list) else set()
            if names is not None and trigger not in names:
                continue  # never present in the output
            if isinstance(needs, list) and set(needs) <= required:
                continue
            if names is None or not isinstance(needs, list):
                raise GrammarError(
                    f"`{key}` of {trigger!r} cannot be enforced by the grammar (only on an object whose "
                    "`properties` are all the names it may hold, with lists of names)"
                )
            if trigger not in required:
                node = {**node, "properties": {k: v for k, v in node["properties"].items() if k != trigger}}
                names = names - {trigger}
            elif set(needs) <= names:
                node = {**node, "required": [*node["required"], *(n for n in needs if n not in required)]}
            else:
                missing = sorted(set(needs) - names)
                raise GrammarError(
                    f"`{key}` of the required {trigger!r} cannot be enforced: it needs {missing!r}, which "
                    "`properties` does not list"
                )
    return node
