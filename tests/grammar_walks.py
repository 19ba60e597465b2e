"""Random walks through a compiled grammar over a tiny ASCII vocabulary (no model), for every backend: what
the tests of ``constrained.one_of`` and ``constrained.siblings`` check outputs with."""

from __future__ import annotations

import json

import numpy as np

from constrained.backends import get_backend
from constrained.errors import GrammarError
from constrained.vocab import build_vocabulary


class _AsciiTokenizer:
    """A tiny "plain" tokenizer: <eos>, every printable ASCII character, and a few JSON pieces."""

    eos_token_id = 0
    all_special_ids = [0]
    added_tokens_decoder: dict = {}
    PIECES = ['": ', '", "', '{"', '"}', ", ", "true", "false", "null", "12", "circle", "radius", "width"]

    def __init__(self):
        chars = [chr(c) for c in range(0x20, 0x7F)]
        self.vocab = {tok: i for i, tok in enumerate(["<eos>", *chars, *self.PIECES])}

    def get_vocab(self):
        return dict(self.vocab)

    def __len__(self):
        return len(self.vocab)


def ascii_vocab():
    return build_vocabulary(_AsciiTokenizer())


def compiled(backend: str, schema: dict, vocab):
    spec = json.dumps(schema)
    b = get_backend(backend)
    text, payload = b.build("json_schema", spec, "json.dumps", vocab)
    return b.load("json_schema", spec, text, payload, vocab, vocab.num_ids, 0.0, 0)


def walk(grammar, vocab, seed: int, max_steps: int = 400) -> str | None:
    """Random allowed tokens until EOS; None if the walk ran long. Biased towards closing punctuation."""
    rng = np.random.default_rng(seed)
    closing = np.zeros(vocab.num_ids, dtype=bool)
    for tok, tid in _AsciiTokenizer().vocab.items():
        closing[tid] = tok in ('"', "}", "]", ",", '", "', '"}', "1", "true", "null", "circle")
    matcher = grammar.new_matcher()
    out: list[int] = []
    for _ in range(max_steps):
        if matcher.is_terminated():
            return vocab.decode_bytes(out).decode()
        allowed = matcher.allowed_token_ids()
        preferred = allowed[closing[allowed]] if len(allowed) else allowed
        if matcher.can_finish() and rng.random() < 0.4:
            pick = vocab.eos_token_id
        elif len(preferred) and rng.random() < 0.6:
            pick = int(rng.choice(preferred))
        else:
            pick = int(rng.choice(allowed))
        matcher.accept_token(pick)
        if pick != vocab.eos_token_id:
            out.append(pick)
    return None


def accepts(grammar, vocab, text: str) -> bool:
    matcher = grammar.new_matcher()
    try:
        for tid in [*vocab.encode_bytes_greedy(text.encode()), vocab.eos_token_id]:
            matcher.accept_token(tid)
    except GrammarError:
        return False
    return True


def assert_walks_valid(grammar, vocab, validator, min_finished: int = 4, seeds: int = 8) -> None:
    """Random walks through `grammar` (`seeds` of them) that finish are instances `validator` accepts; at
    least `min_finished` of them finish."""
    finished = 0
    for seed in range(seeds):
        text = walk(grammar, vocab, seed)
        if text is not None:
            assert validator.is_valid(json.loads(text)), text
            finished += 1
    assert finished >= min_finished


def assert_agrees_with_jsonschema(
    grammar, vocab, schema: dict, bad=(), good=(), min_finished: int = 4, seeds: int = 8
) -> None:
    """The compiled `schema` and `jsonschema` agree: walks validate, `bad` instances are rejected by both and
    `good` ones accepted by both."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)(schema)
    assert_walks_valid(grammar, vocab, validator, min_finished, seeds)
    for instance in bad:
        assert not validator.is_valid(instance), instance
        assert not accepts(grammar, vocab, json.dumps(instance)), instance
    for instance in good:
        assert validator.is_valid(instance), instance
        assert accepts(grammar, vocab, json.dumps(instance)), instance
