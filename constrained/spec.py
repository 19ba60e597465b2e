r"""Turn a request's grammar spec into a regex, or a GrammarError that says why not.

``validate_spec`` is meant for the HTTP process (before anything is queued): it needs no tokenizer. A regex
(a ``regex`` spec, or each ``pattern`` of a schema) is checked by building an outlines-core Index over a
256-token vocabulary of single bytes: the byte-level DFA construction the real compile does, minus the walk
over the model's vocabulary. That is milliseconds for ordinary patterns, but it is not bounded (``\w{100}``
takes seconds), so call it off the event loop. Results are memoized: a hot spec costs a dict lookup.
"""

from __future__ import annotations

import functools
import json
import re

import outlines_core

from constrained.errors import GrammarError
from constrained.json_schema import (
    DUMPS_LAYOUT,
    JSON_OBJECT_DEPTH,
    json_object_regex,
    schema_to_regex,
    strip_anchors,
)
from constrained.vocab import END_MARKER, END_MARKER_REGEX

try:  # re's parser, used only to explain rejected patterns; `sre_parse` is its deprecated alias
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_parse  # type: ignore[no-redef]

GRAMMAR_KINDS = ("regex", "json_schema", "json_object")
# JSON laid out as json.dumps does (`{"a": 1, "b": [1, 2]}`): one line, no optional whitespace, so the model
# cannot stall on it and every separator and required key is forced -- jump-forward appends `", "key": `
# whole.
# Measured on the default model (bench/json_decode.py, 16 extraction items, jump-forward on / off):
#   `[ ]?` (optional space anywhere): accuracy 0.93 / 0.83, forward passes 90 / 90, jump-forward x1.04 -- each
#          forced run stops at a quote (`key"`, then a space-or-colon choice), a token boundary the model
#          never writes;
#   ""     (compact): passes 66 / 91, x1.50, but accuracy 0.65 / 0.64 -- without the space after `:` the model
#          copies the wrong numbers (population and year right 1 and 0 times of 16);
#   this:  accuracy 0.91 / 0.83, passes 67 / 90, x1.51.
DEFAULT_WHITESPACE = DUMPS_LAYOUT
# Size limits, checked before any automaton is built.
#
# Every engine: a spec's length is bounded by the HTTP body that carries it (--max-request-bytes, 8 MiB by
# default), so the shared limit on a schema's characters is that default body size, which only binds where
# no body does (the offline Engine, the DSL); what a schema of that size costs to compile is the capped
# compile pool's to decide (--grammar-timeout-s, --grammar-memory-mb), as llguidance compiles even very
# large schemas in milliseconds (measured, check or build over the default model's vocabulary: 450 string
# properties, 22k characters, ~12 ms; 160k characters, 470 object properties, ~50 ms).
MAX_REGEX_CHARS = 10_000
MAX_SCHEMA_CHARS = 8 << 20
# outlines-core only: its whole-schema regex becomes one DFA, whose construction grows with these (over a
# 49k vocabulary, 1000 regex alternatives or enum values take ~2-3 s; 20000 alternatives, minutes; optional
# properties expand quadratically). jsonschemabench's schemas that outlines-core compiles stay below them
# (at most 22.5k characters, 463 enum values, 130 properties).
OUTLINES_ENGINE = "outlines-core"
OUTLINES_MAX_SCHEMA_CHARS = 100_000
OUTLINES_MAX_SCHEMA_ENUM_VALUES = 1_000  # summed over every enum of a schema
OUTLINES_MAX_SCHEMA_PROPERTIES = 200  # summed over every properties map of a schema
# Nesting of the schema's JSON (objects and arrays): the deepest jsonschemabench schema has 21 levels. The
# schema compiler recurses per level, so far deeper schemas would end in a RecursionError; Python's json
# parser itself gives up near 1000 levels.
MAX_SCHEMA_DEPTH = 64


def validate_spec(kind: str, spec: str | dict, whitespace_pattern: str = DEFAULT_WHITESPACE) -> str:
    """Check a grammar spec and return the regex that will be compiled. Raises GrammarError.

    ``kind``: "regex" (full-match regex in Rust ``regex`` syntax; a leading ``^`` / trailing ``$`` is
    dropped), "json_schema" (JSON text), "json_object" (``spec`` ignored: any JSON object).
    """
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
    if kind == "json_schema" and isinstance(spec, (dict, bool)):
        spec = json.dumps(spec)  # an already-parsed schema
    if kind != "json_object" and not isinstance(spec, str):
        raise GrammarError(f"{kind} spec must be a string, got {type(spec).__name__}")
    return _validate_cached(kind, spec if kind != "json_object" else "", whitespace_pattern)


def check_size_limits(kind: str, spec: str, engine: str | None = None) -> None:
    """Refuse specs too big to compile in reasonable time, naming the limit (and the engine whose limit it
    is). Raises GrammarError. Every engine shares the length and nesting bounds; `engine` ==
    OUTLINES_ENGINE adds outlines-core's own (characters, properties, enum values), which its automaton
    needs and the other engines do not.

    Cheap (one JSON parse, no automaton), so an enormous grammar is a quick 400 instead of minutes of compile.
    """
    limit = MAX_REGEX_CHARS if kind == "regex" else MAX_SCHEMA_CHARS
    if len(spec) > limit:
        raise GrammarError(f"{kind} is too long ({len(spec)} characters; the limit is {limit})")
    if kind != "json_schema":
        return
    outlines = engine == OUTLINES_ENGINE
    if outlines and len(spec) > OUTLINES_MAX_SCHEMA_CHARS:
        raise GrammarError(
            f"json_schema is too long for the {OUTLINES_ENGINE} engine ({len(spec)} characters; its limit is "
            f"{OUTLINES_MAX_SCHEMA_CHARS}, as its automaton grows with the schema); "
            "the other engines have no such limit"
        )
    try:
        schema = json.loads(spec)
    except RecursionError:
        raise GrammarError(depth_message("far deeper than")) from None
    except json.JSONDecodeError:
        return  # schema_to_regex reports it
    enum_values = properties = 0
    todo = [(schema, 1)]
    while todo:  # iterative: a deeply nested schema must not overflow the stack here
        node, depth = todo.pop()
        if isinstance(node, (list, dict)) and depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(depth_message())
        if isinstance(node, list):
            todo.extend((item, depth + 1) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("enum"), list):
            enum_values += len(node["enum"])
        if isinstance(node.get("properties"), dict):
            properties += len(node["properties"])
        pattern = node.get("pattern")
        if isinstance(pattern, str) and len(pattern) > MAX_REGEX_CHARS:
            raise GrammarError(
                f"json_schema pattern is too long ({len(pattern)} characters; the limit is {MAX_REGEX_CHARS})"
            )
        # Data (default, examples) is walked too: skipping keys by name would let a property named "default"
        # hide its subschema from the count.
        todo.extend((value, depth + 1) for value in node.values())
    if not outlines:
        return
    for what, count, most in (
        ("enum values", enum_values, OUTLINES_MAX_SCHEMA_ENUM_VALUES),
        ("properties", properties, OUTLINES_MAX_SCHEMA_PROPERTIES),
    ):
        if count > most:
            raise GrammarError(
                f"json_schema has too many {what} for the {OUTLINES_ENGINE} engine ({count}; its limit is "
                f"{most}, as its automaton grows with them); the other engines have no such limit"
            )


def depth_message(how: str = "deeper than") -> str:
    """The 400 for a schema nested past MAX_SCHEMA_DEPTH (also used where its JSON is first parsed)."""
    return (
        f"json_schema is nested too deeply: {how} the limit of {MAX_SCHEMA_DEPTH} levels of objects and "
        "arrays"
    )


@functools.lru_cache(maxsize=1024)
def _validate_cached(kind: str, spec: str, whitespace_pattern: str) -> str:
    if kind == "json_object":
        return json_object_regex(whitespace_pattern, JSON_OBJECT_DEPTH)
    # inside the cache: a spec seen before is not parsed and walked again
    check_size_limits(kind, spec, OUTLINES_ENGINE)
    if kind == "regex":
        regex = strip_anchors(spec)
        check_regex(regex, what="regex")
        return regex
    # Only the patterns go through the DFA check: a whole schema's automaton can take minutes to build
    # (outlines-core expands optional properties quadratically), which the HTTP process must not wait for.
    patterns: list[str] = []
    regex = schema_to_regex(spec, whitespace_pattern, patterns=patterns)
    for pattern in patterns:
        check_regex(pattern, what=f"json_schema pattern {pattern!r}")
    return regex


@functools.cache
def _byte_vocabulary() -> outlines_core.Vocabulary:
    # eos id 256 is outside the map, as outlines-core requires
    return outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


@functools.lru_cache(maxsize=1024)
def check_regex(regex: str, what: str = "regex") -> None:
    """Raise GrammarError unless outlines-core can compile ``regex`` into a satisfiable automaton."""
    try:
        outlines_core.Index(regex, _byte_vocabulary())
    except ValueError as err:
        raise GrammarError(f"{what}: {_explain(regex, str(err))}") from None


def regex_accepts(regex: str, text: str) -> bool:
    """Whether a grammar compiled from ``regex`` accepts exactly ``text``, as the served grammars decide it.

    Uses the same end-marker construction as ``constrained.grammar`` over a byte vocabulary. Meant for tests
    and diagnostics (builds an Index per call).
    """
    index = _marker_byte_index(regex)
    state = index.get_initial_state()
    for byte in text.encode("utf-8"):
        state = index.get_next_state(state, byte)
        if state is None:
            return False
    return index.get_next_state(state, 256) in index.get_final_states()


@functools.lru_cache(maxsize=64)
def _marker_byte_index(regex: str) -> outlines_core.Index:
    vocab = outlines_core.Vocabulary(
        257, {**{bytes([b]): [b] for b in range(256)}, END_MARKER.encode(): [256]}
    )
    return outlines_core.Index(f"(?:{regex}){END_MARKER_REGEX}", vocab)


def _explain(regex: str, engine_message: str) -> str:
    """A human reason for an outlines-core failure (its own messages are terse: 'error building NFA')."""
    if "incompatible with the regex" in engine_message:
        return "the pattern can never match (unsatisfiable, e.g. an anchor in the middle or an empty class)"
    if "anchored" in engine_message:
        return "anchors (^, $, \\A, \\z) are only supported at the very start/end of the pattern"
    if "word boundar" in engine_message:
        return "word boundaries (\\b, \\B) are not supported"
    try:
        parsed = sre_parse.parse(regex)
    except re.error as err:
        return f"invalid regex syntax: {err}"
    except (OverflowError, RecursionError):
        return "regex is too large"
    feature = _unsupported_feature(parsed)
    if feature:
        return f"{feature} are not supported (the grammar is compiled to a finite automaton)"
    detail = engine_message.replace("Failed to build DFA", "").strip(" :")
    return f"the grammar engine rejected the pattern ({detail})"


def _unsupported_feature(parsed: sre_parse.SubPattern) -> str | None:
    """Name a construct that Python's re accepts but a DFA cannot express."""
    for op, arg in parsed.data:
        name = str(op)
        if name in ("ASSERT", "ASSERT_NOT"):
            return "look-around assertions"
        if name in ("GROUPREF", "GROUPREF_EXISTS"):
            return "backreferences"
        if name == "ATOMIC_GROUP" or name == "POSSESSIVE_REPEAT":
            return "atomic groups and possessive quantifiers"
        for sub in _children(arg):
            feature = _unsupported_feature(sub)
            if feature:
                return feature
    return None


def _children(arg: object) -> list[sre_parse.SubPattern]:
    found = []
    items = arg if isinstance(arg, (tuple, list)) else [arg]
    for item in items:
        if isinstance(item, sre_parse.SubPattern):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            found.extend(_children(item))
    return found
