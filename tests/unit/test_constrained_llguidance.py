"""The llguidance grammar backend (constrained/backends/llguidance.py) against the cursor contract: masks
and acceptance checked by brute force over the whole vocabulary for small finite languages, forced strings,
rollback, termination, strict JSON Schema keywords, no bounded-string relaxation, the lark kind, per-request
fallback under auto, and the sandbox."""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch

from constrained import GrammarCompiler
from constrained.backends import BACKEND_NAMES, backend_chain, choose_backend, get_backend
from constrained.compile_pool import CompilePool
from constrained.errors import GrammarError, GrammarUnsupported
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs

# Finite languages: every string the grammar accepts, listed, so masks can be checked by brute force.
FINITE = [
    ("lark", 'start: "yes" | "no" | "maybe " ("so" | "not")', ["yes", "no", "maybe so", "maybe not"]),
    ("regex", "(ab|abc)d?", ["ab", "abc", "abd", "abcd"]),
    ("json_schema", json.dumps({"enum": ["red", "green", 7]}), ['"red"', '"green"', "7"]),
    (
        "json_schema",
        json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            }
        ),
        ['{"ok": true}', '{"ok": false}'],
    ),
]


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    c = GrammarCompiler(default_tokenizer, len(default_tokenizer) + 64, backend="llguidance")
    yield c
    c.shutdown()


def mask_of(matcher, width: int) -> np.ndarray:
    row = torch.zeros(width, dtype=torch.bool)
    matcher.fill_vocab_mask(row)
    return row.numpy().copy()


def brute_force_mask(vocab, width: int, done: bytes, language: list[bytes]) -> np.ndarray:
    """Allowed ids by definition: a token whose bytes extend ``done`` to a prefix of a string of the
    language; EOS when ``done`` is one of them. Ids without bytes (special) and past the tokenizer: never."""
    out = np.zeros(width, dtype=bool)
    for tid, data in enumerate(vocab.token_bytes):
        if data and any(s.startswith(done + data) for s in language):
            out[tid] = True
    out[vocab.eos_token_id] = done in language
    return out


@pytest.mark.parametrize("kind,spec,strings", FINITE, ids=["lark", "regex", "enum", "object"])
def test_masks_equal_brute_force(compiler, kind, spec, strings):
    grammar = compiler.compile(kind, spec)
    assert grammar.backend == "llguidance"
    vocab, width = compiler.vocab, compiler.vocab_size
    language = [s.encode() for s in strings]
    rng = random.Random(0)
    for _ in range(6):  # random walks through the language
        m = grammar.new_matcher()
        done = b""
        while True:
            expected = brute_force_mask(vocab, width, done, language)
            got = mask_of(m, width)
            # acceptance is byte-level: exactly the brute-force set (jump-forward re-tokenizes freely)
            for tid in np.flatnonzero(expected).tolist() + rng.sample(range(width), 50):
                assert m.is_allowed(tid) == expected[tid], (kind, done, tid)
            if m.jump_forward_string() is None:
                assert (got == expected).all(), (kind, done, np.flatnonzero(got ^ expected)[:10])
            else:
                # a forced stretch: llguidance offers the forced text's own tokenization, a subset
                assert got.any() and not (got & ~expected).any(), (kind, done)
            assert sorted(m.allowed_token_ids().tolist()) == np.flatnonzero(got).tolist()
            assert m.can_finish() == (done in language)
            choices = np.flatnonzero(got if rng.random() < 0.5 else expected).tolist()
            tid = rng.choice(choices)
            if tid == vocab.eos_token_id:
                m.accept_token(tid)
                assert m.is_terminated() and m.accepted_ids[-1] == tid
                with pytest.raises(GrammarError):
                    m.accept_token(choices[0])
                break
            m.accept_token(tid)
            done += vocab.token_bytes[tid]
        assert done in language


def test_start_mask_is_computed_once_and_shared(compiler):
    """Every request's first mask is the grammar's start mask: llguidance computes it once (50-100 µs a
    request otherwise); a matcher back at the start reads it again, one further along computes its own."""
    vocab, width = compiler.vocab, compiler.vocab_size
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = compiler.compile("json_schema", json.dumps(schema))
    first = grammar.new_matcher()
    start = mask_of(first, width)
    assert grammar.start_bits is not None and not grammar.start_bits.flags.writeable
    assert start.any() and not start[vocab.eos_token_id]
    row = torch.zeros(width, dtype=torch.bool)
    first.fill_vocab_mask(row)
    row[:] = True  # a caller's row is a copy: the shared mask is untouched
    second = grammar.new_matcher()
    assert (mask_of(second, width) == start).all()
    second.accept_tokens(vocab.encode_bytes_greedy(b'{"'))
    assert not (mask_of(second, width) == start).all()
    second.rollback(len(second.accepted_ids))
    assert (mask_of(second, width) == start).all()
    grammar.start_bits = None  # computed afresh: the same mask
    assert (mask_of(grammar.new_matcher(), width) == start).all()


def test_start_mask_is_ready_when_the_grammar_is_loaded(compiler):
    """load computes the start mask (off the scheduler's step, warming the lexer every copy shares): it is
    there before any request, EOS set exactly when the empty output is accepted, and equal to the mask a
    matcher computes itself; the template is untouched by it."""
    vocab, width = compiler.vocab, compiler.vocab_size
    a_id = vocab.byte_token_ids[ord("a")]
    for spec, empty_ok in (("(ab)*", True), ("(ab)+", False)):
        grammar = compiler.compile("regex", spec)
        start = grammar.start_bits
        assert start is not None and not start.flags.writeable
        assert start[vocab.eos_token_id] == empty_ok and start[a_id]
        expected = brute_force_mask(vocab, width, b"", [b"ab" * k for k in range(1, 9)])
        expected[vocab.eos_token_id] = empty_ok
        assert (start == expected[: len(start)]).all()
        grammar.start_bits = None  # a matcher of the template computes the same itself
        assert (mask_of(grammar.new_matcher(), width)[: len(start)] == start).all()
        m = grammar.new_matcher()
        m.accept_tokens(vocab.encode_bytes_greedy(b"abab"))
        assert m.can_finish()


def test_forced_text_is_tokenized_once(default_tokenizer):
    """In a forced stretch llguidance asks the backend for the forced text's tokenization at every mask
    (its mask offers the first token of it): the tokenizer runs once per text, a later request of the
    grammar reads the memo and gets the same tokens."""
    from constrained.backends import register_text_tokenizer
    from constrained.vocab import build_vocabulary

    calls = []

    class Counting:
        def encode(self, text, **kwargs):
            calls.append(text)
            return default_tokenizer.encode(text, **kwargs)

    vocab = build_vocabulary(default_tokenizer)  # its own vocabulary: its own llguidance tokenizer
    register_text_tokenizer(vocab, Counting())
    backend = get_backend("llguidance")
    forced = '<tool_call>\n{"name": "get_weather", "arguments": '
    spec = f"start: {json.dumps(forced)} /[0-9]/"
    text, payload = backend.build("lark", spec, "json.dumps", vocab)
    grammar = backend.load("lark", spec, text, payload, vocab, len(default_tokenizer) + 64, 0.0, 0)

    def walk() -> list[int]:
        m, ids = grammar.new_matcher(), []
        while m.jump_forward_string():
            allowed = m.allowed_token_ids().tolist()
            assert len(allowed) == 1
            m.accept_token(allowed[0])
            ids.append(allowed[0])
        return ids

    first = walk()
    assert vocab.decode_bytes(first) == forced.encode() and len(first) > 2
    seen = len(calls)
    assert seen >= len(first) - 1  # every mask past the start one (computed at load) asked
    assert walk() == first and len(calls) == seen


def test_rejects_disallowed_tokens_and_keeps_state(compiler):
    g = compiler.compile("regex", "[0-9]{2}")
    m = g.new_matcher()
    digit = compiler.vocab.byte_token_ids[ord("4")]
    letter = compiler.vocab.byte_token_ids[ord("x")]
    for bad in (letter, compiler.vocab.eos_token_id, compiler.vocab_size - 1, -1):
        assert not m.is_allowed(bad)
        with pytest.raises(GrammarError):
            m.accept_token(bad)
    m.accept_token(digit)  # the matcher did not enter llguidance's error state
    with pytest.raises(GrammarError):
        m.accept_tokens([digit, letter])  # all or nothing
    assert m.accepted_ids == [digit]
    m.accept_token(digit)
    assert m.can_finish() and m.is_terminated()


def test_rollback_and_reset_to(compiler):
    g = compiler.compile(
        "json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
    )
    tok = compiler.tokenizer
    ids = tok.encode('{"n": 12}', add_special_tokens=False)
    m = g.new_matcher()
    masks = [mask_of(m, compiler.vocab_size)]
    for tid in ids:
        m.accept_token(tid)
        masks.append(mask_of(m, compiler.vocab_size))
    m.accept_token(compiler.vocab.eos_token_id)
    m.rollback(1)  # over EOS
    assert m.accepted_ids == ids and m.can_finish() and m.is_allowed(compiler.vocab.eos_token_id)
    for k in range(len(ids), 0, -1):
        m.rollback(1)
        assert (mask_of(m, compiler.vocab_size) == masks[k - 1]).all()
    assert m.accepted_ids == []
    with pytest.raises(ValueError):
        m.rollback(1)
    m.reset_to(ids[:2])
    assert m.accepted_ids == ids[:2]
    bad = ids[:4] + tok.encode("x", add_special_tokens=False)  # {"n": x
    with pytest.raises(GrammarError):
        m.reset_to(bad)
    assert m.accepted_ids == ids[:2]  # unchanged after a failed reset
    m.reset_to(ids)
    assert m.can_finish() and (mask_of(m, compiler.vocab_size) == masks[-1]).all()


def test_can_finish_and_terminated(compiler):
    vocab = compiler.vocab
    m = compiler.compile("regex", "ab|abc").new_matcher()
    m.accept_tokens(vocab.encode_bytes_greedy(b"ab"))
    assert m.can_finish() and not m.is_terminated()  # `c` may still follow
    m.accept_token(vocab.byte_token_ids[ord("c")])
    assert m.can_finish() and m.is_terminated()
    assert m.allowed_token_ids().tolist() == [vocab.eos_token_id]


def test_jump_forward_strings(compiler):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    m = compiler.compile("json_schema", json.dumps(schema)).new_matcher()
    assert m.jump_forward_string() == '{"name": "'
    tok = compiler.tokenizer
    keep, new = compiler.plan_jump_forward([], m.jump_forward_string())
    m.reset_to(new)
    m.accept_tokens(tok.encode('Bob"', add_special_tokens=False))
    assert m.jump_forward_string() == ', "age": '
    out = m.accepted_ids
    keep, new = compiler.plan_jump_forward(out, ', "age": ')
    m.reset_to(out[:keep] + new)  # the retokenized plan is accepted
    assert compiler.vocab.decode_bytes(m.accepted_ids) == b'{"name": "Bob", "age": '
    assert m.jump_forward_string() is None  # digits: a choice
    lark = compiler.compile("lark", 'start: "call " ("get_weather" | "get_time") "()"').new_matcher()
    assert lark.jump_forward_string() == "call get_"
    # mid-character: nothing is forced until the character is complete
    uni = compiler.compile("regex", "é!").new_matcher()
    lead = compiler.vocab.byte_token_ids[0xC3]
    uni.accept_token(lead)
    assert uni.jump_forward_string() is None
    uni.accept_token(compiler.vocab.byte_token_ids[0xA9])
    assert uni.jump_forward_string() == "!"


@pytest.mark.parametrize(
    "schema,keyword",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"type": "string", "not": {"pattern": "^a"}}, "not"),  # no spelling of "a string not matching"
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ],
)
def test_strict_keywords_are_400s_naming_them(schema, keyword):
    backend = get_backend("llguidance")
    with pytest.raises(GrammarError, match=keyword):
        backend.check("json_schema", json.dumps(schema), "json.dumps")
    lark = f'start: "x" %json{json.dumps(schema)}'
    with pytest.raises(GrammarError, match=keyword):
        backend.check("lark", lark, "json.dumps")


def test_other_bad_specs_are_400s():
    backend = get_backend("llguidance")
    for kind, spec, word in [
        ("json_schema", '{"type": "strin"}', "strin"),
        ("json_schema", "[1]", "JSON object"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "false", "no value"),
        ("regex", "(a", "unclosed"),
        ("regex", "(?=a)a", "look-around"),
        ("lark", 'start: "a" | (', "lark"),
        ("lark", "   ", "empty"),
    ]:
        with pytest.raises(GrammarError, match=word):
            backend.check(kind, spec, "json.dumps")


def test_custom_format_ignored_standard_formats_enforced(compiler):
    schema = {"type": "string", "format": "my-custom-format"}
    m = compiler.compile("json_schema", json.dumps(schema)).new_matcher()
    m.accept_tokens(compiler.tokenizer.encode('"anything"', add_special_tokens=False))
    assert m.can_finish()
    date = compiler.compile("json_schema", json.dumps({"type": "string", "format": "date"})).new_matcher()
    date.accept_tokens(compiler.vocab.encode_bytes_greedy(b'"2024-'))
    assert not date.is_allowed(compiler.vocab.byte_token_ids[ord("x")])


def test_max_length_is_not_relaxed(compiler):
    """outlines-core caps maxLength at 64 (formats.STRING_LENGTH_CAP); llguidance enforces it as written."""
    schema = {"type": "string", "minLength": 100, "maxLength": 100}
    m = compiler.compile("json_schema", json.dumps(schema)).new_matcher()
    vocab = compiler.vocab
    x, quote = vocab.byte_token_ids[ord("x")], vocab.byte_token_ids[ord('"')]
    m.accept_token(quote)
    for i in range(100):
        assert not m.is_allowed(quote), i  # a closing quote before 100 characters is refused
        m.accept_token(x)
    assert m.allowed_token_ids().tolist() == [quote]
    m.accept_token(quote)
    assert m.can_finish()


def test_choose_backend_and_per_kind_fallback():
    assert set(BACKEND_NAMES) == {"outlines", "llguidance", "xgrammar"}
    assert choose_backend("auto", "json_schema") == "llguidance"
    assert choose_backend("auto", "regex") == "outlines"
    assert choose_backend("outlines", "json_schema") == "outlines"
    assert choose_backend("outlines", "lark") == "llguidance"  # outlines-core cannot express lark
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        choose_backend("auto", "ebnf")
    with pytest.raises(GrammarError, match="unknown grammar backend"):
        choose_backend("nope", "regex")


def test_sampling_params_lark_field():
    p = SamplingParams.from_dict({"lark": 'start: "a"'})
    assert p.has_grammar and p.grammar == ("lark", 'start: "a"')
    with pytest.raises(ValueError, match="regex and lark are mutually exclusive"):
        SamplingParams(regex="a", lark='start: "a"')
    with pytest.raises(ValueError, match="json_schema and lark are mutually exclusive"):
        SamplingParams(json_schema="{}", lark='start: "a"')
    with pytest.raises(ValueError, match="lark must be a string"):
        SamplingParams(lark=3)


def test_server_args_grammar_backend():
    assert ServerArgs().grammar_backend == "auto"
    assert ServerArgs(grammar_backend="llguidance").grammar_backend == "llguidance"
    with pytest.raises(ValueError, match="grammar-backend"):
        ServerArgs(grammar_backend="guidance")


def test_sandbox_compiles_and_checks_with_llguidance(default_tokenizer):
    """Through the capped worker pool: the SQL tool's pattern, which outlines-core could not compile within
    2 GB, compiles in milliseconds; what crosses back is the grammar text; checks name keywords."""
    compiler = GrammarCompiler(
        default_tokenizer,
        len(default_tokenizer),
        pool_limits=dict(workers=1, memory_mb=1024, timeout_s=60, queue_size=8),
        backend="auto",
    )
    try:
        sql = {
            "type": "object",
            "properties": {"query": {"type": "string", "pattern": "^SELECT .{1,60}$"}},
            "required": ["query"],
        }
        g = compiler.compile("json_schema", json.dumps(sql))
        assert g.backend == "llguidance" and g.compile_seconds < 5
        m = g.new_matcher()
        assert m.jump_forward_string() == '{"query": "SELECT '
        assert compiler.compile("regex", "[0-9]+").backend == "outlines"
        with pytest.raises(GrammarError, match="uniqueItems"):
            compiler.compile("json_schema", json.dumps({"type": "array", "uniqueItems": True}))
        stats = compiler.stats()
        assert stats["compiled_llguidance"] == 1 and stats["compiled_outlines"] == 1
    finally:
        compiler.shutdown()
    checker = CompilePool(None, "json.dumps", workers=1, memory_mb=512, timeout_s=60, queue_size=4)
    try:
        ok = checker.submit("lark", 'start: "a"+', check=True, backend="llguidance").result(timeout=120)
        assert ok.backend == "llguidance" and ok.index is None
        pickle.dumps(ok)
        with pytest.raises(GrammarError, match="contains"):
            checker.submit("json_schema", '{"contains": {}}', check=True, backend="llguidance").result(
                timeout=120
            )
    finally:
        checker.shutdown()


def test_auto_falls_back_per_request_when_llguidance_cannot_enforce(default_tokenizer):
    """The ``json-pointer`` format is enforced by the outlines layer (constrained.formats) but unknown to
    llguidance: under auto the request goes to outlines-core; a named backend answers the 400 naming it."""
    schema = {"type": "string", "format": "json-pointer"}
    with pytest.raises(GrammarUnsupported, match="json-pointer"):
        get_backend("llguidance").check("json_schema", json.dumps(schema), "json.dumps")
    assert backend_chain("auto", "json_schema")[:2] == ("llguidance", "outlines")
    assert backend_chain("llguidance", "json_schema") == ("llguidance",)
    auto = GrammarCompiler(default_tokenizer, len(default_tokenizer), backend="auto")
    strict = GrammarCompiler(default_tokenizer, len(default_tokenizer), backend="llguidance")
    try:
        assert auto.compile("json_schema", json.dumps(schema)).backend == "outlines"
        assert auto.compile("json_schema", json.dumps({"type": "integer"})).backend == "llguidance"
        with pytest.raises(GrammarError, match="json-pointer"):
            strict.compile("json_schema", json.dumps(schema))
        both = {"type": "array", "uniqueItems": True, "items": {"type": "integer"}}
        with pytest.raises(GrammarError, match="uniqueItems"):  # neither backend can: a 400 naming it
            auto.compile("json_schema", json.dumps(both))
    finally:
        auto.shutdown()
        strict.shutdown()


def test_listed_properties_only_unless_the_schema_says_otherwise(compiler):
    """As outlines-core: an object with ``properties`` and no word on others gets only the listed keys."""
    vocab = compiler.vocab
    closed = compiler.compile(
        "json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    m = closed.new_matcher()
    m.accept_tokens(vocab.encode_bytes_greedy(b'{"'))
    assert not m.is_allowed(vocab.byte_token_ids[ord("b")])
    open_ = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    m = compiler.compile("json_schema", json.dumps(open_)).new_matcher()
    m.accept_tokens(vocab.encode_bytes_greedy(b'{"'))
    assert m.is_allowed(vocab.byte_token_ids[ord("b")])
    both = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}
    m = compiler.compile("json_schema", json.dumps({**both, "required": ["a", "b"]})).new_matcher()
    m.accept_tokens(vocab.encode_bytes_greedy(b'{"a": 1, "b": 2}'))  # allOf branches stay open
    assert m.can_finish()
