"""JSON Schema -> regex, via outlines-core, with the fixes the served grammars need.

outlines-core's ``build_regex_from_schema`` does the structural work. Before it runs we rewrite the schema:

* numeric bounds (``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``, draft-4 boolean
  exclusives), which outlines-core ignores, become a placeholder ``const`` that is swapped for a range regex
  (``constrained.numeric``) in the output;
* ``pattern`` loses a leading ``^`` / trailing ``$`` (the whole string must match anyway; left in place they
  make the pattern unsatisfiable once embedded between quotes);
* free-form subschemas (``{}``, ``{"type": "object"}``, ``{"type": "array"}`` with nothing else) become
  our compact JSON regexes (``json_value_regex``), nested at most JSON_OBJECT_DEPTH levels at the root and
  one level below it: outlines-core's own (depth 3, ~1,600-3,300 DFA states) take 30-60 s to compile over a
  49k vocabulary, since compile time is ~linear in states x vocabulary;
* after conversion, ``\\d`` and ``\\w`` become ASCII classes: JSON Schema patterns are ECMA-262, where they
  are ASCII, and the Unicode versions multiply the automaton size (seconds of compile time for ``\\w{8}``).

* ``format`` (date-time, date, time, uuid, email, hostname, ipv4, uri, json-pointer) becomes our regex
  (``constrained.formats``); another standard format is a GrammarError, a custom one is ignored (as the
  specification says); ``minLength``/``maxLength`` become a counted ASCII string, a ``maxLength`` above
  ``formats.STRING_LENGTH_CAP`` lowered to it (output still valid), a ``minLength`` above
  ``formats.MAX_MIN_LENGTH`` a GrammarError; ``maxItems`` above ITEMS_CAP is lowered to it, ``minItems``
  above MAX_MIN_ITEMS is a GrammarError; numeric bounds beyond +-NUMERIC_BOUND_CAP are tightened to it: the
  automaton grows with each of these counts, and a 1 KB schema of ``maxLength: 8192`` fields needed 23 GB;
* ``oneOf`` is made exact first (``constrained.one_of``, shared by every backend): an ``anyOf`` of branches
  no two of which share an instance, or a GrammarError; so are an ``anyOf`` beside other keywords (merged
  into its branches) and ``const`` beside ``enum`` (``constrained.siblings``): outlines-core reads one side
  of each; an ``anyOf`` whose branches cannot take the keywords beside it is a GrammarError naming it;
* ``not`` around ``type`` or ``required``, subschemas without any keyword, ``{"not": {}}``, object/array
  ``const``/``enum``: see ``constrained.schema_keywords``; ``false`` subschemas are dropped from
  ``anyOf`` (``items: false`` means an empty array; a ``false`` property is never emitted); ``AllOf`` (a
  miscased keyword seen in real schemas) is read as ``allOf``: stricter than a validator, which ignores
  it, so output stays valid; a local ``$ref`` into a top-level key that is no keyword has its target
  rewritten too;
  ``patternProperties`` on an object without ``properties`` becomes ``additionalProperties`` (all values
  meet every pattern's subschema); ``minProperties: 1`` on a free-form object is enforced.

Keywords outlines-core does not enforce (``multipleOf``, ``uniqueItems``, ``minProperties``/``maxProperties``,
``dependencies``, ``if``/``then``/``else``, ``contains``, ...) are accepted only where the rest of the schema
already implies them (``schema_keywords.enforce_keywords``), else GrammarError naming the keyword: never a
silent drop. Keywords it cannot express (other ``not``, bad ``$ref``) raise GrammarError too.
"""

from __future__ import annotations

import json
import math
from typing import Any

from outlines_core.json_schema import build_regex_from_schema

from constrained.errors import GrammarError
from constrained.formats import (
    FORMAT_REGEXES,
    bounded_string_regex,
    cap_pattern_repeats,
    format_regex,
    format_width,
    pattern_within_length,
)
from constrained.numeric import integer_range_regex, number_range_regex
from constrained.one_of import resolve_one_of
from constrained.schema_keywords import (
    KEYWORDS,
    accepts_nothing,
    apply_not,
    const_enum_regex,
    enforce_keywords,
    has_keyword,
    pattern_properties_as_additional,
)
from constrained.siblings import exact_siblings, siblings_of

# Where subschemas live. Values under any other key are data and are copied untouched.
_MAP_KEYS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_LIST_KEYS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
_SCHEMA_KEYS = frozenset(
    {
        "items",
        "additionalProperties",
        "additionalItems",
        "not",
        "if",
        "then",
        "else",
        "contains",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
# Subschemas that may be swapped for a placeholder when free-form (map keys: always).
_FREE_FORM_OK = frozenset({"anyOf", "oneOf", "prefixItems", "items", "additionalProperties"})
_ANNOTATION_KEYS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "$id",
        "$schema",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_PLACEHOLDER = "__radixlm_fragment_{}__"
ITEMS_CAP = 16  # largest maxItems compiled as is (each item is one more copy of the item automaton)
MAX_MIN_ITEMS = 64  # larger minItems: GrammarError
NUMERIC_BOUND_CAP = 10**15  # bounds further out are tightened to this (15 digits: still exact as a double)
JSON_OBJECT_DEPTH = 2  # nesting depth of free JSON; compile time grows ~5x per level (1.1 s, 5 s, 54 s)

# A `whitespace_pattern` value that is not a regex: json.dumps's default layout, `{"a": 1, "b": [1, 2]}` --
# one space after every `,` and `:` between JSON tokens, none elsewhere, nothing optional. Every separator is
# forced, as with "" (compact), but the model reads and writes the layout it was trained on (compact JSON made
# the default model copy the wrong numbers: bench/json_decode.py extraction accuracy 0.65, vs 0.91 with this;
# see constrained.spec.DEFAULT_WHITESPACE).
DUMPS_LAYOUT = "json.dumps"
# Stands in for whitespace while outlines-core builds the regex, marking where it goes: matches only "".
_WS_MARK = "(?:[\\x00]{0})"

_STRING = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"'  # same character set as outlines-core
_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"


def json_value_regex(
    whitespace_pattern: str, depth: int, kind: str = "value", non_empty: bool = False
) -> str:
    """Any JSON value (kind="value"), object or array, with containers nested at most ``depth`` levels;
    ``non_empty``: the outermost object has at least one member (``minProperties: 1``)."""
    if whitespace_pattern == DUMPS_LAYOUT:
        return dumps_layout(json_value_regex(_WS_MARK, depth, kind, non_empty))
    ws = whitespace_pattern

    def value(d: int) -> str:
        primitive = f"{_STRING}|{_NUMBER}|true|false|null"
        return primitive if d == 0 else f"{primitive}|{obj(d)}|{arr(d)}"

    def obj(d: int) -> str:
        pair = f"{_STRING}{ws}:{ws}({value(d - 1)})"
        return rf"\{{{ws}({pair}({ws},{ws}{pair})*)?{ws}\}}"

    def arr(d: int) -> str:
        item = f"({value(d - 1)})"
        return rf"\[{ws}({item}({ws},{ws}{item})*)?{ws}\]"

    depth = max(depth, 1)
    if non_empty and kind == "object":
        pair = f"{_STRING}{ws}:{ws}({value(depth - 1)})"
        return rf"\{{{ws}{pair}({ws},{ws}{pair})*{ws}\}}"
    return {"value": value, "object": obj, "array": arr}[kind](depth)


def json_object_regex(whitespace_pattern: str, depth: int = JSON_OBJECT_DEPTH) -> str:
    """Any JSON object (the ``json_object`` response format)."""
    return json_value_regex(whitespace_pattern, depth, "object")


def schema_to_regex(
    spec: str, whitespace_pattern: str, max_recursion_depth: int = 3, patterns: list[str] | None = None
) -> str:
    """Parse ``spec`` (JSON text) and return the regex of its instances. Raises GrammarError.

    ``whitespace_pattern``: a regex allowed between any two JSON tokens ("" for none), or DUMPS_LAYOUT.
    ``patterns``, if given, receives every ``pattern`` as embedded in the regex, for separate checking.
    """
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as err:
        raise GrammarError(f"json_schema is not valid JSON: {err}") from None
    if schema is True:
        schema = {}
    if schema is False:
        raise GrammarError("json_schema `false` accepts no value")
    if not isinstance(schema, dict):
        raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
    schema = resolve_one_of(schema)
    layout = whitespace_pattern == DUMPS_LAYOUT
    ws = _WS_MARK if layout else whitespace_pattern
    fragments: list[str] = []
    rewriter = _Rewriter(ws, fragments, schema)
    rewritten = rewriter.rewrite(schema, JSON_OBJECT_DEPTH)
    _rewrite_ref_targets(schema, rewritten, rewriter)
    if patterns is not None:
        patterns.extend(ascii_digit_word_classes(p) for p in rewriter.patterns)
    try:
        regex = build_regex_from_schema(json.dumps(rewritten), ws, max_recursion_depth)
    except (ValueError, TypeError, KeyError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GrammarError(f"unsupported JSON schema: {reason}") from None
    for i, fragment in enumerate(fragments):
        regex = regex.replace(f'"{_PLACEHOLDER.format(i)}"', f"({fragment})")
    return ascii_digit_word_classes(dumps_layout(regex) if layout else regex)


def _rewrite_ref_targets(schema: Any, rewritten: Any, rewriter: _Rewriter) -> None:
    """Rewrite the subschemas a local ``$ref`` reaches under a top-level key that is no keyword, which the
    rewriter copied as data: ``{"references": {...}, "properties": {"r": {"$ref": "#/references"}}}``."""
    for ref in sorted(_local_refs(schema)):
        parts = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")]
        if parts[0] in KEYWORDS or parts[0] in _MAP_KEYS or parts[0] in _ANNOTATION_KEYS:
            continue  # rewritten (or, for annotations, never a schema) with the rest
        target = schema
        for part in parts:
            target = target.get(part) if isinstance(target, dict) else None
        if not isinstance(target, dict) or not isinstance(rewritten, dict):
            continue
        node = rewritten
        for part in parts[:-1]:
            node[part] = dict(node[part])  # copied: the data is shared with the input schema
            node = node[part]
        node[parts[-1]] = rewriter.rewrite(target, 1)


def _local_refs(node: Any) -> set[str]:
    """Every ``$ref`` of the form ``#/...`` in ``node``."""
    if isinstance(node, list):
        return set().union(*map(_local_refs, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    refs = {node["$ref"]} if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/") else set()
    return refs.union(*map(_local_refs, node.values()))


def dumps_layout(regex: str) -> str:
    """Replace the whitespace marks of a JSON regex built with ``_WS_MARK`` by json.dumps's spaces.

    Only whitespace moves: the result accepts exactly the texts the compact ("") regex accepts, with a space
    after each structural `,` and `:`. outlines-core 0.2.14 marks both sides of a separator (`mark,mark`), or
    one side where a group boundary splits it: an optional property `(mark"a"mark:mark 1 mark,)?mark"b"`, a
    comma before one `mark,(mark"b"...)?`, array items `(,mark item)`. The space goes right after the comma
    in all of these; every other mark (after `{`/`[`, before `}`/`]`, before a key) is dropped, so a shape not
    foreseen here comes out compact, never malformed.
    """
    m = _WS_MARK
    out = regex.replace(f"{m}:{m}", ": ").replace(f"{m},{m}", ", ")
    for sep in (",", ":"):
        out = out.replace(f"{m}{sep}", f"{sep} ").replace(f"{sep}{m}", f"{sep} ")
    return out.replace(m, "")


class _Rewriter:
    """Copies a schema, replacing subschemas we express better with placeholder ``const`` strings."""

    def __init__(self, whitespace_pattern: str, fragments: list[str], root: dict):
        self.ws = whitespace_pattern
        self.root = root  # for the `$ref`s exact_siblings resolves
        self.fragments = fragments  # placeholder i -> regex fragment
        self.patterns: list[str] = []  # every `pattern`, anchors stripped

    def placeholder(self, regex: str) -> dict:
        self.fragments.append(regex)
        return {"const": _PLACEHOLDER.format(len(self.fragments) - 1)}

    def rewrite(self, node: Any, free_depth: int | None) -> Any:
        """Rewrite one subschema; ``free_depth`` (None: keep as is) is the nesting allowed if it is
        free-form.
        """
        if not isinstance(node, dict):
            return node
        if "AllOf" in node:  # miscased; validators ignore it, we enforce it (stricter, so still valid)
            extra = node["AllOf"] if isinstance(node["AllOf"], list) else [node["AllOf"]]
            node = {k: v for k, v in node.items() if k != "AllOf"}
            node["allOf"] = [*(node.get("allOf") or []), *extra]
        if not has_keyword(node):
            node = {}  # only unknown keys, which validators ignore: any value
        if isinstance(node.get("allOf"), list):
            node = _merge_all_of(node)
            node = exact_siblings(node, self.root)  # the fold may put an `anyOf`/`enum` beside others
        for key in ("anyOf", "allOf"):
            beside = siblings_of(node, key)
            if beside:  # outlines-core would read one side only
                raise GrammarError(
                    f"`{key}` beside other keywords ({', '.join(beside)}) cannot be enforced by the grammar: "
                    "a subschema of it cannot be combined with them"
                )
        node = pattern_properties_as_additional(node)
        free = _free_form_kind(node) if free_depth is not None else None
        if free is not None:
            non_empty = node.get("minProperties") == 1
            return self.placeholder(json_value_regex(self.ws, free_depth, free, non_empty))
        if "oneOf" in node:  # resolve_one_of left one it did not reach: never read it as anyOf
            raise GrammarError("`oneOf` in this position cannot be enforced exactly by the grammar")
        out = {}
        for key, value in node.items():
            if key == "anyOf" and isinstance(value, list):
                value = [{} if sub is True else sub for sub in value if not accepts_nothing(sub)]
                if not value:
                    raise GrammarError(f"`{key}` has only `false` subschemas: no value is valid")
            elif key == "allOf" and isinstance(value, list):
                if any(accepts_nothing(sub) for sub in value):
                    raise GrammarError("`allOf` has a `false` subschema: no value is valid")
                value = [sub for sub in value if sub is not True]
            if key == "items" and value is False:
                out["maxItems"] = 0  # no item may be present
                continue
            if key == "items" and value is True:
                continue  # any items: outlines-core's default
            if key in _MAP_KEYS and isinstance(value, dict):
                # boolean subschemas, which outlines-core rejects: `true` is any value, a `false` property
                # can never be present
                subs = {
                    name: ({} if sub is True else sub)
                    for name, sub in value.items()
                    if not accepts_nothing(sub)
                }
                out[key] = {name: self.rewrite(sub, 1) for name, sub in subs.items()}
            elif key in _LIST_KEYS and isinstance(value, list):
                out[key] = [self.rewrite(sub, 1 if key in _FREE_FORM_OK else None) for sub in value]
            elif key in _SCHEMA_KEYS:
                out[key] = self.rewrite(value, 1 if key in _FREE_FORM_OK else None)
            else:
                out[key] = value
        declared = out.get("type")
        declared = declared if isinstance(declared, list) else [declared]
        if "properties" in out and None not in declared and "object" not in declared:
            # only objects have properties, but outlines-core reads `properties` before `type`: it made
            # `{"type": "array", "properties": {}}` an object regex (2% of jsonschemabench's Github_easy)
            del out["properties"]
        if out.get("additionalProperties") is False and "properties" not in out:
            # only `patternProperties` (ignored by outlines-core) could admit a key, and outlines-core rejects
            # a bare `additionalProperties: false`: the empty object is the instance we can promise is valid
            if (
                (None in declared or "object" in declared)
                and not out.get("required")
                and not out.get("minProperties")
            ):
                out["properties"] = {}
        if "not" in out:
            out = apply_not(out)
        out = enforce_keywords(out)
        if isinstance(out.get("pattern"), str):
            out["pattern"] = cap_pattern_repeats(strip_anchors(out["pattern"]))
            self.patterns.append(out["pattern"])
        _cap_items(out)
        fmt = out.get("format")
        if isinstance(fmt, str) and fmt not in FORMAT_REGEXES:
            if out.get("type") in (None, "string"):
                format_regex(fmt)  # raises for a standard format we cannot enforce
            del out["format"]  # a custom annotation (outlines-core would reject it)
        literal = const_enum_regex(out, spaced=self.ws == _WS_MARK)
        if literal is not None:
            return self.placeholder(literal)
        string = self._string(out)
        if string is not None:
            return string
        if "enum" in out or "const" in out or not any(k in out for k in _BOUND_KEYS):
            return out
        types = out.get("type")
        if types in ("integer", "number"):
            return self.placeholder(_bounded_number_regex(out, types))
        if isinstance(types, list) and any(t in ("integer", "number") for t in types):
            # split a multi-type schema so each numeric branch gets its own bounds
            branches = []
            for t in types:
                branch = {**out, "type": t}
                numeric = t in ("integer", "number")
                branches.append(self.placeholder(_bounded_number_regex(branch, t)) if numeric else branch)
            return {"anyOf": branches}
        return out

    def _string(self, out: dict) -> dict | None:
        """A placeholder for a string schema with ``format`` or length bounds (None: leave it to outlines)."""
        types = out.get("type")
        if "enum" in out or "const" in out or (types is not None and types != "string"):
            if isinstance(types, list) and "string" in types and _string_keys(out):
                # split a multi-type schema so the string branch gets its own regex
                return {"anyOf": [self._string({**out, "type": t}) or {**out, "type": t} for t in types]}
            return None
        if not _string_keys(out):
            return None
        lo, hi = out.get("minLength", 0), out.get("maxLength")
        for name, v in (("minLength", lo), ("maxLength", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise GrammarError(f"`{name}` must be a non-negative integer, got {v!r}")
        fmt = out.get("format")
        regex = format_regex(fmt) if isinstance(fmt, str) else None
        if regex is None:
            if isinstance(out.get("pattern"), str) and ("minLength" in out or "maxLength" in out):
                pattern = pattern_within_length(ascii_digit_word_classes(out["pattern"]), lo, hi)
                rest = {k: v for k, v in out.items() if k not in ("minLength", "maxLength", "format")}
                return {**rest, "pattern": pattern}  # outlines-core's pattern handling, length now implied
            if "pattern" in out or ("minLength" not in out and "maxLength" not in out):
                return None  # a custom format (ignored), or outlines-core's own pattern handling
            return self.placeholder(bounded_string_regex(lo, hi))
        if "pattern" in out:
            raise GrammarError(f"format {fmt!r} cannot be enforced together with a `pattern`")
        width_lo, width_hi = format_width(fmt)
        if lo > width_lo or (hi is not None and hi < width_hi):
            raise GrammarError(
                f"format {fmt!r} cannot be enforced together with minLength {lo} / maxLength {hi} (its texts "
                f"are {width_lo} to {width_hi} characters long)"
            )
        return self.placeholder(f'"{regex}"')


def _merge_all_of(node: dict) -> dict:
    """Fold ``allOf`` subschemas into the node (properties merged, required united), since outlines-core
    ignores ``allOf`` beside other keywords. Left as is when a subschema is a ``$ref`` or not an object;
    GrammarError when two subschemas set one keyword to different values (the intersection is not built)."""
    subs = node["allOf"]
    if not all(isinstance(sub, dict) and "$ref" not in sub for sub in subs) or "$ref" in node:
        return node
    out = {k: v for k, v in node.items() if k != "allOf"}
    for sub in subs:
        if isinstance(sub.get("allOf"), list):
            sub = _merge_all_of(sub)
        for key, value in sub.items():
            if key in _ANNOTATION_KEYS:
                continue
            if key == "properties" and isinstance(value, dict):
                merged = dict(out.get("properties") or {})
                for name, prop in value.items():
                    if name in merged and merged[name] != prop:
                        raise GrammarError(
                            f"`allOf` subschemas define property {name!r} differently: not enforceable"
                        )
                    merged[name] = prop
                out["properties"] = merged
            elif key == "required" and isinstance(value, list):
                out["required"] = [
                    *(out.get("required") or []),
                    *(r for r in value if r not in out.get("required", [])),
                ]
            elif key not in out:
                out[key] = value
            elif out[key] != value:
                raise GrammarError(f"`allOf` subschemas set `{key}` differently: not enforceable")
    return out


def _string_keys(node: dict) -> bool:
    return isinstance(node.get("format"), str) or "minLength" in node or "maxLength" in node


def _cap_items(node: dict) -> None:
    """Lower ``maxItems`` above ITEMS_CAP (output stays valid); refuse ``minItems`` above MAX_MIN_ITEMS."""
    lo, hi = node.get("minItems", 0), node.get("maxItems")
    for name, v in (("minItems", lo), ("maxItems", hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise GrammarError(f"`{name}` must be a non-negative integer, got {v!r}")
    if lo > MAX_MIN_ITEMS:
        raise GrammarError(
            f"minItems {lo} is above the supported limit of {MAX_MIN_ITEMS} (the automaton would be too "
            "large)"
        )
    if hi is not None and hi > max(ITEMS_CAP, lo):
        node["maxItems"] = max(ITEMS_CAP, lo)


def _free_form_kind(node: dict) -> str | None:
    """ "value", "object" or "array" when the subschema accepts any such JSON, else None."""
    keys = set(node) & KEYWORDS  # other keys are ignored by validators
    if not keys:
        return "value"
    if node.get("minProperties", 0) in (0, 1):  # 1: enforced by json_value_regex's non_empty
        keys.discard("minProperties")
    if node.get("additionalProperties", True) not in (True, {}) or keys - {"type", "additionalProperties"}:
        return None
    if node.get("type") == "object":
        return "object"
    if node.get("type") == "array" and keys == {"type"}:
        return "array"
    return None


def _bounded_number_regex(schema: dict, kind: str) -> str:
    lo, lo_excl = _bound(schema, "minimum", "exclusiveMinimum")
    hi, hi_excl = _bound(schema, "maximum", "exclusiveMaximum")
    # tighten far-out bounds (only shrinks the range, so output stays valid); a range lying entirely beyond
    # the cap keeps its bounds (numeric's digit limit still applies)
    cap = NUMERIC_BOUND_CAP
    if lo is not None and lo < -cap and (hi is None or hi >= -cap):
        lo, lo_excl = -cap, False
    if hi is not None and hi > cap and (lo is None or lo <= cap):
        hi, hi_excl = cap, False
    if kind == "integer":
        ilo = None if lo is None else (int(lo) + 1 if lo_excl and lo == int(lo) else math.ceil(lo))
        ihi = None if hi is None else (int(hi) - 1 if hi_excl and hi == int(hi) else math.floor(hi))
        return integer_range_regex(ilo, ihi)
    return number_range_regex(lo, lo_excl, hi, hi_excl)


def _bound(schema: dict, inclusive_key: str, exclusive_key: str) -> tuple[float | None, bool]:
    """(bound, exclusive) from draft-6+ numeric exclusives or draft-4 boolean ones; the tighter one wins."""
    value = schema.get(inclusive_key)
    excl = schema.get(exclusive_key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise GrammarError(f"`{inclusive_key}` must be a number, got {value!r}")
    if excl is not None and not isinstance(excl, (bool, int, float)):
        raise GrammarError(f"`{exclusive_key}` must be a number or a boolean, got {excl!r}")
    for v in (value, excl):
        if isinstance(v, float) and not math.isfinite(v):
            raise GrammarError(f"`{inclusive_key}`/`{exclusive_key}` must be finite, got {v!r}")
    if isinstance(excl, bool):  # draft 4: exclusiveMinimum: true modifies minimum
        return value, excl and value is not None
    if excl is None:
        return value, False
    if value is None:
        return excl, True
    tighter_is_excl = excl >= value if inclusive_key == "minimum" else excl <= value
    return (excl, True) if tighter_is_excl else (value, False)


def strip_anchors(pattern: str) -> str:
    """Drop a leading ``^`` and an unescaped trailing ``$``: our regexes always match the whole text."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$"):
        backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
        if backslashes % 2 == 0:
            pattern = pattern[:-1]
    return pattern


def ascii_digit_word_classes(regex: str) -> str:
    r"""Rewrite ``\d`` -> ``[0-9]`` and ``\w`` -> ``[0-9A-Za-z_]`` (bare ``0-9`` etc. inside a class)."""
    if "\\d" not in regex and "\\w" not in regex:
        return regex
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            esc = regex[i + 1]
            if esc == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif esc == "w":
                out.append("0-9A-Za-z_" if in_class else "[0-9A-Za-z_]")
            else:
                out.append(regex[i : i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            # a leading ^ and/or ] are literal parts of the class, not its end
            if regex.startswith("^", i + 1):
                out.append("^")
                i += 1
            if regex.startswith("]", i + 1):
                out.append("]")
                i += 1
        elif c == "]" and in_class:
            in_class = False
            out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)
