"""``oneOf`` made exact before any backend compiles it: every backend calls ``resolve_one_of`` on the parsed
schema (outlines-core, llguidance and xgrammar alike), so none reads ``oneOf`` as ``anyOf``.

An instance is valid under ``{P..., "oneOf": [B_1..B_n]}`` when it meets P and exactly one B_i, i.e. one of
``P and B_i and not B_j (every j != i)``. Each ``oneOf`` becomes an ``anyOf`` of such terms:

* branches that are provably disjoint within P (``constrained.schema_facts.disjoint``: different JSON
  types or ``const``/``enum`` values, also of a property one of them requires; a key one requires that the
  other forbids or does not allow; different anchored ``pattern`` prefixes; length, item or numeric ranges
  apart) need no ``not``: the ``oneOf`` is an ``anyOf`` of P merged into each branch;
* otherwise ``not B_j`` is spelled with what B_j necessarily demands: a key it requires is absent
  (``"properties": {key: false}``), a key it forbids or does not allow is present (``required``), a type or
  ``enum`` value it excludes. Branches that differ in ``required`` (the common ``[{"required": [a]},
  {"required": [b, c]}]``) come out exact; a branch whose keys another branch always has too is dropped.
  Where B_j also constrains values the others leave open, the terms only leave out B_j's instances by
  presence (stricter, so output stays valid);
* anything else (no such spelling, P not mergeable into a branch, too many terms) is a GrammarError naming
  ``oneOf`` -- never an approximation that could emit an instance of two branches.

P is merged into each branch (``constrained.siblings.merge``: required united, properties united, a
property both constrain under ``allOf``) because outlines-core and xgrammar ignore an ``anyOf`` beside other
keywords; for the same reason every ``anyOf`` beside other keywords is merged the same way
(``constrained.siblings.exact_siblings``, applied here to every subschema).
"""

from __future__ import annotations

import json
from typing import Any

from constrained.errors import GrammarError
from constrained.negation import negate
from constrained.schema_facts import (
    ALL_TYPES,
    OBJECT,
    Facts,
    disjoint,
    facts_of,
    type_of,
    types_and,
    types_minus,
)
from constrained.schema_keywords import KEYWORDS, accepts_nothing
from constrained.siblings import UNMERGEABLE, Unsatisfiable, exact_siblings, merge

MAX_TERMS = 64  # branches a oneOf may expand to (each one is a copy of the merged object schema)
# the rewritten schema's JSON: at least this, and up to 4x the schema's own (branch copies are what grows)
MAX_REWRITTEN_CHARS = 400_000
_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_KEYS = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
                "propertyNames", "unevaluatedProperties", "unevaluatedItems")  # fmt: skip


def resolve_one_of(schema: Any) -> Any:
    """``schema`` with every ``oneOf`` rewritten as above, and every ``anyOf`` beside other keywords,
    ``const`` beside ``enum`` and ``required`` names missing from ``properties`` made exact
    (``constrained.siblings``); the input is not modified. GrammarError where one cannot be enforced
    exactly, naming why."""
    text = json.dumps(schema) if isinstance(schema, dict) else ""
    if not any(f'"{key}"' in text for key in ("oneOf", "anyOf", "allOf", "const", "enum", "required")):
        return schema
    refs = _local_refs(schema)
    if any("/oneOf/" in f"{ref}/" for ref in refs):
        raise GrammarError("`oneOf` cannot be enforced when a `$ref` points into one of its branches")
    out = _walk(schema, schema, 0)
    for ref in refs:  # subschemas under a top-level key that is no keyword, reached only by `$ref`
        top = ref[2:].split("/")[0].replace("~1", "/").replace("~0", "~")
        if top and top not in KEYWORDS and top not in _MAP_KEYS and isinstance(out.get(top), (dict, list)):
            out[top] = _walk_data(out[top], schema)
    size = len(json.dumps(out))
    limit = max(MAX_REWRITTEN_CHARS, 4 * len(text))
    if size > limit:
        key = "oneOf" if '"oneOf"' in text else "anyOf"
        raise GrammarError(
            f"`{key}` expands the schema to {size} characters (the limit is {limit}): its "
            "branches, each with the keywords beside it, are too large to enforce"
        )
    return out


def _walk_data(node: Any, root: dict, depth: int = 0) -> Any:
    """A non-keyword container a ``$ref`` reaches: its dicts may be schemas."""
    if depth > 8:
        return node
    if isinstance(node, list):
        return [_walk_data(v, root, depth + 1) for v in node]
    if isinstance(node, dict):
        return (
            _walk(node, root, depth)
            if set(node) & KEYWORDS
            else {k: _walk_data(v, root, depth + 1) for k, v in node.items()}
        )
    return node


def _walk(node: Any, root: dict, depth: int, trigger: str | None = None) -> Any:
    """``node`` with its ``oneOf``s rewritten, innermost first. ``trigger``: the node is the schema of a
    ``dependencies``/``dependentSchemas`` entry, applied only to objects holding that key."""
    if not isinstance(node, dict) or depth > 200:
        return node
    out = {}
    for key, value in node.items():
        if key == "dependentSchemas" and isinstance(value, dict):
            value = {k: _walk(v, root, depth + 1, k) for k, v in value.items()}
        elif key == "properties" and isinstance(value, dict):
            value = {k: _walk_or_false(v, root, depth + 1) for k, v in value.items()}
        elif key in _MAP_KEYS and isinstance(value, dict):
            value = {k: _walk(v, root, depth + 1) for k, v in value.items()}
        elif key in ("anyOf", "oneOf") and isinstance(value, list):
            value = [_walk_or_false(v, root, depth + 1) for v in value]
        elif key in _LIST_KEYS and isinstance(value, list):
            value = [_walk(v, root, depth + 1) for v in value]
        elif key in _SCHEMA_KEYS:
            value = _walk(value, root, depth + 1)
        elif key == "dependencies" and isinstance(value, dict):
            value = {k: _walk(v, root, depth + 1, k) for k, v in value.items()}
        out[key] = value
    if isinstance(out.get("oneOf"), list):
        out = _rewrite(out, root, trigger)
    return exact_siblings(out, root)


def _walk_or_false(node: Any, root: dict, depth: int) -> Any:
    """A property or ``anyOf``/``oneOf`` branch no value satisfies is ``false`` (never present / never
    taken) rather than a 400: the schema around it may still be satisfiable."""
    try:
        return _walk(node, root, depth)
    except Unsatisfiable:
        return False


def _local_refs(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*map(_local_refs, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    refs = {node["$ref"]} if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") else set()
    return refs.union(*map(_local_refs, node.values()))


# ------------------------------------------------------------------------------------- terms
class _Term:
    """One conjunct of the rewrite: the branch's facts narrowed by atoms that exclude the other branches."""

    __slots__ = ("types", "values", "present", "absent")

    def __init__(self, types, values, present, absent):
        self.types, self.values, self.present, self.absent = types, values, present, absent

    def key(self):
        return (self.types, self.values, self.present, self.absent)

    def covers(self, other: _Term) -> bool:
        """Every instance of ``other`` is one of ``self`` (``other`` is redundant beside it)."""
        values_ok = self.values is None or (other.values is not None and other.values <= self.values)
        return (
            other.types <= self.types
            and values_ok
            and self.present <= other.present
            and self.absent <= other.absent
        )


def _apply(term: _Term, atom: tuple, ctx: Facts) -> _Term | None:
    """``term`` narrowed by ``atom``, or None when nothing is left."""
    kind, arg = atom
    types, values, present, absent = term.types, term.values, term.present, term.absent
    if kind == "types":
        types = types_and(types, arg)
    elif kind == "values":
        values = arg if values is None else values & arg
    else:
        types = types_and(types, OBJECT)
        if kind == "absent":
            absent = absent | {arg}
        elif kind == "present":
            present = present | {arg}
        else:  # present_all
            present = present | arg
    if values is not None:
        values = frozenset(v for v in values if types_and(frozenset({type_of(json.loads(v))}), types))
        if not values:
            return None
    if not types or present & absent or present & ctx.forbidden or absent & ctx.required:
        return None
    if ctx.allowed is not None and present - ctx.allowed:
        return None
    return _Term(types, values, present, absent)


def _exclusions(ci: Facts, cj: Facts, root: dict, memo: dict) -> tuple[list, bool]:
    """(atoms each of which rules out every instance of ``cj``, whether together they rule out exactly the
    instances of ``cj`` among those of ``ci``)."""
    atoms: list[tuple] = []
    types, exact = types_minus(ci.types, cj.types)
    if types:
        atoms.append(("types", types))
    if cj.values is not None:
        if ci.values is not None and ci.values - cj.values:
            atoms.append(("values", ci.values - cj.values))
        exact = exact and ci.values is not None
    if "object" in cj.types:
        atoms += [("absent", k) for k in sorted(cj.required)]
        atoms += [("present", k) for k in sorted(cj.forbidden)]
        atoms += [("present_all", s) for s in cj.not_required]
        if cj.allowed is not None:
            names = (ci.listed | ci.required | (ci.allowed or set())) - cj.allowed
            atoms += [("present", k) for k in sorted(names)]
            exact = exact and ci.allowed is not None
        for key, subs in cj.props.items():
            implied = key in ci.forbidden or (ci.allowed is not None and key not in ci.allowed)
            if not implied and not all(sub in ci.props.get(key, []) for sub in subs):
                exact = False  # "key present with a value outside B_j's" is not spelled out
            if key not in cj.required and _values_disjoint(ci.props.get(key, []), subs, root, memo):
                # an optional discriminator: with the key present, its value (one of B_i's) is none of B_j's
                atoms.append(("present", key))
    return atoms, exact


def _values_disjoint(mine: list, theirs: list, root: dict, memo: dict) -> bool:
    """Whether no value meets every subschema of ``mine`` and every one of ``theirs`` (proved)."""
    if not mine or not theirs:
        return False
    a, b = Facts(), Facts()
    for sub in mine:
        a = a.add(facts_of(sub, root, 0, memo))
    for sub in theirs:
        b = b.add(facts_of(sub, root, 0, memo))
    return disjoint(a, b, root, 0, memo)


def _rewrite(node: dict, root: dict, trigger: str | None = None) -> dict:
    branches = [{} if b is True else b for b in node["oneOf"] if not accepts_nothing(b)]
    if not branches:
        raise GrammarError("`oneOf` has only `false` subschemas: no value is valid")
    if not all(isinstance(b, dict) for b in branches):
        raise GrammarError("`oneOf` must hold schemas (objects or booleans)")
    outer = {k: v for k, v in node.items() if k != "oneOf" and k not in KEYWORDS}
    parent = {k: v for k, v in node.items() if k != "oneOf" and k in KEYWORDS}
    memo: dict = {}
    pf = facts_of(parent, root, 0, memo)
    if trigger is not None:  # what every instance this node sees is
        known = Facts()
        known.types, known.required = OBJECT, frozenset({trigger})
        pf = pf.add(known)
    own_facts = [facts_of(b, root, 0, memo) for b in branches]
    facts = [pf.add(f) for f in own_facts]
    overlap = [
        [i != j and not disjoint(fi, fj, root, 0, memo) for j, fj in enumerate(facts)]
        for i, fi in enumerate(facts)
    ]
    merged_out: list[dict] = []
    if not any(map(any, overlap)):
        merged = [merge(parent, b, root) for b in branches]
        if any(m is UNMERGEABLE for m in merged):
            return {**outer, **parent, "anyOf": branches}  # exact; P stays beside the anyOf
        merged_out = [m for m in merged if m is not None]
    else:
        for i, branch in enumerate(branches):
            terms, exact = _terms(i, facts, overlap[i], [f.complete for f in own_facts], root, memo)
            negated = _negated_others(i, branches, overlap[i], facts[i]) if not terms and not exact else None
            if negated is not None:  # B_i and, for every overlapping B_j, a violation of it
                base = merge(parent, branch, root)
                if base is not None and base is not UNMERGEABLE:
                    merged_out.append({**base, "allOf": [*(base.get("allOf") or []), *negated]})
                    continue
            if not terms and not exact:
                raise GrammarError(
                    f"`oneOf` cannot be enforced exactly: the instances of branch {i} that match no other "
                    "branch cannot be expressed by the grammar (the branches overlap)"
                )
            if not terms:
                continue
            # a `not: {required}` is spelled by the terms themselves (absent keys)
            own = {k: v for k, v in branch.items() if not (k == "not" and own_facts[i].not_required)}
            rest = {k: v for k, v in parent.items() if not (k == "not" and pf.not_required)}
            base = merge(rest, own, root)
            if base is UNMERGEABLE:
                raise GrammarError(
                    f"`oneOf` branch {i} cannot be combined with the keywords beside the `oneOf` "
                    f"({', '.join(sorted(parent))}): not enforceable exactly"
                )
            if base is not None:
                merged_out += [_term_schema(base, t, facts[i]) for t in terms]
        if len(merged_out) > MAX_TERMS:
            raise GrammarError(
                f"`oneOf` expands to {len(merged_out)} exclusive branches (the limit is {MAX_TERMS})"
            )
        if not merged_out:
            raise GrammarError("`oneOf`: no value matches exactly one branch (every instance of a branch "
                               "meets another)")  # fmt: skip
    if not merged_out:
        raise GrammarError("`oneOf`: no branch is compatible with the keywords beside it: no value is valid")
    if len(merged_out) == 1:
        return {**outer, **merged_out[0]}
    return {**outer, "anyOf": merged_out}


def _negated_others(i: int, branches: list, overlaps: list[bool], ci: Facts) -> list | None:
    """``allOf`` items that together exclude every branch overlapping branch ``i``
    (``constrained.negation``: each an exact or stricter spelling of ``not B_j`` among the types branch
    ``i`` allows), or None when one of them cannot be spelled at all."""
    items = []
    for j, overlapping in enumerate(overlaps):
        if overlapping:
            fails, _ = negate(branches[j], within=sorted(ci.types))
            if not fails:
                return None
            items.append(fails[0] if len(fails) == 1 else {"anyOf": fails})
    return items


def _terms(
    i: int, facts: list[Facts], overlaps: list[bool], complete: list[bool], root: dict, memo: dict
) -> tuple[list[_Term], bool]:
    """The terms of branch ``i`` (instances of it and of no overlapping branch), and whether they are
    exactly those instances."""
    ci = facts[i]
    terms = [_Term(ci.types, ci.values, frozenset(), frozenset())]
    terms = [t for t in (_apply(terms[0], ("types", ci.types), ci),) if t]
    exact = True
    alternatives = [[("absent", k) for k in sorted(s)] for s in ci.not_required]
    for j, overlapping in enumerate(overlaps):
        if overlapping:
            atoms, atoms_exact = _exclusions(ci, facts[j], root, memo)
            alternatives.append(atoms)
            exact = exact and atoms_exact and complete[j]
    for atoms in alternatives:
        grown = [t2 for t in terms for a in atoms if (t2 := _apply(t, a, ci)) is not None]
        unique: dict = {}
        for t in grown:
            unique.setdefault(t.key(), t)
        terms = [t for t in unique.values() if not any(o is not t and o.covers(t) and not t.covers(o)
                                                       for o in unique.values())]  # fmt: skip
        if len(terms) > MAX_TERMS:
            raise GrammarError(f"`oneOf` expands to more than {MAX_TERMS} exclusive branches")
    return terms, exact


def _term_schema(base: dict, term: _Term, ci: Facts) -> dict:
    out = dict(base)
    if term.types != ci.types or ("type" not in out and term.types != ALL_TYPES):
        types = sorted(term.types)
        out["type"] = types[0] if len(types) == 1 else types
    if term.values is not None and term.values != ci.values:
        out.pop("const", None)
        out["enum"] = [json.loads(v) for v in sorted(term.values)]
    if term.present or term.absent:
        props = dict(out.get("properties") or {})
        extra = out.get("additionalProperties", True)
        for key in sorted(term.present):
            if key not in props:
                props[key] = extra if isinstance(extra, dict) else {}
        for key in sorted(term.absent):
            props[key] = False
        required = list(out.get("required") or [])
        out["required"] = required + sorted(term.present - set(required))
        out["properties"] = props
        if not out["required"]:
            del out["required"]
    return out
