"""StopChecker's stop strings on the default tokenizer: matches across token boundaries and inside multi-token
characters, the min_new_tokens rule, rewrites of the output, and per-token work that does not grow with the
output (counted through a wrapper that records every decode call)."""

from __future__ import annotations

import pytest

from runtime.managers.scheduler.req import Req
from runtime.managers.scheduler.stop_checker import StopChecker, StopMatcher
from runtime.sampling_params import SamplingParams


class CountingTokenizer:
    """The real tokenizer, recording how many tokens each decode call was given."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_token_id = tok.eos_token_id
        self.calls: list[int] = []

    def decode(self, ids, **kw):
        self.calls.append(len(ids))
        return self.tok.decode(ids, **kw)


def _run(checker: StopChecker, ids: list[int], **params) -> tuple[int | None, dict | None]:
    """Append `ids` one per step, checking after each; (tokens when it finished, the reason)."""
    req = Req(rid="r", prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=len(ids) + 10, **params))
    for tok in ids:
        req.output_ids.append(tok)
        reason = checker.check(req)
        if reason:
            return len(req.output_ids), reason
    return None, None


@pytest.fixture(scope="module")
def tok(default_tokenizer):
    return default_tokenizer


def test_stop_string_split_over_three_tokens(tok):
    ids = tok.encode("hello there xyzzyq and more", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids[2:5]] == [" xy", "zzy", "q"]  # the stop string spans 3 tokens
    n, reason = _run(StopChecker(tok), ids, stop=["xyzzyq"])
    assert (n, reason) == (5, {"type": "stop", "matched": "xyzzyq"})
    n, _ = _run(StopChecker(tok), ids, stop=["xyzzyz"])  # one character off: never
    assert n is None


def test_stop_string_of_characters_that_take_several_tokens(tok):
    emoji2 = tok.encode("🙂🙂", add_special_tokens=False)
    assert len(emoji2) == 4  # 2 tokens per emoji: 4 tokens for a 2-character stop string
    ids = tok.encode("ok", add_special_tokens=False) + emoji2 + tok.encode(" then", add_special_tokens=False)
    n, reason = _run(StopChecker(tok), ids, stop=["🙂🙂"])
    assert reason == {"type": "stop", "matched": "🙂🙂"}
    assert tok.decode(ids[:n]).endswith("🙂🙂")


def test_stop_string_before_min_new_tokens(tok):
    ids = tok.encode("a STOP b c d e f g h i j k l m n o p", add_special_tokens=False)
    stop_end = next(k for k in range(len(ids)) if "STOP" in tok.decode(ids[: k + 1]))
    # Found at the first check that may finish, while it is still among the last tokens ...
    n, reason = _run(StopChecker(tok), ids, stop=["STOP"], min_new_tokens=stop_end + 3)
    assert (n, reason) == (stop_end + 3, {"type": "stop", "matched": "STOP"})
    # ... and not when it ended long before min_new_tokens (as before: only the tail is looked at).
    n, _ = _run(StopChecker(tok), ids, stop=["STOP"], min_new_tokens=len(ids) - 1)
    assert n is None


def test_rewritten_output_is_scanned_again(tok):
    """Jump-forward replaces the output list: the stop scan starts over on the new tail."""
    checker = StopChecker(tok)
    req = Req(rid="r", prompt_ids=[1], params=SamplingParams(max_new_tokens=100, stop=["END"]))
    req.output_ids = tok.encode("one two", add_special_tokens=False)
    assert checker.check(req) is None
    req.output_ids = req.output_ids[:1] + tok.encode(" and the END", add_special_tokens=False)
    assert checker.check(req) == {"type": "stop", "matched": "END"}


def test_decode_work_per_token_does_not_grow_with_the_output(tok):
    """2,000 output tokens and a 300-character stop string that never matches: every step decodes a few
    tokens, the same at the end as at the start (not the last 301 tokens each step)."""
    counting = CountingTokenizer(tok)
    checker = StopChecker(counting)
    ids = (tok.encode(" the quick brown fox jumps over the lazy dog", add_special_tokens=False) * 300)[:2000]
    req = Req(rid="r", prompt_ids=[1], params=SamplingParams(max_new_tokens=5000, stop=["z" * 300, "@@"]))
    per_step = []
    for t in ids:
        req.output_ids.append(t)
        counting.calls.clear()
        assert checker.check(req) is None
        per_step.append(sum(counting.calls))
    assert max(per_step[1:]) <= 2 * (6 + 1) + 2, max(per_step[1:])  # context + the new token, twice
    assert max(per_step[-100:]) <= max(per_step[1:100])


def test_matcher_finds_the_earliest_starting_match_and_holds_back_prefixes():
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("xxab") is None
    assert m.overlap == 2  # "ab" could start "abcd"
    assert m.feed("cd") == (2, "abcd")  # "bc" ends first, "abcd" starts first
    m = StopMatcher(["aab"])
    assert m.feed("aaaa") is None and m.overlap == 2
    assert m.feed("b") == (2, "aab")
