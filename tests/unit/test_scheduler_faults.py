"""The scheduler's failure boundary, with the real model runner on a tiny model: a fault injected at one
stage for one request fails that request alone (500 with an error id, never the exception text), every
other request finishes with all its tokens, the step loop goes on, and no KV slot is lost or held twice.
Also: out-of-vocabulary stop ids are a 400, deadlines are a 504, and prompt logprobs are computed chunk
by chunk with the same values as in one piece."""

from __future__ import annotations

import math
import time

import pytest

from runtime.managers.scheduler.req import Req
from runtime.managers.scheduler.scheduler import Scheduler
from runtime.messages import GenerateReq, RequestOptions
from runtime.sampling_params import SamplingParams
from tests.scheduler_utils import make_scheduler

SECRET = "secret-exception-text"
MAX_NEW = 6


@pytest.fixture(scope="module")
def sched(tiny_model_dir, default_tokenizer) -> Scheduler:
    return make_scheduler(tiny_model_dir, default_tokenizer, max_total_tokens=4096)


def msg(rid: str, prompt: list[int], **params) -> GenerateReq:
    p = dict(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return GenerateReq(rid=rid, input_ids=prompt, params=SamplingParams(**{**p, **params}))


def drive(s: Scheduler, msgs: list[GenerateReq], max_steps: int = 500) -> dict[str, dict]:
    """Submit all, step until idle; per rid: tokens, finish reason, error, status. Accounting checked at the
    end of every step."""
    res: dict[str, dict] = {}
    for m in msgs:
        s.handle(m)
    for _ in range(max_steps):
        if not s.has_work():
            break
        for o in s.step():
            r = res.setdefault(o.rid, {"tokens": [], "finish": None, "error": None, "status": 0})
            if o.replaced_tokens:
                del r["tokens"][len(r["tokens"]) - o.replaced_tokens :]
            r["tokens"] += o.new_token_ids
            if o.finished_reason is not None:
                r["finish"], r["error"], r["status"] = o.finished_reason, o.error, o.error_status
        s.check_accounting()
    assert not s.has_work(), "the scheduler did not drain"
    s.check_accounting()
    return res


PROMPTS = {"a": [5, 6, 7, 8, 9], "victim": [10, 11, 12, 13], "b": [14, 15, 16, 17, 18, 19]}


def assert_only_victim_failed(res: dict[str, dict]) -> None:
    v = res["victim"]
    assert v["status"] == 500 and "error id err-" in v["error"], v
    assert SECRET not in v["error"]
    for rid in ("a", "b"):
        assert res[rid]["error"] is None and len(res[rid]["tokens"]) == MAX_NEW, (rid, res[rid])


def _raise_for_victim(fn):
    def wrapper(*args, **kw):
        reqs = [a for a in args if isinstance(a, Req)] + [
            r for a in args if isinstance(a, list) for r in a if isinstance(r, Req)
        ]
        if any(r.rid == "victim" for r in reqs):
            raise RuntimeError(SECRET)
        return fn(*args, **kw)

    return wrapper


# Each stage of one request's life: (object, attribute) whose call fails for the victim only.
STAGES = {
    "admission": lambda s: (Req, "input_problem"),
    "scheduling": lambda s: (s.cm, "start"),
    "grammar_mask": lambda s: (s.grammars, "vocab_mask"),
    "sampling": lambda s: (s, "_sample"),
    "stop_check": lambda s: (s.stop, "check"),
    "output": lambda s: (s.outputs, "output_of"),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_fault_in_one_request_fails_it_alone(sched, monkeypatch, stage):
    target, name = STAGES[stage](sched)
    monkeypatch.setattr(target, name, _raise_for_victim(getattr(target, name)))
    res = drive(sched, [msg(rid, p) for rid, p in PROMPTS.items()])
    assert_only_victim_failed(res)
    monkeypatch.undo()
    again = drive(sched, [msg("after", PROMPTS["victim"])])  # the same request now goes through
    assert again["after"]["error"] is None and len(again["after"]["tokens"]) == MAX_NEW


def test_failed_forward_fails_its_batch_and_the_next_one_runs(sched, monkeypatch):
    calls = {"n": 0}
    real = sched.runner.forward

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:  # the first decode step of the batch
            raise RuntimeError(SECRET)
        return real(batch)

    monkeypatch.setattr(sched.runner, "forward", flaky)
    res = drive(sched, [msg(rid, p) for rid, p in PROMPTS.items()])
    for r in res.values():
        assert r["status"] == 500 and SECRET not in r["error"], r
    res = drive(sched, [msg("next", PROMPTS["a"])])
    assert res["next"]["error"] is None and len(res["next"]["tokens"]) == MAX_NEW


def test_failed_prefill_pass_fails_its_prompts_and_spares_the_requests_decoding_in_it(sched, monkeypatch):
    """A prompt arriving while others decode: its prefill pass carries their next tokens (mixed batch). When
    that pass fails, the prompt fails (500) and the decoding requests give their slot back and finish with
    every token, as they would had they waited for a decode step of their own."""
    real = sched.runner.forward
    failed_with = []

    def failing_mixed_pass(batch):
        if not batch.is_decode and sched.riding and not failed_with:
            failed_with.extend(r.rid for r in sched.riding)
            raise RuntimeError(SECRET)
        return real(batch)

    monkeypatch.setattr(sched.runner, "forward", failing_mixed_pass)
    for rid in ("a", "b"):
        sched.handle(msg(rid, PROMPTS[rid]))
    sched.step()  # a and b prefilled together; both decode from here
    assert {r.rid for r in sched.running} == {"a", "b"}
    res = drive(sched, [msg("victim", PROMPTS["victim"])])
    assert sorted(failed_with) == ["a", "b"]
    assert res["victim"]["status"] == 500 and SECRET not in res["victim"]["error"]
    for rid in ("a", "b"):
        assert res[rid]["error"] is None and len(res[rid]["tokens"]) == MAX_NEW, (rid, res[rid])


def test_step_failure_outside_requests_is_recovered(sched, monkeypatch):
    """What the scheduler process does when `step` itself raises: `recover` fails every live request and
    the pool is intact."""
    for rid, p in PROMPTS.items():
        sched.handle(msg(rid, p))
    sched.step()  # one extend: the requests hold KV now
    monkeypatch.setattr(sched, "_schedule_extend", lambda: (_ for _ in ()).throw(RuntimeError(SECRET)))
    with pytest.raises(RuntimeError):
        sched.step()
    outs = sched.recover()
    assert {o.rid for o in outs} == set(PROMPTS) and all(o.error_status == 500 for o in outs)
    assert not sched.has_work()
    sched.check_accounting()


def test_out_of_vocabulary_stop_token_ids_with_min_new_tokens_is_a_400(sched):
    """Regression: a stop id >= the vocabulary size with min_new_tokens made the sampler raise inside
    `step` and the whole server exit."""
    vocab = sched.runner.vocab_size
    res = drive(
        sched,
        [
            msg("bad", PROMPTS["a"], stop_token_ids=[vocab + 7], min_new_tokens=3),
            msg("good", PROMPTS["b"]),
        ],
    )
    assert res["bad"]["status"] == 400 and "stop_token_ids" in res["bad"]["error"], res["bad"]
    assert res["good"]["error"] is None and len(res["good"]["tokens"]) == MAX_NEW


def test_request_past_its_deadline_is_aborted_with_504(sched):
    m = msg("slow", PROMPTS["a"], max_new_tokens=200)
    m.options = RequestOptions(timeout_s=0.05)
    sched.handle(m)
    sched.step()
    time.sleep(0.1)
    res = drive(sched, [msg("other", PROMPTS["b"])])
    assert res["slow"]["status"] == 504 and "timed out" in res["slow"]["error"], res["slow"]
    assert 0 < len(res["slow"]["tokens"]) < 200
    assert res["other"]["error"] is None and len(res["other"]["tokens"]) == MAX_NEW


def test_server_deadline_applies_and_a_request_can_only_shorten_it(tiny_model_dir, default_tokenizer):
    s = make_scheduler(tiny_model_dir, default_tokenizer, request_timeout_s=30.0)
    m = msg("r", PROMPTS["a"])
    m.options = RequestOptions(timeout_s=3600.0)
    s.handle(m)
    req = s.waiting[0]
    assert req.deadline == pytest.approx(req.arrival + 30.0)
    s.abort("r")
    drive(s, [])


def test_prompt_logprobs_are_computed_chunk_by_chunk(tiny_model_dir, default_tokenizer):
    """A prompt longer than the chunk size is prefilled in chunks (it was taken whole before, keeping a
    full-vocabulary row per position); its prompt logprobs equal the unchunked ones."""
    prompt = [(7 * i) % 500 + 3 for i in range(70)]
    results = {}
    for chunk in (0, 16):
        s = make_scheduler(tiny_model_dir, default_tokenizer, chunked_prefill_size=chunk)
        m = msg("lp", prompt, max_new_tokens=2)
        m.return_logprob, m.logprob_start_len, m.top_logprobs_num = True, 3, 2
        s.handle(m)
        entries, steps = [], 0
        while s.has_work():
            for o in s.step():
                entries += o.input_token_logprobs or []
            steps += 1
        results[chunk] = (entries, s.stats["extend_steps"])
    whole, chunked = results[0][0], results[16][0]
    assert results[16][1] >= math.ceil(len(prompt) / 16) > results[0][1]
    assert [e[1] for e in chunked] == prompt[3:] == [e[1] for e in whole]
    for (lp_a, _, top_a), (lp_b, _, top_b) in zip(whole, chunked):
        assert lp_a == pytest.approx(lp_b, abs=1e-4)
        assert [t for _, t in top_a] == [t for _, t in top_b] and len(top_a) == 2
