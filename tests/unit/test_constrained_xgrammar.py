"""The xgrammar backend: masks against brute force, jump-forward, rollback, and no silent keyword drops.

Masks are checked on grammars with a finite language: the allowed ids after a prefix are exactly the tokens
whose bytes extend the prefix towards some string of the language (EOS: the prefix is one of them). The
schema tests run on the backend's vocabulary-free check (the HTTP side's 400), without a tokenizer.
"""

from __future__ import annotations

import itertools
import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from constrained import GrammarCompiler, GrammarError, vocabulary_for
from constrained.backends import get_backend, is_available
from constrained.errors import GrammarUnsupported

pytestmark = pytest.mark.skipif(not is_available("xgrammar"), reason="xgrammar is not installed")
VOCAB_SIZE = 49152


@pytest.fixture(scope="module")
def backend():
    return get_backend("xgrammar")


@pytest.fixture(scope="module")
def vocab(default_tokenizer):
    return vocabulary_for(default_tokenizer)


def compile_grammar(backend, vocab, kind, spec, vocab_size=VOCAB_SIZE):
    text, payload = backend.build(kind, spec, "json.dumps", vocab)
    assert isinstance(payload, str)  # serialize_json: what a pool worker pipes back
    return backend.load(kind, spec, text, payload, vocab, vocab_size, 0.0, len(payload))


def brute_force_allowed(vocab, language: list[bytes], prefix: bytes) -> set[int]:
    allowed = {
        tid
        for tid, data in enumerate(vocab.token_bytes)
        if data and any(s.startswith(prefix + data) for s in language)
    }
    if prefix in language:
        allowed.add(vocab.eos_token_id)
    return allowed


ENUM_REGEX = "(red|green|blue|light blue|dark (red|green))"
ENUM_LANGUAGE = ["red", "green", "blue", "light blue", "dark red", "dark green"]
SMALL_SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": [1, 22, "x"]}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SMALL_LANGUAGE = [json.dumps({"a": a, "b": b}) for a, b in itertools.product([1, 22, "x"], [True, False])]


@pytest.mark.parametrize(
    "kind,spec,language",
    [("regex", ENUM_REGEX, ENUM_LANGUAGE), ("json_schema", json.dumps(SMALL_SCHEMA), SMALL_LANGUAGE)],
    ids=["enum-regex", "small-schema"],
)
def test_masks_match_brute_force(backend, vocab, kind, spec, language):
    grammar = compile_grammar(backend, vocab, kind, spec)
    language = [s.encode() for s in language]
    rng = random.Random(0)
    checked = 0
    for _ in range(6):
        matcher = grammar.new_matcher()
        prefix = b""
        while True:
            expected = brute_force_allowed(vocab, language, prefix)
            assert set(matcher.allowed_token_ids().tolist()) == expected, prefix
            row = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
            matcher.fill_vocab_mask(row)
            assert set(torch.nonzero(row).flatten().tolist()) == expected
            assert matcher.can_finish() == (vocab.eos_token_id in expected)
            assert matcher.is_terminated() == (expected == {vocab.eos_token_id})
            for tid in rng.sample(range(VOCAB_SIZE), 200):
                assert matcher.is_allowed(tid) == (tid in expected)
            checked += 1
            if matcher.is_terminated():
                break
            pick = rng.choice(sorted(expected - {vocab.eos_token_id}))
            matcher.accept_token(pick)
            prefix += vocab.token_bytes[pick]
        assert prefix in language
    assert checked > 12


def test_special_padding_and_control_tokens_are_never_allowed(backend, vocab, default_tokenizer):
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 300}}, "required": ["s"]}
    grammar = compile_grammar(backend, vocab, "json_schema", json.dumps(schema), vocab_size=VOCAB_SIZE + 64)
    matcher = grammar.new_matcher()
    matcher.accept_tokens(default_tokenizer.encode('{"s": "ab', add_special_tokens=False))
    row = torch.zeros(VOCAB_SIZE + 64, dtype=torch.bool)
    matcher.fill_vocab_mask(row)
    allowed = torch.nonzero(row).flatten().numpy()
    assert len(allowed) > 10_000  # inside a string: almost anything
    assert not row[VOCAB_SIZE:].any() and not any(i in vocab.special_ids for i in allowed.tolist())
    control = [i for i, b in enumerate(vocab.token_bytes) if b and min(b) < 0x20]
    assert control and not row[control].any()  # raw control bytes are not JSON
    with pytest.raises(GrammarError):
        matcher.accept_token(control[0])
    with pytest.raises(GrammarError):
        matcher.accept_token(VOCAB_SIZE + 3)


def test_long_bounded_strings_are_not_capped(backend, vocab, default_tokenizer):
    """outlines-core caps maxLength at 64 (its DFA grows per character); xgrammar keeps the bounds."""
    schema = {"type": "string", "minLength": 100, "maxLength": 120}
    grammar = compile_grammar(backend, vocab, "json_schema", json.dumps(schema))
    matcher = grammar.new_matcher()
    matcher.accept_tokens(default_tokenizer.encode('"' + "ab" * 49, add_special_tokens=False))
    quote = default_tokenizer.convert_tokens_to_ids('"')
    assert not matcher.is_allowed(quote)  # 98 characters: too short
    matcher.accept_tokens(default_tokenizer.encode("ab", add_special_tokens=False))
    assert matcher.is_allowed(quote)


def test_jump_forward_forces_keys_and_whole_characters(backend, vocab, default_tokenizer):
    one_key = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    matcher = compile_grammar(backend, vocab, "json_schema", json.dumps(one_key)).new_matcher()
    assert matcher.jump_forward_string() == '{"name": "'
    matcher.accept_tokens(default_tokenizer.encode('{"name": "Bob', add_special_tokens=False))
    assert matcher.jump_forward_string() is None  # more string or its end: a choice
    matcher.accept_tokens(default_tokenizer.encode('"', add_special_tokens=False))
    assert matcher.jump_forward_string() == "}"
    matcher.accept_tokens(default_tokenizer.encode("}", add_special_tokens=False))
    assert matcher.can_finish() and matcher.jump_forward_string() is None
    matcher.accept_token(vocab.eos_token_id)
    assert matcher.jump_forward_string() is None

    matcher = compile_grammar(backend, vocab, "regex", "éa+").new_matcher()
    assert matcher.jump_forward_string() == "éa"
    matcher.accept_token(vocab.byte_token_ids[0xC3])  # first byte of "é": mid-character
    assert matcher.jump_forward_string() is None
    matcher.accept_token(vocab.byte_token_ids[0xA9])
    assert matcher.jump_forward_string() == "a"


def test_rollback_and_reset_to(backend, vocab, default_tokenizer):
    grammar = compile_grammar(backend, vocab, "json_schema", json.dumps(SMALL_SCHEMA))
    ids = default_tokenizer.encode('{"a": 22, "b": true}', add_special_tokens=False)
    matcher, fresh = grammar.new_matcher(), grammar.new_matcher()
    matcher.accept_tokens(ids + [vocab.eos_token_id])
    assert matcher.is_terminated() and matcher.accepted_ids == ids + [vocab.eos_token_id]
    with pytest.raises(GrammarError):
        matcher.accept_token(ids[0])
    for undo in (1, 3, 2):  # EOS, then tokens
        matcher.rollback(undo)
        fresh.reset_to(matcher.accepted_ids)
        np.testing.assert_array_equal(matcher.allowed_token_ids(), fresh.allowed_token_ids())
        assert matcher.jump_forward_string() == fresh.jump_forward_string()
    with pytest.raises(ValueError):
        matcher.rollback(len(matcher.accepted_ids) + 1)
    good = ids[:4]
    matcher.reset_to(good)
    allowed = matcher.allowed_token_ids()
    with pytest.raises(GrammarError):
        matcher.reset_to(good[:2] + default_tokenizer.encode("}}", add_special_tokens=False))
    assert matcher.accepted_ids == good
    np.testing.assert_array_equal(matcher.allowed_token_ids(), allowed)
    with pytest.raises(GrammarError):  # all or nothing
        matcher.accept_tokens([ids[4], vocab.eos_token_id])
    assert matcher.accepted_ids == good


def test_compiles_in_the_capped_worker_pool(default_tokenizer, vocab):
    """The compile runs in a sandbox worker and comes back as serialize_json; masks work on this side."""
    compiler = GrammarCompiler(
        default_tokenizer,
        VOCAB_SIZE,
        vocab=vocab,
        backend="xgrammar",
        pool_limits=dict(workers=1, memory_mb=1024, timeout_s=60, queue_size=4),
    )
    try:
        grammar = compiler.compile("json_schema", json.dumps(SMALL_SCHEMA))
        assert grammar.backend == "xgrammar" and 0 < grammar.compile_seconds < 5
        assert grammar.memory_bytes() > 0 and compiler.worker_pids()
        matcher = grammar.new_matcher()
        assert matcher.jump_forward_string() == '{"a": '
        with pytest.raises(GrammarError, match="uniqueItems"):
            compiler.compile("json_schema", json.dumps({"type": "array", "uniqueItems": True}))
    finally:
        compiler.shutdown()


# ------------------------------------------------------------------------------ no silent keyword drops
REJECTED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 3}}, "contains"),
    ({"type": "array", "contains": {"const": 3}, "minContains": 2}, "contains"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
    ({"type": "object", "dependencies": {"a": ["b"]}}, "dependencies"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "properties": {"x": {"type": "integer", "not": {"const": 1}}}}, "not"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "integer", "multipleOf": 2, "minimum": 3}, "multipleOf"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength"),
    ({"type": "string", "pattern": "^(?=a)[a-z]+$"}, "look-ahead"),
    ({"type": "string", "pattern": "a^b"}, "anchor"),
    ({"type": "string", "format": "iri"}, "iri"),
    ({"type": "string", "format": "regex"}, "regex"),
    ({"$defs": {"p": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/p"}, "uniqueItems"),
    ({"$ref": "http://example.com/schema.json"}, r"\$ref"),
    # xgrammar compiles a combinator alone, dropping what stands beside it (constrained.siblings merges
    # the keywords beside an `anyOf` into its branches where it can: not two different `maxLength`s)
    (
        {"type": "string", "maxLength": 3, "anyOf": [{"maxLength": 5}, {"pattern": "^a"}]},
        r"`anyOf` beside other keywords \(maxLength, type\)",
    ),
    ({"type": "integer", "minimum": 5, "anyOf": [{"maximum": 10}, {"multipleOf": 3}]}, "multipleOf"),
    ({"type": "string", "maxLength": 3, "allOf": [{"maxLength": 5}]}, "allOf"),  # not folded (siblings)
    ({"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "minimum": 5}, r"`\$ref` beside"),
    (
        {
            "$defs": {"p": {"$ref": "#/$defs/q"}, "q": {"type": "integer"}},
            "enum": [1, "x"],
            "allOf": [{"$ref": "#/$defs/p"}],
        },
        "beside",
    ),
]


@pytest.mark.parametrize("schema,keyword", REJECTED, ids=[k for _, k in REJECTED])
def test_keywords_xgrammar_would_drop_are_errors_naming_them(backend, schema, keyword):
    with pytest.raises(GrammarError, match=keyword) as err:
        backend.check("json_schema", json.dumps(schema), "json.dumps")
    assert isinstance(err.value, ValueError)  # the HTTP layer's 400
    assert isinstance(err.value, GrammarUnsupported)  # under auto, the next backend may enforce it


ACCEPTED = [
    {
        "type": "object",
        "properties": {"not": {"type": "string"}, "if": {"type": "integer"}},
    },  # names, not keywords
    {"oneOf": [{"type": "string"}, {"type": "integer"}]},  # disjoint branches: exact
    # branches differing in `required`: made exclusive by constrained.one_of (an overlapping oneOf it cannot
    # rewrite is a 400 on every backend alike: tests/unit/test_constrained_one_of.py)
    {"type": "object", "properties": {"a": {}, "b": {}}, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
    {"allOf": [{"type": "integer", "minimum": 3}]},
    {"type": "array", "uniqueItems": False},
    {"type": "integer", "multipleOf": 7},
    {"type": "string", "format": "my-custom-format"},  # unknown formats are annotations
    {"type": "string", "minLength": 2, "maxLength": 500},
    {"title": "t", "$defs": {"q": {"type": "integer"}}, "anyOf": [{"$ref": "#/$defs/q"}, {"type": "null"}]},
    # drafts 4-7 ignore the keywords beside $ref themselves
    {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"p": {"type": "integer"}},
        "$ref": "#/definitions/p",
        "minimum": 5,
    },
]


@pytest.mark.parametrize("schema", ACCEPTED, ids=range(len(ACCEPTED)))
def test_enforced_keywords_are_accepted(backend, schema):
    assert backend.check("json_schema", json.dumps(schema), "json.dumps")


def test_enums_beside_other_keywords_are_narrowed_to_the_values_that_satisfy_them():
    from constrained.backends.xgrammar import narrow_enums

    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "enum": ["a", 1, "bb"], "minLength": 2, "title": "kept"},
            "n": {"enum": [1, 5, 9], "maximum": 4},
            "c": {"type": "integer", "const": 3},
        },
    }
    narrow_enums(schema)
    props = schema["properties"]
    assert props["s"] == {"enum": ["bb"], "title": "kept"} and props["n"] == {"enum": [1]}
    assert props["c"] == {"enum": [3]} and schema["type"] == "object"
    with pytest.raises(GrammarError, match="no `enum`/`const` value"):
        narrow_enums({"type": "integer", "const": "x"})


@pytest.mark.parametrize(
    "kind,spec,reason",
    [
        ("json_schema", "{", "not valid JSON"),
        ("json_schema", json.dumps({"type": "strin"}), "strin"),
        ("regex", r"(a)\1", "Backreference"),
        ("lark", "start: 'a'", "cannot compile a 'lark' grammar"),
    ],
)
def test_bad_specs_are_errors_with_reasons(backend, kind, spec, reason):
    with pytest.raises(GrammarError, match=reason):
        backend.check(kind, spec, "json.dumps")


def test_the_rejected_keywords_are_really_dropped_by_xgrammar():
    """Why the rejections exist: raw xgrammar (byte vocabulary) lets walks produce invalid instances."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b""], vocab_size=257, stop_token_ids=[256])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, 257)
    for schema in (
        {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "uniqueItems": True},
        {"type": "integer", "minimum": 0, "maximum": 3, "not": {"const": 1}},
    ):
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        rng, invalid = random.Random(0), 0
        for _ in range(40):
            matcher, out = xgr.GrammarMatcher(compiled), bytearray()
            while not (matcher.is_completed() and (rng.random() < 0.3 or len(out) > 40)):
                matcher.fill_next_token_bitmask(bitmask)
                bits = np.unpackbits(bitmask.numpy().view(np.uint8), count=256, bitorder="little")
                if not bits.any():  # complete, and only EOS may follow
                    break
                pick = rng.choice(np.flatnonzero(bits).tolist())
                assert matcher.accept_token(pick)
                out.append(pick)
            invalid += not jsonschema.Draft202012Validator(schema).is_valid(json.loads(out))
        assert invalid > 0, schema
