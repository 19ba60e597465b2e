"""IncrementalDetokenizer on the default tokenizer: streamed deltas add up to the final text, a stream never
shows text that a stop trim takes back, and the matched stop (string or token) is not part of the text."""

from __future__ import annotations

import pytest

from runtime.managers.detokenizer import IncrementalDetokenizer
from runtime.messages import ReqOutput


def _stream(detok: IncrementalDetokenizer, ids: list[int], finished_reason: dict, **settings) -> list[str]:
    """Feed `ids` one token per step, the last one finishing; return the text deltas."""
    deltas = []
    for i, tok in enumerate(ids):
        last = i == len(ids) - 1
        first = {k: v for k, v in settings.items()} if i == 0 else {}
        out = ReqOutput(
            rid="r", new_token_ids=[tok], finished_reason=finished_reason if last else None, **first
        )
        deltas.append(detok.process(out).text_delta)
    assert "r" not in detok.states, "a finished request's state must be dropped"
    return deltas


@pytest.fixture(scope="module")
def tok(default_tokenizer):
    return default_tokenizer


def test_deltas_add_up_to_the_decoded_text(tok):
    text = "Hello, world! Ünïcode and emoji 🙂 in one stream."
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tok), ids, {"type": "length", "length": len(ids)})
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas), deltas  # half an emoji is held back, never shown


def test_stop_string_is_trimmed_and_never_streamed(tok):
    ids = tok.encode("one two three STOP four", add_special_tokens=False)
    deltas = _stream(
        IncrementalDetokenizer(tok), ids, {"type": "stop", "matched": "STOP"}, stop_strings=["STOP"]
    )
    assert "".join(deltas) == "one two three "
    assert not any("ST" in d for d in deltas)


def test_matched_stop_token_is_trimmed(tok):
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tok), ids, {"type": "stop", "matched": ids[-1]})
    assert "".join(deltas) == tok.decode(ids[:-1])


def test_no_stop_trim_keeps_the_stop_token_and_string(tok):
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    kept = _stream(IncrementalDetokenizer(tok), ids, {"type": "stop", "matched": ids[-1]}, no_stop_trim=True)
    assert "".join(kept) == tok.decode(ids)
    kept = _stream(
        IncrementalDetokenizer(tok),
        ids,
        {"type": "stop", "matched": " gamma"},
        stop_strings=[" gamma"],
        no_stop_trim=True,
    )
    assert "".join(kept) == tok.decode(ids)


def test_eos_text_is_trimmed_even_when_special_tokens_are_shown(tok):
    ids = tok.encode("done", add_special_tokens=False) + [tok.eos_token_id]
    deltas = _stream(
        IncrementalDetokenizer(tok),
        ids,
        {"type": "stop", "matched": tok.eos_token_id},
        skip_special_tokens=False,
    )
    assert "".join(deltas) == "done"
