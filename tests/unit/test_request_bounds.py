"""Request bounds below the HTTP layer: the server options' own checks, the native body's early prompt count,
and the seeds of n choices near the int64 maximum."""

from __future__ import annotations

import time

import pytest

from runtime.entrypoints.generate_input import parse_generate_body
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager, choice_seed
from runtime.messages import GenerateReq
from runtime.sampling_params import INT64_MAX, SamplingParams
from runtime.server_args import ServerArgs


@pytest.mark.parametrize(
    "name",
    ["max_stop_strings", "max_stop_chars", "max_rid_length", "max_prompts_per_request", "max_prompt_chars"],
)
def test_bounds_must_be_positive(name):
    with pytest.raises(ValueError, match="--" + name.replace("_", "-")):
        ServerArgs(**{name: 0})


def test_native_prompt_count_is_checked_before_per_prompt_work():
    body = {"text": ["a"] * 200_000, "sampling_params": {"max_new_tokens": 1}}
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="200000 prompts, more than --max-prompts-per-request \\(8\\)"):
        parse_generate_body(body, max_prompts=8)
    assert time.perf_counter() - t0 < 1.0
    reqs, is_batch = parse_generate_body(
        {"text": ["a", "b"], "sampling_params": {"stop": "x"}}, max_prompts=2
    )
    assert is_batch and [r.text for r in reqs] == ["a", "b"] and len({r.rid for r in reqs}) == 2


def test_choice_seeds_stay_int64_and_distinct():
    seeds = [choice_seed(INT64_MAX - 1, i) for i in range(4)]
    assert seeds == [INT64_MAX - 1, INT64_MAX, 0, 1]
    req = GenerateReq(rid="r", text=None, input_ids=[1], params=SamplingParams(n=4, seed=INT64_MAX))
    expanded = TokenizerManager.expand_n([req])
    assert [r.params.seed for r in expanded] == [INT64_MAX, 0, 1, 2]
    assert [r.rid for r in expanded] == ["r-0", "r-1", "r-2", "r-3"]
