"""LoRA adapters through the real scheduler: greedy outputs equal transformers + peft's for each adapter in
batches mixed with the base model, KV cached under one adapter is a hit for that adapter only, adapters beyond
--max-loras take turns in the slots, and load / unload apply between steps without failing a request."""

from __future__ import annotations

import os

import pytest
import torch

from runtime.messages import GenerateReq, LoadLoraReq, LoraResp, RequestOptions, UnloadLoraReq
from runtime.sampling_params import SamplingParams
from tests.lora_fixtures import ALL_TARGETS, peft_model, save_random_adapter
from tests.scheduler_utils import make_scheduler

pytestmark = pytest.mark.model

PROMPT = [7, 99, 23, 401, 5, 66, 310, 12, 88, 254, 19, 3, 140, 77, 260, 31, 9, 480]
MAX_NEW = 6


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_sched")
    return {
        "a": save_random_adapter(tiny_model_dir, root / "a", seed=11, rank=8, targets=ALL_TARGETS),
        "b": save_random_adapter(
            tiny_model_dir, root / "b", seed=12, rank=4, targets=["q_proj", "down_proj"]
        ),
    }


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    """Greedy continuations of PROMPT and of a shorter prompt by transformers (+ peft for each adapter)."""
    from transformers import AutoModelForCausalLM

    models = {name: peft_model(tiny_model_dir, path) for name, path in adapters.items()}
    models[None] = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = {}
    for name, model in models.items():
        for prompt in (PROMPT, PROMPT[:9]):
            ids = list(prompt)
            with torch.no_grad():
                for _ in range(MAX_NEW):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out[(name, len(prompt))] = ids[len(prompt) :]
    assert len({tuple(v) for k, v in out.items() if k[1] == len(PROMPT)}) == 3  # the adapters matter
    return out


def _req(rid: str, prompt: list[int], lora: str | None) -> GenerateReq:
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return GenerateReq(rid=rid, input_ids=list(prompt), params=params, options=RequestOptions(lora=lora))


def _drain(sched, msgs=(), between=None) -> dict[str, dict]:
    """Submit `msgs`, step until idle (calling `between(step)` before each step); per rid: tokens, cached
    tokens, error."""
    for m in msgs:
        sched.handle(m)
    res: dict[str, dict] = {}
    steps = 0
    while sched.has_work():
        if between is not None:
            between(steps)
        for o in sched.step():
            r = res.setdefault(o.rid, {"ids": [], "cached": 0, "error": None})
            r["ids"] += o.new_token_ids
            r["cached"] = max(r["cached"], o.cached_tokens)
            if o.error:
                r["error"] = (o.error_status, o.error)
        sched.check_accounting()
        steps += 1
        assert steps < 2000
    return res


def _scheduler(tiny_model_dir, default_tokenizer, adapters, **kw):
    mods = tuple(f"{n}={p}" for n, p in adapters.items())
    return make_scheduler(tiny_model_dir, default_tokenizer, lora_modules=mods, max_loras=2, **kw)


def test_mixed_batch_equals_peft_and_cache_keeps_adapters_apart(
    tiny_model_dir, default_tokenizer, adapters, expected
):
    sched = _scheduler(tiny_model_dir, default_tokenizer, adapters)
    names = ["a", None, "b", "a", None, "b"]
    msgs = [_req(f"r{i}", PROMPT if i < 3 else PROMPT[:9], n) for i, n in enumerate(names)]
    res = _drain(sched, msgs)
    for i, n in enumerate(names):
        assert res[f"r{i}"]["error"] is None
        assert res[f"r{i}"]["ids"] == expected[(n, len(PROMPT) if i < 3 else 9)], (i, n)
    # PROMPT is cached under a, b and the base model now; a new adapter-less copy of the cache for each:
    # the same prompt again is a hit under its own adapter only
    sched.flush_cache()
    res = _drain(sched, [_req("warm", PROMPT, "a")])
    assert res["warm"]["cached"] == 0
    res = _drain(sched, [_req("b1", PROMPT, "b"), _req("base1", PROMPT, None)])
    assert res["b1"]["cached"] == 0 and res["base1"]["cached"] == 0
    res = _drain(sched, [_req("a2", PROMPT, "a"), _req("b2", PROMPT, "b"), _req("base2", PROMPT, None)])
    for rid, name in (("a2", "a"), ("b2", "b"), ("base2", None)):
        assert res[rid]["cached"] == len(PROMPT) - 1, rid  # its own earlier run's KV, all but the last token
        assert res[rid]["ids"] == expected[(name, len(PROMPT))], rid


def test_speculative_verification_runs_each_adapter_on_its_own_rows(
    tiny_model_dir, default_tokenizer, adapters
):
    """With drafts proposed (the prompt repeats itself, so n-gram lookup drafts its continuation), verify
    forwards run mixed adapter batches: every output still equals transformers + peft's greedy one."""
    from transformers import AutoModelForCausalLM

    prompt = PROMPT + PROMPT[:6]
    models = {name: peft_model(tiny_model_dir, path) for name, path in adapters.items()}
    models[None] = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    want = {}
    for name, model in models.items():
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(MAX_NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        want[name] = ids[len(prompt) :]
    sched = _scheduler(tiny_model_dir, default_tokenizer, adapters, speculative_algorithm="ngram")
    names = ["a", None, "b"]
    res = _drain(sched, [_req(f"s{i}", prompt, n) for i, n in enumerate(names)])
    assert sched.stats["spec_verified_drafts"] > 0  # drafts were verified, under the adapters
    for i, n in enumerate(names):
        assert res[f"s{i}"]["error"] is None and res[f"s{i}"]["ids"] == want[n], n


def test_more_adapters_than_slots_take_turns(tiny_model_dir, default_tokenizer, adapters, expected):
    """--max-loras 1 with two adapters in the queue: one waits for the slot, the other's last request frees
    it, the slot is reloaded; every output is still the adapter's own."""
    mods = tuple(f"{n}={p}" for n, p in adapters.items())
    sched = make_scheduler(tiny_model_dir, default_tokenizer, lora_modules=mods, max_loras=1)
    names = ["a", "b", "a", None, "b", "b", "a"]
    res = _drain(sched, [_req(f"r{i}", PROMPT, n) for i, n in enumerate(names)])
    for i, n in enumerate(names):
        assert res[f"r{i}"]["ids"] == expected[(n, len(PROMPT))], (i, n)
    info = sched.server_info()
    assert info["lora_slot_waits"] > 0 and info["lora_evictions"] > 0
    assert sched.lora.slot_refs == [0]


def test_load_unload_between_steps(tiny_model_dir, default_tokenizer, adapters, expected, tmp_path):
    sched = make_scheduler(tiny_model_dir, default_tokenizer, enable_lora=True, max_loras=2)
    # nothing loaded: a request naming an adapter is a 400
    res = _drain(sched, [_req("none", PROMPT, "a")])
    assert res["none"]["error"][0] == 400 and "'a' is not loaded" in res["none"]["error"][1]
    resp = sched.handle(LoadLoraReq(name="a", path=adapters["a"]))
    assert isinstance(resp, LoraResp) and resp.error is None and [x["name"] for x in resp.adapters] == ["a"]
    bad = sched.handle(LoadLoraReq(name="bad", path=str(tmp_path / "missing")))
    assert "is not a directory" in bad.error and [x["name"] for x in bad.adapters] == ["a"]
    dup = sched.handle(LoadLoraReq(name="a", path=adapters["b"]))
    assert "already loaded" in dup.error

    # unload a while its requests run, load b meanwhile: a's queued requests finish as a's
    def between(step):
        if step == 2:
            assert sched.handle(UnloadLoraReq(name="a")).error is None
            assert sched.handle(LoadLoraReq(name="b", path=adapters["b"])).error is None
            sched.handle(_req("b-late", PROMPT, "b"))
            sched.handle(_req("a-late", PROMPT, "a"))

    msgs = [_req(f"a{i}", PROMPT, "a") for i in range(3)] + [_req("base", PROMPT, None)]
    res = _drain(sched, msgs, between)
    for i in range(3):
        assert res[f"a{i}"]["ids"] == expected[("a", len(PROMPT))]
    assert res["base"]["ids"] == expected[(None, len(PROMPT))]
    assert res["b-late"]["ids"] == expected[("b", len(PROMPT))]
    assert res["a-late"]["error"][0] == 400
    assert sched.handle(UnloadLoraReq(name="a")).error == "LoRA adapter 'a' is not loaded"
    assert sched.lora.slot_refs == [0, 0] and all(
        a is None or a.name == "b" for a in sched.lora.slot_adapter
    )  # a's slot came free once its last request finished


def test_no_lora_server_refuses_adapter_requests(tiny_model_dir, default_tokenizer):
    sched = make_scheduler(tiny_model_dir, default_tokenizer)
    res = _drain(sched, [_req("x", PROMPT, "a")])
    assert res["x"]["error"][0] == 400 and "--enable-lora" in res["x"]["error"][1]
    assert "--enable-lora" in sched.handle(LoadLoraReq(name="a", path="/nowhere")).error


def test_host_tier_keeps_adapters_apart(tiny_model_dir, default_tokenizer, adapters):
    """A prompt cached under adapter a and moved to the host KV tier is a host hit for a only: b and the
    base model recompute it, and each output still equals transformers (+ peft)'s."""
    from transformers import AutoModelForCausalLM

    long_prompt = [4] + [(37 * i) % 500 + 10 for i in range(99)]
    refs = {n: peft_model(tiny_model_dir, p) for n, p in adapters.items()}
    refs[None] = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    want = {}
    for name, model in refs.items():
        ids = list(long_prompt)
        with torch.no_grad():
            for _ in range(MAX_NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        want[name] = ids[len(long_prompt) :]
    sched = _scheduler(
        tiny_model_dir, default_tokenizer, adapters, max_total_tokens=256, kv_host_tier_gb=0.01
    )

    def one(rid: str, prompt: list[int], lora: str | None) -> tuple[list[int], int, int]:
        sched.handle(_req(rid, prompt, lora))
        ids, cached, host = [], 0, 0
        while sched.has_work():
            for o in sched.step():
                assert o.error is None, o.error
                ids += o.new_token_ids
                cached, host = max(cached, o.cached_tokens), max(host, o.cached_tokens_host)
            sched.check_accounting()
        return ids, cached, host

    assert one("a0", long_prompt, "a")[0] == want["a"]
    one("evict", [5] + [(11 * i) % 500 + 10 for i in range(199)], None)  # a's KV moves to the host tier
    assert one("b", long_prompt, "b") == (want["b"], 0, 0)
    assert one("base", long_prompt, None) == (want[None], 0, 0)
    ids, cached, host = one("a1", long_prompt, "a")
    assert ids == want["a"] and cached == len(long_prompt) - 1 and host > 0


def test_adapter_requests_stay_out_of_the_shared_draft_index(
    tiny_model_dir, default_tokenizer, adapters, expected
):
    """`suffix` speculation's index is shared by every request; an adapter's request is salted with the
    adapter, so it neither feeds the index nor drafts from it. Outputs still equal transformers + peft's."""
    sched = _scheduler(tiny_model_dir, default_tokenizer, adapters, speculative_algorithm="suffix")
    shared = sched.spec.drafter.shared
    res = _drain(sched, [_req("a", PROMPT, "a"), _req("b", PROMPT, "b")])
    assert [res[r]["ids"] for r in "ab"] == [expected[("a", len(PROMPT))], expected[("b", len(PROMPT))]]
    assert len(shared) == 0
    res = _drain(sched, [_req("base", PROMPT, None)])
    assert res["base"]["ids"] == expected[(None, len(PROMPT))]
    assert len(shared) > 0  # the base model's request did feed it


def test_disk_tier_keeps_adapters_apart_across_a_restart(
    tiny_model_dir, default_tokenizer, adapters, tmp_path
):
    """Blocks written to the disk tier under adapter a are read back, after a restart, by a's requests only
    (their names hash the adapter's salt): b and the base model recompute the prompt; outputs equal
    transformers (+ peft)'s."""
    from transformers import AutoModelForCausalLM

    prompt = [4] + [(29 * i) % 500 + 10 for i in range(139)]  # two full 64-token blocks and a tail
    refs = {n: peft_model(tiny_model_dir, p) for n, p in adapters.items()}
    refs[None] = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    want = {}
    for name, model in refs.items():
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(MAX_NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        want[name] = ids[len(prompt) :]

    def one(sched, rid: str, lora: str | None) -> tuple[list[int], int]:
        sched.handle(_req(rid, prompt, lora))
        ids, disk = [], 0
        while sched.has_work():
            for o in sched.step():
                assert o.error is None, o.error
                ids += o.new_token_ids
                disk = max(disk, o.cached_tokens_disk)
            sched.check_accounting()
        return ids, disk

    first = _scheduler(tiny_model_dir, default_tokenizer, adapters, kv_disk_dir=str(tmp_path))
    assert one(first, "a0", "a") == (want["a"], 0)
    first.cm.save_to_disk()
    assert len(os.listdir(tmp_path)) >= 2
    restarted = _scheduler(tiny_model_dir, default_tokenizer, adapters, kv_disk_dir=str(tmp_path))
    assert one(restarted, "b", "b") == (want["b"], 0)
    assert one(restarted, "base", None) == (want[None], 0)
    ids, disk = one(restarted, "a1", "a")
    assert ids == want["a"] and disk >= 128
