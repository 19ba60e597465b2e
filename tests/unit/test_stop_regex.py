"""SGLang's `stop_regex` (scheduler stop and detokenizer trim) and the audit of SGLang's other sampling
parameters: each is implemented, or refused by name when set to anything but the default its clients send."""

from __future__ import annotations

import time

import msgspec
import pytest

from runtime.managers.detokenizer.detokenizer import IncrementalDetokenizer
from runtime.managers.scheduler.req import Req
from runtime.managers.scheduler.stop_checker import STOP_REGEX_WINDOW, RegexTail, StopChecker
from runtime.messages import ReqOutput
from runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(default_tokenizer):
    return default_tokenizer


def _run(checker: StopChecker, ids: list[int], **params) -> tuple[Req, int | None, dict | None]:
    """Append `ids` one per step, checking after each; (the request, tokens when it finished, the reason)."""
    req = Req(rid="r", prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=len(ids) + 10, **params))
    for tok in ids:
        req.output_ids.append(tok)
        reason = checker.check(req)
        if reason:
            return req, len(req.output_ids), reason
    return req, None, None


def _stream(detok: IncrementalDetokenizer, ids: list[int], finished_reason: dict, **first) -> list[str]:
    deltas = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out = ReqOutput(
            rid="r",
            new_token_ids=[t],
            finished_reason=finished_reason if last else None,
            **(first if i == 0 else {}),
        )
        deltas.append(detok.process(out).text_delta)
    return deltas


# ---- scheduler: when a stop regex ends the request ---------------------------------------------------------
def test_regex_split_over_tokens_stops_on_the_completing_token(tok):
    ids = tok.encode("hello there xyzzyq and more", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids[2:5]] == [" xy", "zzy", "q"]
    _, n, reason = _run(StopChecker(tok), ids, stop_regex=r"xy+z+yq")
    assert n == 5 and reason == {"type": "stop", "matched": r"xy+z+yq"}  # SGLang reports the pattern


def test_regex_anchored_at_the_end_and_a_plain_string(tok):
    ids = tok.encode("The answer is 42. Then more text follows here.", add_special_tokens=False)
    _, n, reason = _run(StopChecker(tok), ids, stop_regex=[r"\d+\.$", "zzz"])
    assert tok.decode(ids[:n]).endswith("42.") and reason["matched"] == r"\d+\.$"
    _, n, _ = _run(StopChecker(tok), ids, stop_regex="[0-9]{3}")  # no three digits in a row: never
    assert n is None


def test_earliest_of_stop_string_and_regex_wins(tok):
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    _, n, reason = _run(StopChecker(tok), ids, stop=["delta"], stop_regex=r"b\w+a")
    assert reason["matched"] == r"b\w+a" and tok.decode(ids[:n]).endswith("beta")


def test_unbounded_pattern_searches_only_a_bounded_tail(tok):
    tail = RegexTail([r"S.*P"])
    assert tail.window == STOP_REGEX_WINDOW  # '.*' could match any length: the window's cap
    assert tail.feed("a" * 5000) is None and len(tail.tail) == STOP_REGEX_WINDOW
    start, end, pattern = tail.feed("xxSxxP")
    assert (start, end, pattern) == (5002, 5006, "S.*P")
    assert RegexTail([r"ab{2,3}c"]).window < 20  # a bounded pattern keeps a short tail


def test_catastrophic_pattern_ends_the_request_with_a_400_in_bounded_time(tok):
    ids = tok.encode("x" * 3000, add_special_tokens=False)
    t0 = time.perf_counter()
    req, n, reason = _run(StopChecker(tok), ids, stop_regex=r"(x+x+)+y")
    assert time.perf_counter() - t0 < 5.0
    assert reason["type"] == "abort" and "(x+x+)+y" in reason["message"]
    assert req.error_status == 400 and "(x+x+)+y" in req.error


# ---- detokenizer: the trim ---------------------------------------------------------------------------------
def test_regex_stop_is_trimmed_and_never_streamed(tok):
    ids = tok.encode("one two three STOP four", add_special_tokens=False)
    ids = ids[: next(i for i in range(len(ids)) if tok.decode(ids[: i + 1]).endswith("STOP")) + 1]
    deltas = _stream(
        IncrementalDetokenizer(tok), ids, {"type": "stop", "matched": "S[A-Z]+P"}, stop_regex=["S[A-Z]+P"]
    )
    assert "".join(deltas) == "one two three "
    assert not any("S" in d for d in deltas)  # held back while it could start a match


def test_no_stop_trim_keeps_the_regex_match(tok):
    ids = tok.encode("one two three STOP", add_special_tokens=False)
    kept = _stream(
        IncrementalDetokenizer(tok),
        ids,
        {"type": "stop", "matched": "S[A-Z]+P"},
        stop_regex=["S[A-Z]+P"],
        no_stop_trim=True,
    )
    assert "".join(kept) == tok.decode(ids)


def test_text_that_cannot_start_a_match_streams_at_once(tok):
    ids = tok.encode("one two three", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    first = detok.process(ReqOutput(rid="r", new_token_ids=ids[:2], stop_regex=[r"\d+\."]))
    assert first.text_delta == tok.decode(ids[:2])


def test_rewritten_tail_keeps_sent_text_and_finds_the_regex(tok):
    """Jump-forward replaced the last token: sent text stays sent, a match in the new tokens is trimmed."""
    detok = IncrementalDetokenizer(tok)
    got = ""
    for i, t in enumerate(tok.encode("alpha beta gamma", add_special_tokens=False)):
        kw = {"stop_regex": ["E[N]D"]} if i == 0 else {}
        got += detok.process(ReqOutput(rid="r", new_token_ids=[t], **kw)).text_delta
    assert got == "alpha beta gamma"
    new = tok.encode(" gamma delta END x", add_special_tokens=False)
    reason = {"type": "stop", "matched": "E[N]D"}
    got += detok.process(
        ReqOutput(rid="r", new_token_ids=new, replaced_tokens=1, finished_reason=reason)
    ).text_delta
    assert got == "alpha beta gamma delta "


# ---- the parameter audit -----------------------------------------------------------------------------------
# SGLang's API sampling parameters with the defaults its clients send (sglang.srt.sampling.sampling_params)
SGLANG_DEFAULTS = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "custom_params": None,
    "stream_interval": None,
    "logit_bias": None,
    "sampling_seed": None,
}
# what `sgl.gen` sends (SglSamplingParams.to_srt_kwargs): empty tuples become JSON lists
FRONTEND_DEFAULTS = {**SGLANG_DEFAULTS, "stop": [], "stop_token_ids": [], "stop_regex": [], "top_k": -1}
UNSUPPORTED = {
    "ebnf": 'root ::= "a"',
    "structural_tag": '{"type": "structural_tag"}',
    "custom_params": {"k": 1},
}


@pytest.mark.parametrize("defaults", [SGLANG_DEFAULTS, FRONTEND_DEFAULTS], ids=["server", "frontend"])
def test_every_sglang_parameter_at_its_default_is_accepted(defaults):
    SamplingParams.from_dict(defaults)
    for name, value in defaults.items():
        SamplingParams.from_dict({name: value})


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_sglang_parameter_is_refused_by_name(name):
    with pytest.raises(ValueError, match=f"^{name} is not supported by radixlm"):
        SamplingParams.from_dict({name: UNSUPPORTED[name]})
    SamplingParams.from_dict({name: {} if isinstance(UNSUPPORTED[name], dict) else None})


def test_sglang_logit_bias_is_implemented():
    assert SamplingParams.from_dict({"logit_bias": {"1": 5.0}}).logit_bias == {"1": 5.0}


def test_sampling_seed_is_seed():
    assert SamplingParams.from_dict({"sampling_seed": 7}).seed == 7
    assert SamplingParams.from_dict({"sampling_seed": 7, "seed": 7}).seed == 7
    with pytest.raises(ValueError, match="sampling_seed"):
        SamplingParams.from_dict({"sampling_seed": 7, "seed": 8})


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_stream_interval_is_checked(bad):
    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams.from_dict({"stream_interval": bad})


@pytest.mark.parametrize("bad", ["(unclosed", "a{2,1}", "*x", "(?<=a+)b"])
def test_bad_stop_regex_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="stop_regex") as e:
        SamplingParams.from_dict({"stop_regex": ["ok", bad]})
    assert repr(bad) in str(e.value)
    with pytest.raises(ValueError, match="stop_regex must be a string or a list of strings"):
        SamplingParams.from_dict({"stop_regex": [1]})


def test_params_cross_the_process_boundary():
    sp = SamplingParams.from_dict({"stop_regex": r"\d+", "stream_interval": 3, "sampling_seed": 5})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert (back.stop_regex, back.stream_interval, back.seed) == ([r"\d+"], 3, 5)
