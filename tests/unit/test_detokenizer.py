"""IncrementalDetokenizer on the default tokenizer: streamed deltas add up to the final text, a stream never
shows text that a stop trim takes back, and the matched stop (string or token) is not part of the text."""

from __future__ import annotations

import pytest

from runtime.managers.detokenizer.detokenizer import IncrementalDetokenizer
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


class CountingTokenizer:
    """The real tokenizer, recording how many tokens each decode call was given."""

    def __init__(self, tok):
        self.tok = tok
        self.calls: list[int] = []

    def decode(self, ids, **kw):
        self.calls.append(len(ids))
        return self.tok.decode(ids, **kw)


def _per_step_decode(tok, ids: list[int], **first) -> tuple[list[int], str]:
    """Stream `ids` one per step; (tokens decoded per step, the text)."""
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    per_step, text = [], ""
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out = ReqOutput(
            rid="r",
            new_token_ids=[t],
            finished_reason={"type": "length", "length": len(ids)} if last else None,
            **(first if i == 0 else {}),
        )
        counting.calls.clear()
        text += detok.process(out).text_delta
        per_step.append(sum(counting.calls))
    return per_step, text


def test_stop_string_split_over_tokens_is_trimmed_from_the_stream(tok):
    ids = tok.encode("hello there xyzzyq and more", add_special_tokens=False)
    ids = ids[:5]  # the scheduler finishes on the token that completes the stop string
    deltas = _stream(
        IncrementalDetokenizer(tok), ids, {"type": "stop", "matched": "xyzzyq"}, stop_strings=["xyzzyq", "@"]
    )
    assert "".join(deltas) == "hello there "
    assert not any("xy" in d for d in deltas)  # held back while it could be the stop string's start


def test_decode_work_per_token_does_not_grow_with_the_output(tok):
    """2,000 tokens with stop strings that never match: each step decodes a few tokens, as many at the end
    as at the start."""
    ids = (tok.encode(" the quick brown fox jumps over the lazy dog", add_special_tokens=False) * 300)[:2000]
    per_step, text = _per_step_decode(tok, ids, stop_strings=["z" * 300, "@@"])
    assert text == tok.decode(ids)
    assert max(per_step) <= 2 * (6 + 1), max(per_step)


def test_undecodable_output_does_not_make_decoding_grow(tok):
    """A model that emits only lead bytes of multi-byte characters: the text never completes, and the old
    detokenizer decoded every pending token again at each step (2,000 tokens: 2 million decoded)."""
    lead = tok.convert_tokens_to_ids("ð")  # byte 0xF0 alone
    assert tok.decode([lead]) == "\ufffd"
    per_step, text = _per_step_decode(tok, [lead] * 2000)
    assert max(per_step) <= 2 * (16 + 6), max(per_step)
    assert text == "\ufffd" * 2000


def test_rewritten_tail_keeps_sent_text_and_finds_stop(tok):
    """Jump-forward: the last tokens are replaced (`replaced_tokens`); text already sent stays sent and a
    stop string in the new tokens is still trimmed."""
    detok = IncrementalDetokenizer(tok)
    first = tok.encode("alpha beta gamma", add_special_tokens=False)
    got = ""
    for i, t in enumerate(first):
        kw = {"stop_strings": ["END"]} if i == 0 else {}
        got += detok.process(ReqOutput(rid="r", new_token_ids=[t], **kw)).text_delta
    assert got == "alpha beta gamma"
    new = tok.encode(" gamma delta END x", add_special_tokens=False)
    out = ReqOutput(
        rid="r", new_token_ids=new, replaced_tokens=1, finished_reason={"type": "stop", "matched": "END"}
    )
    got += detok.process(out).text_delta
    assert got == "alpha beta gamma delta "
