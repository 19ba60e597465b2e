"""The scheduler with the real model runner on a tiny model: continuous batching, radix cache, chunked
prefill, retraction and abort must never change greedy outputs, and every KV slot must come back."""

from __future__ import annotations

import random

import pytest

from runtime.managers.scheduler.scheduler import Scheduler
from runtime.messages import AbortReq, GenerateReq
from runtime.sampling_params import SamplingParams
from tests.scheduler_utils import make_scheduler


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that share prefixes in a tree: a system part, a few-shot part, then a unique question."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 512) for _ in range(40)]
    shots = [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    return [
        system + shots[i % 3] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 25))] for i in range(n)
    ]


def run(sched: Scheduler, reqs: list[list[int]], max_new: int = 12, arrive_every: int = 0, **params) -> dict:
    """Submit requests (all at once, or one every `arrive_every` steps) and step until done."""
    outs: dict[str, list[int]] = {}
    finish: dict[str, dict] = {}
    pending = [
        GenerateReq(
            rid=f"r{i}",
            input_ids=p,
            params=SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **params),
        )
        for i, p in enumerate(reqs)
    ]
    steps = 0
    while pending or sched.has_work():
        if pending and (arrive_every == 0 or steps % arrive_every == 0):
            batch = pending if arrive_every == 0 else pending[:1]
            for m in batch:
                sched.handle(m)
            pending = pending[len(batch) :]
        for o in sched.step():
            toks = outs.setdefault(o.rid, [])
            if o.replaced_tokens:
                del toks[len(toks) - o.replaced_tokens :]
            toks.extend(o.new_token_ids)
            if o.finished_reason:
                finish[o.rid] = o.finished_reason
        sched.check_accounting()
        steps += 1
        assert steps < 10_000
    assert set(finish) == set(outs)
    return {"outs": outs, "finish": finish, "stats": dict(sched.stats)}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, default_tokenizer):
    """Each prompt alone, no cache, no chunking: the ground truth for every configuration below."""
    sched = make_scheduler(
        tiny_model_dir,
        default_tokenizer,
        disable_radix_cache=True,
        chunked_prefill_size=0,
        max_running_requests=1,
    )
    return run(sched, prompts(32))["outs"]


def assert_all_free(sched: Scheduler) -> None:
    assert not sched.has_work()
    sched.check_accounting()
    assert sched.flush_cache()
    assert sched.cm.allocator.available() == sched.cm.allocator.size
    assert sched.cm.req_pool.available() == sched.cm.req_pool.size


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("max_running", [1, 4, 32])
def test_greedy_outputs_independent_of_cache_chunking_and_batching(
    tiny_model_dir, default_tokenizer, reference, radix, chunk, max_running
):
    sched = make_scheduler(
        tiny_model_dir,
        default_tokenizer,
        disable_radix_cache=not radix,
        chunked_prefill_size=chunk,
        max_running_requests=max_running,
    )
    res = run(sched, prompts(32), arrive_every=3 if max_running == 4 else 0)
    assert res["outs"] == reference
    assert all(f["type"] == "length" for f in res["finish"].values())
    if not radix:
        assert res["stats"]["cached_tokens"] == 0
    elif max_running < 32 or chunk:  # 32 at once, unchunked, fit one prefill batch: nothing cached before it
        assert res["stats"]["cached_tokens"] > 0
    assert_all_free(sched)


def test_running_requests_decode_inside_prefill_passes(tiny_model_dir, default_tokenizer, reference):
    """Prompts arriving one every 2 steps while others decode: each prefill pass also gives every running
    request its next token, so the same outputs take fewer forward passes than with separate passes."""
    passes = {}
    for mixed in (True, False):
        sched = make_scheduler(
            tiny_model_dir, default_tokenizer, max_running_requests=8, disable_mixed_batch=not mixed
        )
        res = run(sched, prompts(32), arrive_every=2)
        assert res["outs"] == reference
        stats = res["stats"]
        assert (stats["mixed_decode_tokens"] > 0) == mixed
        assert stats["generated_tokens"] == 32 * 12
        passes[mixed] = stats["extend_steps"] + stats["decode_steps"]
        assert_all_free(sched)
    assert passes[True] < passes[False]


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight", "random"])
def test_policies_keep_outputs(tiny_model_dir, default_tokenizer, reference, policy):
    sched = make_scheduler(tiny_model_dir, default_tokenizer, schedule_policy=policy, max_running_requests=8)
    assert run(sched, prompts(32))["outs"] == reference
    assert_all_free(sched)


def test_small_pool_forces_retraction_and_outputs_survive(tiny_model_dir, default_tokenizer, reference):
    # 32 requests of ~60-100 tokens each in a 400-slot pool: decode must run out and retract.
    sched = make_scheduler(
        tiny_model_dir, default_tokenizer, max_total_tokens=400, max_running_requests=32, new_token_ratio=0.0
    )
    res = run(sched, prompts(32))
    assert res["stats"]["retractions"] > 0
    assert res["outs"] == reference
    assert_all_free(sched)


def test_chunked_request_refused_slots_stays_queued(tiny_model_dir, default_tokenizer, reference):
    """A partly prefilled (chunked) request whose next chunk gets no slots must wait, not vanish: it holds
    KV, so losing it would leak slots and hang its client (seen with --disable-radix-cache under load)."""
    sched = make_scheduler(
        tiny_model_dir, default_tokenizer, disable_radix_cache=True, chunked_prefill_size=16
    )
    real_alloc, refused = sched.cm.alloc_slots, []

    def alloc_refusing_second_chunks(n):
        mid_prefill = any(0 < r.kv_len < len(r.prompt_ids) for r in sched.reextend)
        if mid_prefill and len(refused) < 3:
            refused.append(n)
            return None
        return real_alloc(n)

    sched.cm.alloc_slots = alloc_refusing_second_chunks
    got = run(sched, prompts(4))
    assert refused, "the test never refused a chunk"
    assert got["outs"] == {rid: reference[rid] for rid in got["outs"]}  # prompts(4) == prompts(32)[:4]
    assert_all_free(sched)


def test_abort_waiting_and_running(tiny_model_dir, default_tokenizer):
    sched = make_scheduler(tiny_model_dir, default_tokenizer, max_running_requests=2)
    for i, p in enumerate(prompts(6)):
        sched.handle(
            GenerateReq(
                rid=f"a{i}",
                input_ids=p,
                params=SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True),
            )
        )
    sched.step()
    sched.step()
    running = {r.rid for r in sched.running}
    assert running, "two requests should be decoding"
    sched.handle(AbortReq(rid=next(iter(running))))
    sched.handle(AbortReq(rid="a5"))  # still waiting
    finished = {}
    while sched.has_work():
        for o in sched.step():
            if o.finished_reason:
                finished[o.rid] = o.finished_reason["type"]
        sched.check_accounting()
    # The abort outputs were produced by the first step after handle().
    assert finished.get(next(iter(running))) in (None, "abort")
    assert [finished[f"a{i}"] for i in range(6) if f"a{i}" in finished].count("length") >= 4
    assert_all_free(sched)


def test_finish_reasons_and_validation(tiny_model_dir, default_tokenizer):
    sched = make_scheduler(tiny_model_dir, default_tokenizer, context_length=128)
    p = prompts(1)[0]
    sched.handle(GenerateReq(rid="long", input_ids=p, params=SamplingParams(max_new_tokens=500)))
    sched.handle(GenerateReq(rid="badtok", input_ids=[1, 99999], params=SamplingParams(max_new_tokens=4)))
    sched.handle(GenerateReq(rid="prefill", input_ids=p, params=SamplingParams(max_new_tokens=0)))
    ref = run(make_scheduler(tiny_model_dir, default_tokenizer), [p], max_new=8)["outs"]["r0"]
    stop_tok = ref[3]
    sched.handle(
        GenerateReq(
            rid="stoptok",
            input_ids=p,
            params=SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[stop_tok]),
        )
    )
    outs = {}
    while sched.has_work() or not outs:
        for o in sched.step():
            outs[o.rid] = o
    assert outs["long"].error and "context length" in outs["long"].error and outs["long"].error_status == 400
    assert outs["badtok"].error and "token ids" in outs["badtok"].error
    assert outs["prefill"].finished_reason["type"] == "length" and outs["prefill"].new_token_ids == []
    first = ref.index(stop_tok)
    assert outs["stoptok"].finished_reason == {"type": "stop", "matched": stop_tok}
    assert outs["stoptok"].new_token_ids == ref[: first + 1]
    assert_all_free(sched)
