"""Keywords beside ``anyOf`` and ``const`` beside ``enum``, made exact before any backend compiles them
(``constrained.one_of.resolve_one_of`` applies ``exact_siblings`` to every subschema, on every backend).

* ``{P..., "anyOf": [B_1..B_n]}`` accepts exactly the instances of some ``P and B_i``: it becomes an
  ``anyOf`` of P merged into each branch (``merge``: required united, properties united, a property both
  constrain merged or under ``allOf``, types and literal values intersected), because outlines-core reads
  only one side of such a node and xgrammar refuses it. Where a branch cannot be merged the node is left as
  is: llguidance enforces it, and outlines-core and xgrammar refuse it with a 400 naming ``anyOf``.
* an ``allOf`` beside other keywords is folded into them the same way (outlines-core folds only
  subschemas without ``$ref``, xgrammar refuses the node);
* ``{"enum": [...], "const": c}`` accepts only ``c``, and only if ``c`` is among the values (outlines-core
  read only ``enum``, xgrammar only ``const``): it becomes the ``const``, or a GrammarError; ``enum``
  values of a type that ``type`` excludes are dropped (outlines-core ignores ``type`` beside them).
"""

from __future__ import annotations

import json
from typing import Any

from constrained.errors import GrammarError
from constrained.schema_facts import canon, facts_of, resolve_ref, type_of, types_and
from constrained.schema_keywords import KEYWORDS, accepts_nothing


class Unsatisfiable(GrammarError):
    """A subschema no value satisfies: a 400 at the root, ``false`` as an ``anyOf`` branch or property."""


def exact_siblings(node: Any, root: dict, depth: int = 0) -> Any:
    """``node`` (its subschemas already done) with ``const`` beside ``enum`` intersected and an ``anyOf``
    beside other keywords merged into its branches, as above. GrammarError where no value is valid."""
    if not isinstance(node, dict):
        return node
    node = _fold_all_of(node, root)
    if "const" in node and isinstance(node.get("enum"), list):
        if canon(node["const"]) not in {canon(v) for v in node["enum"]}:
            raise Unsatisfiable(
                f"`const` {json.dumps(node['const'])[:80]} is not among the `enum` values: no value "
                "satisfies both"
            )
        node = {k: v for k, v in node.items() if k != "enum"}
    node = _typed_literals(node)
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    unlisted = [n for n in required if isinstance(n, str) and n not in props]
    if props and unlisted and node.get("additionalProperties", True) in (True, {}):
        # the same instances (a listed `{}` admits what an unlisted key did), but outlines-core and
        # xgrammar emit only listed keys: a required one left out made every output invalid
        node = {**node, "properties": {**props, **{n: {} for n in unlisted}}}
        props = node["properties"]
    dead = [name for name in required if isinstance(name, str) and accepts_nothing(props.get(name))]
    if dead and node.get("type") == "object":  # outlines-core and xgrammar left the name out silently
        raise Unsatisfiable(f"required property {dead[0]!r} accepts no value: no object is valid")
    branches = node.get("anyOf")
    if isinstance(branches, list) and branches and all(map(accepts_nothing, branches)):
        raise Unsatisfiable("`anyOf` has only `false` subschemas: no value is valid")
    parent = {k: v for k, v in node.items() if k != "anyOf" and k in KEYWORDS}
    if not isinstance(branches, list) or not parent or depth > 8:
        return node
    branches = [{} if b is True else b for b in branches if not accepts_nothing(b)]
    if not all(isinstance(b, dict) for b in branches):
        return node  # the backend's own error names the malformed `anyOf`
    merged = [merge(parent, b, root) for b in branches]
    if any(m is UNMERGEABLE for m in merged):
        return node
    kept = []
    for m in merged:
        try:  # a branch no value of which meets the keywords beside it is left out
            kept += [exact_siblings(m, root, depth + 1)] if m is not None else []
        except Unsatisfiable:
            continue
    if not kept:
        raise Unsatisfiable("`anyOf`: no branch is compatible with the keywords beside it: no value is valid")
    outer = {k: v for k, v in node.items() if k not in KEYWORDS}
    if len(kept) == 1:
        return {**outer, **kept[0]}
    return {**outer, "anyOf": kept}


def _fold_all_of(node: dict, root: dict) -> dict:
    """An ``allOf`` beside other keywords folded into them (a conjunction is exact), each ``$ref``
    subschema inlined; left as is where a subschema cannot be merged. GrammarError when none is valid."""
    subs = node.get("allOf")
    rest = {k: v for k, v in node.items() if k != "allOf" and k in KEYWORDS}
    if not isinstance(subs, list) or not rest or not all(isinstance(sub, dict) for sub in subs):
        return node
    out = rest
    for sub in subs:
        out = merge(out, sub, root)
        if out is UNMERGEABLE:
            return node
        if out is None:
            raise Unsatisfiable("`allOf`: its subschemas and the keywords beside it share no value")
    return {**{k: v for k, v in node.items() if k not in KEYWORDS}, **out}


def _typed_literals(node: dict) -> dict:
    """``enum`` values of a type ``type`` excludes dropped (outlines-core reads ``const``/``enum`` and not
    ``type``); GrammarError when none is left."""
    declared = node.get("type")
    key = "const" if "const" in node else "enum"
    values = [node["const"]] if key == "const" else node.get("enum")
    if declared is None or key not in node or not isinstance(values, list):
        return node
    types = facts_of({"type": declared}, {}).types
    kept = [v for v in values if types_and(frozenset({type_of(v)}), types)]
    if len(kept) == len(values):
        return node
    if not kept:
        raise Unsatisfiable(f"no `{key}` value is of the `type` {json.dumps(declared)}: no value is valid")
    return {**node, "enum": kept}


def siblings_of(node: Any, key: str) -> list[str]:
    """The keywords beside ``key`` (``anyOf``/``allOf``) in ``node`` (empty when it is absent or alone)."""
    if not isinstance(node, dict) or not isinstance(node.get(key), list):
        return []
    return sorted(k for k in node if k in KEYWORDS and k != key)


UNMERGEABLE = object()


def _names(node: dict) -> set:
    return set(node.get("properties") or {}) if isinstance(node.get("properties"), dict) else set()


def _closed(node: dict) -> bool:
    return node.get("additionalProperties", True) not in (True, {}) or bool(node.get("patternProperties"))


def merge(parent: dict, branch: dict, root: dict) -> Any:
    """One schema meeting both, or None (they share no instance), or UNMERGEABLE."""
    branch = {k: v for k, v in branch.items() if k in KEYWORDS}
    if not parent:
        return branch
    if set(branch) == {"$ref"} and isinstance(branch["$ref"], str):
        target = resolve_ref(branch["$ref"], root)  # inlined: refs inside it are absolute, valid anywhere
        if isinstance(target, dict) and "oneOf" not in json.dumps(target):
            branch = {k: v for k, v in target.items() if k in KEYWORDS}
    if "$ref" in parent or "$ref" in branch:
        return UNMERGEABLE
    for a, b in ((parent, branch), (branch, parent)):
        if _closed(a) and not _names(b) <= _names(a):
            return UNMERGEABLE  # b's names would escape a's additionalProperties
    out = dict(parent)
    for key, value in branch.items():
        if key not in out:
            out[key] = value
        elif out[key] == value:
            continue
        elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = [*out[key], *(r for r in value if r not in out[key])]
        elif key == "properties" and isinstance(value, dict) and isinstance(out[key], dict):
            props = dict(out[key])
            for name, sub in value.items():
                mine = props.get(name, True)
                if mine in (True, {}) or accepts_nothing(sub):
                    props[name] = sub
                elif sub not in (True, {}) and not accepts_nothing(mine) and sub != mine:
                    dicts = isinstance(mine, dict) and isinstance(sub, dict)
                    both = merge(mine, sub, root) if dicts else UNMERGEABLE
                    if both is UNMERGEABLE:
                        both = {"allOf": [mine, sub]}
                    props[name] = False if both is None else both  # None: no value meets both
            out[key] = props
        elif key == "type":
            both = types_and(facts_of({"type": out[key]}, {}).types, facts_of({"type": value}, {}).types)
            if not both:
                return None
            types = sorted(both)
            out[key] = types[0] if len(types) == 1 else types
        elif key in ("enum", "const"):
            continue  # below
        elif key == "allOf" and isinstance(value, list) and isinstance(out[key], list):
            out[key] = [*out[key], *value]
        else:
            return UNMERGEABLE
    literals = [[side["const"]] for side in (parent, branch) if "const" in side]
    literals += [side["enum"] for side in (parent, branch) if "enum" in side]
    if len(literals) > 1:  # one `enum` of the values all allow (outlines-core reads only one of them)
        if not all(isinstance(values, list) for values in literals):
            return UNMERGEABLE
        keep = [v for v in literals[0] if all(canon(v) in {canon(x) for x in other} for other in literals)]
        if not keep:
            return None
        out.pop("const", None)
        out["enum"] = keep
    return out
