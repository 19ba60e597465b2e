"""What a JSON Schema necessarily says about its instances, and when two schemas provably share none.

``constrained.one_of`` reads branches through these facts: ``disjoint`` lets a ``oneOf`` become an
``anyOf`` as is, and the facts of a branch are what its negation is spelled with. Each fact is a necessary
condition (an instance of the schema meets it), never more: a schema the facts do not capture is marked
not ``complete``, and a disjointness not proved from the facts is reported as "not proved" (False).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from constrained.schema_keywords import JSON_TYPES, KEYWORDS, accepts_nothing

ALL_TYPES = frozenset(JSON_TYPES)
OBJECT = frozenset({"object"})
# the keywords Facts captures entirely (``not`` only around ``required`` or ``type``)
_SUMMARISED = frozenset({"type", "required", "properties", "additionalProperties", "not", "const", "enum"})


def canon(value: Any) -> str:
    """A value's identity under JSON Schema equality (1 == 1.0, true != 1)."""

    def norm(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        return v

    return json.dumps(norm(value), sort_keys=True)


def type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "null")


def types_and(a: frozenset, b: frozenset) -> frozenset:
    """Intersection, where "number" includes "integer"."""
    out = a & b
    if ("number" in a and "integer" in b) or ("integer" in a and "number" in b):
        out |= {"integer"}
    return out


def types_minus(a: frozenset, b: frozenset) -> tuple[frozenset, bool]:
    """(types of ``a`` no instance of which has a type of ``b``, exact): ``number`` minus ``integer`` has no
    JSON Schema type, so it is left out (stricter) and the result is not exact."""
    out = a - b
    if "number" in b:
        out -= {"integer"}
    exact = True
    if "integer" in b and "number" in out:
        out -= {"number"}
        exact = False
    return out, exact


class Facts:
    """What an instance of a schema necessarily is: its possible types, literal values, keys required,
    forbidden (a ``false`` property), allowed (``additionalProperties: false``), ``not: {required}`` sets,
    and the subschemas each present key's value meets. ``complete``: nothing else constrains it."""

    def __init__(self):
        self.types = ALL_TYPES
        self.values: frozenset | None = None
        self.required: frozenset = frozenset()
        self.forbidden: frozenset = frozenset()
        self.allowed: frozenset | None = None
        self.not_required: tuple = ()
        self.props: dict[str, list] = {}  # key -> the non-trivial subschemas its value meets
        self.listed: frozenset = frozenset()  # every name of ``properties``
        self.prefix: str | None = None  # every string instance starts with it (from an anchored pattern)
        self.ranges: dict[str, tuple] = {}  # "length" / "items" / "number" -> (low, high), None: unbounded
        self.complete = True

    def add(self, other: Facts) -> Facts:
        """The facts of both schemas at once (their conjunction)."""
        out = Facts()
        out.types = types_and(self.types, other.types)
        if self.values is None or other.values is None:
            out.values = self.values if other.values is None else other.values
        else:
            out.values = self.values & other.values
        out.required = self.required | other.required
        out.forbidden = self.forbidden | other.forbidden
        if self.allowed is None or other.allowed is None:
            out.allowed = self.allowed if other.allowed is None else other.allowed
        else:
            out.allowed = self.allowed & other.allowed
        out.not_required = self.not_required + other.not_required
        out.listed = self.listed | other.listed
        out.props = {k: list(v) for k, v in self.props.items()}
        for k, subs in other.props.items():
            out.props.setdefault(k, []).extend(subs)
        out.prefix = max(self.prefix or "", other.prefix or "", key=len) or None
        out.ranges = dict(self.ranges)
        for kind, (lo, hi) in other.ranges.items():
            lo0, hi0 = out.ranges.get(kind, (None, None))
            out.ranges[kind] = (_bound(max, lo0, lo), _bound(min, hi0, hi))
        out.complete = self.complete and other.complete
        return out


def facts_of(node: Any, root: dict, depth: int = 0, memo: dict | None = None) -> Facts:
    """The facts of ``node`` (``$ref``s resolved against ``root``). ``memo``: id -> (node, facts) of one
    rewrite, so that a schema whose ``$ref``s branch and recurse costs each node once."""
    memo = {} if memo is None else memo
    hit = memo.get(id(node))
    if hit is not None and hit[0] is node:
        return hit[1]
    facts = _facts(node, root, depth, memo)
    memo[id(node)] = (node, facts)  # the node is held: its id cannot be reused meanwhile
    return facts


def _facts(node: Any, root: dict, depth: int, memo: dict) -> Facts:
    facts = Facts()
    if node is True or (isinstance(node, dict) and not set(node) & KEYWORDS):
        return facts
    if accepts_nothing(node) or not isinstance(node, dict) or depth > 20:
        facts.types = frozenset() if accepts_nothing(node) else ALL_TYPES
        facts.complete = accepts_nothing(node)
        return facts
    declared = node.get("type")
    if isinstance(declared, str):
        facts.types = frozenset({declared}) & ALL_TYPES
    elif isinstance(declared, list):
        facts.types = frozenset(t for t in declared if isinstance(t, str)) & ALL_TYPES
    literals = [node["const"]] if "const" in node else node.get("enum")
    if isinstance(literals, list):
        if "const" in node and isinstance(node.get("enum"), list):
            literals = [v for v in literals if canon(v) in {canon(e) for e in node["enum"]}]
        facts.values = frozenset(canon(v) for v in literals)
        facts.types = types_and(facts.types, frozenset(type_of(v) for v in literals))
    if isinstance(node.get("pattern"), str):
        facts.prefix = pattern_prefix(node["pattern"])
    for kind, low, high in _RANGE_KEYS:
        lo, hi = node.get(low), node.get(high)
        if kind == "number":  # an exclusive bound is read as inclusive: a wider range, still a fact
            lo = _bound(max, lo, node.get("exclusiveMinimum"))
            hi = _bound(min, hi, node.get("exclusiveMaximum"))
        if _is_number(lo) or _is_number(hi):
            facts.ranges[kind] = (lo if _is_number(lo) else None, hi if _is_number(hi) else None)
    if isinstance(node.get("required"), list):
        facts.required = frozenset(k for k in node["required"] if isinstance(k, str))
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    facts.listed = frozenset(props)
    facts.forbidden = frozenset(k for k, sub in props.items() if accepts_nothing(sub))
    facts.props = {k: [sub] for k, sub in props.items() if not accepts_nothing(sub) and sub not in (True, {})}
    if node.get("additionalProperties") is False and not node.get("patternProperties"):
        facts.allowed = frozenset(props) - facts.forbidden
    elif node.get("additionalProperties", True) not in (True, {}):
        facts.complete = False
    sub_not = node.get("not")
    if isinstance(sub_not, dict) and set(sub_not) & KEYWORDS == {"required"}:
        names = sub_not["required"]
        if isinstance(names, list) and names and all(isinstance(n, str) for n in names):
            facts.not_required = (frozenset(names),)
        else:
            facts.complete = False
    elif isinstance(sub_not, dict) and set(sub_not) & KEYWORDS == {"type"}:
        facts.types, _ = types_minus(facts.types, facts_of({"type": sub_not["type"]}, root).types)
    elif "not" in node:
        facts.complete = False
    if set(node) & KEYWORDS - _SUMMARISED:
        facts.complete = False
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = resolve_ref(ref, root)
        facts = facts.add(facts_of(target, root, depth + 1, memo) if target is not None else _unknown())
    for sub in node.get("allOf") or []:
        facts = facts.add(facts_of(sub, root, depth + 1, memo))
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            subs = [facts_of(sub, root, depth + 1, memo) for sub in node[key]]
            facts.types = types_and(facts.types, frozenset().union(*(f.types for f in subs)))
            if subs and all(f.values is not None for f in subs):
                values = frozenset().union(*(f.values for f in subs))
                facts.values = values if facts.values is None else facts.values & values
            facts.complete = False
    return facts


_RANGE_KEYS = (
    ("length", "minLength", "maxLength"),
    ("items", "minItems", "maxItems"),
    ("number", "minimum", "maximum"),
)
_RANGE_TYPES = {"length": {"string"}, "items": {"array"}, "number": {"number", "integer"}}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bound(pick, a: Any, b: Any) -> Any:
    """``pick`` (min or max) of the numeric ones of a and b, None if neither is."""
    nums = [v for v in (a, b) if _is_number(v)]
    return pick(nums) if nums else None


def _admits(facts: Facts, value: str) -> bool:
    """Whether a literal (canonical JSON) could be an instance, as far as the facts tell."""
    v = json.loads(value)
    if not types_and(frozenset({type_of(v)}), facts.types):
        return False
    if facts.values is not None and value not in facts.values:
        return False
    return not (isinstance(v, str) and facts.prefix is not None and not v.startswith(facts.prefix))


def pattern_prefix(pattern: str) -> str | None:
    """The literal text every match of an anchored ``pattern`` (``^...``, no ``|``) starts with, or None."""
    if not pattern.startswith("^") or "|" in pattern:
        return None
    out: list[str] = []
    i = 1
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            lit, step = pattern[i + 1], 2
        elif c.isalnum() or c in " -_:/@,;'\"=<>!%&~`#":
            lit, step = c, 1
        else:
            break
        if pattern[i + step : i + step + 1] in ("?", "*", "{"):
            break  # the literal is optional or repeated: stop before it
        out.append(lit)
        if pattern[i + step : i + step + 1] == "+":
            break  # one or more: the first copy is certain
        i += step
    return "".join(out) or None


def _unknown() -> Facts:
    facts = Facts()
    facts.complete = False
    return facts


def resolve_ref(ref: str, root: dict) -> Any:
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def disjoint(a: Facts, b: Facts, root: dict, depth: int = 0, memo: dict | None = None) -> bool:
    """True when no instance can meet both (proved from the facts alone; False: not proved)."""
    common = types_and(a.types, b.types)
    if not common:
        return True
    if a.values is not None and b.values is not None and not a.values & b.values:
        return True
    for x, y in ((a, b), (b, a)):
        if x.values is not None and not any(_admits(y, v) for v in x.values):
            return True
    if common == {"string"} and a.prefix is not None and b.prefix is not None:
        n = min(len(a.prefix), len(b.prefix))
        if a.prefix[:n] != b.prefix[:n]:
            return True
    for kind, types in _RANGE_TYPES.items():
        if common <= types and kind in a.ranges and kind in b.ranges:
            (lo_a, hi_a), (lo_b, hi_b) = a.ranges[kind], b.ranges[kind]
            if (hi_a is not None and lo_b is not None and hi_a < lo_b) or (
                hi_b is not None and lo_a is not None and hi_b < lo_a
            ):
                return True
    if not common <= OBJECT or depth > 10:
        return False
    if a.required & b.forbidden or b.required & a.forbidden:
        return True
    for x, y in ((a, b), (b, a)):
        if x.allowed is not None and y.required - x.allowed:
            return True
    for key in a.required | b.required:
        for sa, sb in itertools.product(a.props.get(key, []), b.props.get(key, [])):
            if disjoint(facts_of(sa, root, 0, memo), facts_of(sb, root, 0, memo), root, depth + 1, memo):
                return True
    return False
