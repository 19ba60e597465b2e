"""Speculative decoding (`--speculative-algorithm`): drafting, and verification that never changes what is
generated: greedy outputs identical, sampled distributions identical (chi-square), seeded draws identical,
stop conditions and max_new_tokens honoured inside an accepted run, every KV slot back after aborts; grammar-
constrained requests draft too, cut to what their grammar allows, with each verified row under the grammar's
mask at that position."""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter

import pytest

from runtime.managers.scheduler.drafting import LocalIndex, SequenceIndex, SpecState
from runtime.messages import AbortReq, GenerateReq
from runtime.sampling_params import SamplingParams
from tests.scheduler_utils import make_scheduler


# ---- drafting, no model ------------------------------------------------------------------------------------
def test_local_index_proposes_the_latest_continuation_of_the_longest_tail():
    idx = LocalIndex()
    ids = [1, 2, 3, 9, 8, 5, 2, 3, 7, 7, 4, 1, 2]
    idx.update(ids)
    # tail [1, 2] last occurred at 0..1 -> continuation 3, 9, 8
    assert idx.propose(ids, 3) == [3, 9, 8]
    ids += [3]  # tail [1, 2, 3]: same place, longest n wins over the later [2, 3] -> 7
    idx.update(ids)
    assert idx.propose(ids, 2) == [9, 8]
    ids2 = [5, 6, 7]
    idx2 = LocalIndex()
    idx2.update(ids2)
    assert idx2.propose(ids2, 4) == []  # 7 never occurred before the end


def test_local_index_copies_the_matching_block_of_repetitive_text_not_the_latest():
    # three "lines" that share their last 3 tokens (7, 8, 9) but differ earlier: copying line 2 must draft
    # line 2's continuation, although line 3 holds the latest (7, 8, 9)
    line = {1: [40, 41, 7, 8, 9, 101, 102], 2: [40, 42, 7, 8, 9, 201, 202], 3: [40, 43, 7, 8, 9, 301, 302]}
    ids = [5, *line[1], *line[2], *line[3], 6, 40, 42, 7, 8, 9]
    idx = LocalIndex()
    idx.update(ids)
    assert idx.propose(ids, 2) == [201, 202]
    # it keeps following line 2 while the output copies it, even where the tail alone is ambiguous
    ids += [201, 202]
    idx.update(ids)
    assert idx.propose(ids, 3) == [40, 43, 7]
    # a token that leaves the copy re-anchors on the tail
    ids += [40, 41]
    idx.update(ids)
    assert idx.propose(ids, 4) == [7, 8, 9, 101]
    # tokens rewritten (shorter than indexed): the index and the followed copy start again
    idx.update(ids[:4])
    assert idx.follow is None and idx.propose(ids[:4], 2) == []


def _copy_then(idx: LocalIndex, ids: list[int], copied: list[int]) -> list[int]:
    """Emit `copied` a few tokens per step, as verified drafts would be, so `idx` follows the copy."""
    for at in range(0, len(copied), 3):
        idx.update(ids)
        idx.propose(ids, 4)
        ids = ids + copied[at : at + 3]
    return ids


def test_local_index_copy_goes_on_past_an_edit():
    # a 20-token line copied with one token changed (an edited copy: a renamed identifier, a counter in
    # repeated lines): the draft after the edit is the rest of the line, not the continuation of the edited
    # token where it occurs elsewhere (45 -> 8, 9 in the prompt's other text)
    line = list(range(100, 120))
    prompt = [1, 2, 7, 45, 8, 9, 5, *line, 3]
    for edit, then, want in (
        ([45], [], [115, 116, 117, 118]),  # one token for one
        ([45], [46], [115, 116, 117, 118]),  # two tokens for one ("Paris" -> "Os" "lo")
        ([45], [116], [117, 118, 119, 3]),  # one token for two: the copy runs on where 116 is
    ):
        idx = LocalIndex()
        ids = _copy_then(idx, list(prompt), line[:14]) + edit
        idx.update(ids)
        draft = idx.propose(ids, 4)
        if then:  # that draft was rejected at its first token
            ids += then
            idx.update(ids)
            draft = idx.propose(ids, 4)
        assert draft == want, (edit, then)
    # the copy follows on after the edit
    idx = LocalIndex()
    ids = _copy_then(idx, list(prompt), line[:14]) + [45]
    idx.update(ids)
    assert idx.propose(ids, 2) == [115, 116]
    ids += [115, 116]
    idx.update(ids)
    assert idx.propose(ids, 2) == [117, 118]
    # an edit that grows past MAX_EDIT tokens has left the copy: the tail re-anchors (8 -> 9, 5)
    idx = LocalIndex()
    ids = _copy_then(idx, list(prompt), line[:14]) + [45]
    drafts = []
    for t in (60, 61, 62, 63, 8):
        idx.update(ids)
        drafts.append(idx.propose(ids, 2))
        ids.append(t)
    idx.update(ids)
    drafts.append(idx.propose(ids, 2))
    assert drafts == [[115, 116]] * 4 + [[], [9, 5]]


def test_local_index_repeats_a_one_token_edit_through_the_copy():
    # "f_4(x=4): g_4_4" written as "f_5(...": the copy drafts 5 where its source has 4 again, until the
    # output writes a 4 unchanged
    line = [*range(100, 112), 4, 112, 113, 4, 114, 4, 115]
    prompt = [1, 2, *line, 3]
    idx = LocalIndex()
    ids = _copy_then(idx, list(prompt), line[:12]) + [5]
    idx.update(ids)
    assert idx.propose(ids, 4) == [112, 113, 5, 114]
    ids += [112, 113, 5, 114]
    idx.update(ids)
    assert idx.propose(ids, 3) == [5, 115, 3]
    idx = LocalIndex()
    ids = _copy_then(idx, list(prompt), line[:12]) + [5]
    idx.update(ids)
    idx.propose(ids, 4)
    ids += [112, 113, 4]  # not repeated here
    idx.update(ids)
    assert idx.propose(ids, 3) == [114, 4, 115]


def test_local_index_short_copy_re_anchors_after_a_mismatch():
    # a copy that matched fewer than MIN_RUN tokens is no evidence of an edited copy: the mismatching token
    # re-anchors (45 occurs in the prompt followed by 8, 9)
    line = list(range(100, 120))
    idx = LocalIndex()
    ids = _copy_then(idx, [1, 2, 7, 45, 8, 9, 5, *line, 3], line[:9]) + [45]
    idx.update(ids)
    assert idx.propose(ids, 2) == [8, 9]


def test_skipping_ends_when_the_output_turns_into_a_copy():
    """A request that skips drafting after rejected drafts (free text) drafts again as soon as its last
    COPY_SIGNAL tokens occurred before, instead of waiting out the skip (up to MAX_COOLDOWN steps)."""
    from runtime.managers.scheduler.drafting import COPY_SIGNAL, Drafter

    drafter = Drafter("ngram", 4)
    state = SpecState(k=1, cooldown=16, skip=16)
    ids = [*range(1, 13), 20, 21, 22, 23, 5, 6, 7]
    assert COPY_SIGNAL == 6
    assert drafter.propose(state, ids, 1, True) == []  # only (5, 6, 7) occurred before: keep skipping
    assert state.skip == 15
    ids += [8, 9, 10]  # (5, 6, 7, 8, 9, 10) occurred before: the output copies
    assert drafter.propose(state, ids, 1, True) == [11]
    assert (state.skip, state.cooldown) == (0, 16)  # a rejection now skips 16 steps again
    shared = Drafter("suffix", 4)  # with `suffix`, a context of finished sequences counts too
    shared.learn([50, 51, 52, 53, 54], 0)
    state = SpecState(k=1, cooldown=16, skip=16)
    assert shared.propose(state, [30, 31, 32, 50, 51, 52, 53], 1, True) == [54]
    state = SpecState(k=1, cooldown=16, skip=16)
    assert shared.propose(state, [30, 31, 32, 50, 51, 52, 53], 1, False) == []  # salted: not shared


def _emit_by_verifying(drafter, prompt: list[int], out: list[int]) -> tuple[int, SpecState]:
    """Decode `out` after `prompt` as verify steps would: each step keeps the draft's prefix that matches
    `out` plus one token. (steps, the request's drafting state)"""
    from runtime.managers.scheduler.drafting import _matched

    state, ids, steps = SpecState(k=8), list(prompt), 0
    while len(ids) < len(prompt) + len(out):
        draft = drafter.propose(state, ids, 8, True)
        want = out[len(ids) - len(prompt) :]
        accepted = _matched(draft, want)
        if draft:
            state.record(len(draft), accepted, 8)
        ids += want[: accepted + 1]
        steps += 1
    return steps, state


def test_shared_index_drafts_first_once_it_beats_prompt_lookup():
    """An output that writes the prompt's text in another form (a list "a NL b NL ..." written back as
    "1 . a . 2 . b . ..."): prompt lookup keeps drafting the prompt's form after each item, while the shared
    index, which has seen a finished request write this output, drafts it right. One disagreement won by the
    shared index makes it draft first for that request."""
    from runtime.managers.scheduler.drafting import Drafter

    nl, dot = 1, 52
    items = list(range(10, 22))
    prompt = [100, 101, 102, *[t for x in items for t in (x, nl)], 200, 201]
    out = [t for i, x in enumerate(items) for t in (60 + i, dot, x, dot)]
    ngram_steps, _ = _emit_by_verifying(Drafter("ngram", 8), prompt, out)
    suffix = Drafter("suffix", 8)
    suffix.learn(prompt + out, len(prompt))  # a finished request wrote this output
    steps, state = _emit_by_verifying(suffix, prompt, out)
    assert state.lead > 0
    assert steps <= len(out) / 6 < ngram_steps / 2, (steps, ngram_steps)
    # the same prompt copied verbatim this time: prompt lookup stays first and drafts the copy as fast
    verbatim = [t for x in items for t in (x, nl)]
    steps, state = _emit_by_verifying(suffix, prompt, verbatim)
    assert state.lead <= 0 and steps <= len(verbatim) / 6, steps


def test_local_index_continues_text_that_repeats_into_its_own_end():
    # the source of the copy runs into the end of the tokens: the copy goes on with the text's period
    for ids, want in (([5, 1, 1, 1, 1], [1, 1, 1, 1]), ([1, 2, 3, 1, 2, 3, 1, 2], [3, 1, 2, 3, 1])):
        idx = LocalIndex()
        idx.update(ids)
        assert idx.propose(ids, len(want)) == want
        # and the next draft follows the same copy
        ids = ids + want[:2]
        idx.update(ids)
        assert idx.propose(ids, 3) == (want + want)[2:5]


def test_sequence_index_follows_the_most_frequent_continuation():
    idx = SequenceIndex()
    idx.add([10, 11, 12, 13, 14])
    idx.add([10, 11, 12, 13, 14])
    idx.add([10, 11, 12, 99, 98])
    assert idx.propose([5, 10, 11, 12], 3) == [13, 14]  # then no context (12, 13, 14) -> (13, 14) -> ends
    assert idx.propose([5, 6], 3) == []
    small = SequenceIndex(max_keys=20)
    for i in range(30):
        small.add([i, i + 100, i + 200, i + 300])
    assert len(small) <= 20


def test_draft_length_adapts_to_acceptance():
    st = SpecState(k=4)
    st.record(4, 4, max_k=8)
    assert st.k == 8
    st.record(8, 2, max_k=8)
    assert st.k == 3
    st.record(3, 0, max_k=8)
    assert st.k == 1
    st.record(1, 0, max_k=8)
    assert st.k == 1 and st.skip == 1  # at 1 token and still rejected: skip drafting for a while
    assert (st.verify_steps, st.accepted) == (4, 6)


def test_server_args_reject_bad_speculative_options():
    from runtime.server_args import ServerArgs

    with pytest.raises(ValueError, match="speculative-num-draft-tokens must be in 1..32"):
        ServerArgs(speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="speculative-algorithm must be one of"):
        ServerArgs(speculative_algorithm="eagle")
    assert ServerArgs().speculative_algorithm == "suffix"  # on by default: greedy outputs do not change


# ---- scheduler helpers -------------------------------------------------------------------------------------
def drive(sched, msgs, abort_at: dict[int, str] | None = None) -> dict:
    """Submit `msgs`, step until idle (checking the KV accounting every step); {rid: [ids, finish, logprobs,
    spec counts]}."""
    for m in msgs:
        sched.handle(m)
    res: dict[str, list] = {}
    steps = 0
    first_forwards = last_forwards = sched.stats["extend_steps"] + sched.stats["decode_steps"]
    deadline = time.monotonic() + 900
    while sched.has_work():
        if abort_at and steps in abort_at:
            sched.handle(AbortReq(rid=abort_at[steps]))
        for o in sched.step():
            r = res.setdefault(o.rid, [[], None, [], None])
            if o.replaced_tokens:  # jump-forward re-tokenized the tail
                del r[0][len(r[0]) - o.replaced_tokens :]
            r[0].extend(o.new_token_ids)
            r[2].extend(o.output_token_logprobs or [])
            if o.finished_reason:
                r[1] = o.finished_reason
            r[3] = o.spec or r[3]  # [verify steps, accepted draft tokens] of the request
        sched.check_accounting()
        steps += 1
        forwards = sched.stats["extend_steps"] + sched.stats["decode_steps"]
        if forwards == last_forwards:  # nothing ran (a grammar still compiling in its worker): don't spin
            time.sleep(0.001)
        last_forwards = forwards
        assert forwards - first_forwards < 20_000 and time.monotonic() < deadline, "requests never finished"
    return res


def gen(rid: str, ids: list[int], return_logprob: bool = False, **params) -> GenerateReq:
    params = {"max_new_tokens": 24, "temperature": 0.0, **params}
    return GenerateReq(rid=rid, input_ids=ids, params=SamplingParams(**params), return_logprob=return_logprob)


def assert_all_free(sched) -> None:
    assert not sched.has_work()
    sched.check_accounting()
    assert sched.flush_cache()
    assert sched.cm.allocator.available() == sched.cm.allocator.size


def chat_prompts(tokenizer) -> list[list[int]]:
    """54 prompts: half ask to copy or transform text in the prompt (long accepted runs), half free text."""
    rng = random.Random(7)
    words = "alpha beta gamma delta omega river stone cloud paper green quick lazy fox".split()
    repetitive, free = [], []
    for i in range(27):
        items = [f"{rng.choice(words)}_{rng.randrange(100)}" for _ in range(8)]
        kind = i % 3
        if kind == 0:
            text = "Repeat this list exactly, one item per line:\n" + "\n".join(items)
        elif kind == 1:
            tags = json.dumps(items[1:5])
            text = f'Return this JSON unchanged: {{"name": "{items[0]}", "tags": {tags}, "id": {i}}}'
        else:
            text = f"def f{i}(x):\n    return x + {i}\n\nCopy the function above and rename it to g{i}."
        repetitive.append(text)
        free.append(
            rng.choice(["Tell me about", "Write a short poem about", "Why is the sky", "Explain"])
            + f" {rng.choice(words)} {rng.choice(words)}."
        )
    msgs = [[{"role": "user", "content": t}] for t in repetitive + free]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


# ---- greedy: identical outputs ----------------------------------------------------------------------------
# float32 (the exactness setting) and the server's default numerics on the CPU: speculation is on by default,
# so it must not change a default server's greedy output either
NUMERICS = {
    "float32": {},
    "w4a8": {"quantization": "w4a8", "kv_cache_dtype": "float16", "attention_backend": "cpu"},
    # the default where the CPU has AMX-BF16: attention over a bfloat16 cache with tile products
    "w4a8-bf16kv": {"quantization": "w4a8", "kv_cache_dtype": "bfloat16", "attention_backend": "cpu"},
}


@pytest.mark.parametrize("numerics", list(NUMERICS))
def test_greedy_identical_with_speculation_default_model(default_model_dir, default_tokenizer, numerics):
    """54 chat prompts, half copy-style, half free text: the suffix drafter (prompt lookup, then the
    shared index of finished requests) must not change one token or logprob."""
    prompts = chat_prompts(default_tokenizer)
    msgs = [gen(f"p{i}", p, max_new_tokens=16, return_logprob=True) for i, p in enumerate(prompts)]

    def outputs(alg):
        sched = make_scheduler(
            default_model_dir,
            default_tokenizer,
            max_running_requests=54,
            speculative_algorithm=alg,
            **NUMERICS[numerics],
        )
        res = drive(sched, msgs)
        assert_all_free(sched)
        return res, sched.server_info()

    off, _ = outputs("none")
    on, info = outputs("suffix")
    assert {r: v[0] for r, v in on.items()} == {r: v[0] for r, v in off.items()}
    for rid in off:  # every emitted token has its logprob, as without speculation
        lp_on, lp_off = [e[0] for e in on[rid][2]], [e[0] for e in off[rid][2]]
        assert lp_on == pytest.approx(lp_off, abs=1e-3)
    assert info["spec_accept_length"] > 1.3, info  # the copy prompts are drafted well
    assert info["decode_steps"] < info["generated_tokens"] - len(prompts) * 3


def test_greedy_identical_with_ngram_drafts_tiny_model(tiny_model_dir, default_tokenizer, tiny_refs):
    """The real prompt-lookup drafter on prompts that repeat themselves (a random model loops, too)."""
    rng = random.Random(3)
    prompts = [p + out[:10] + p[: rng.randrange(2, 8)] for p, out in tiny_refs] + [p for p, _ in tiny_refs]
    msgs = [gen(f"g{i}", p, max_new_tokens=30, ignore_eos=True) for i, p in enumerate(prompts)]
    off = drive(make_scheduler(tiny_model_dir, default_tokenizer, max_running_requests=8), msgs)
    sched = make_scheduler(
        tiny_model_dir, default_tokenizer, max_running_requests=8, speculative_algorithm="ngram"
    )
    on = drive(sched, msgs)
    assert {r: v[0] for r, v in on.items()} == {r: v[0] for r, v in off.items()}
    assert sched.stats["spec_accepted_tokens"] > 0
    assert_all_free(sched)


# ---- tiny model: exact distributions, stops inside accepted runs, KV ---------------------------------------
def tiny_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(8, 40))] for _ in range(n)]


def oracle(refs: list[tuple[list[int], list[int]]], wrong: bool = False):
    """A drafter that knows each prompt's greedy output (or, with `wrong`, proposes a different token at
    every position): full acceptance (or none) makes the edge cases of verification deterministic."""

    def propose(state, ids, k, shared_ok):
        for p, o in refs:
            t = len(ids) - len(p)
            if t >= 0 and ids[: len(p)] == p and ids[len(p) :] == o[:t]:
                return [(x + 1) % 512 if wrong else x for x in o[t : t + k]]
        return []

    return propose


@pytest.fixture(scope="module")
def tiny_refs(tiny_model_dir, default_tokenizer):
    prompts = tiny_prompts(12)
    sched = make_scheduler(tiny_model_dir, default_tokenizer, max_running_requests=4)
    res = drive(sched, [gen(f"r{i}", p, max_new_tokens=40, ignore_eos=True) for i, p in enumerate(prompts)])
    return [(p, res[f"r{i}"][0]) for i, p in enumerate(prompts)]


def spec_sched(tiny_model_dir, tokenizer, refs, wrong=False, **kw):
    sched = make_scheduler(tiny_model_dir, tokenizer, speculative_algorithm="ngram", **kw)
    sched.spec.drafter.propose = oracle(refs, wrong)
    return sched


@pytest.mark.parametrize("wrong", [False, True])
def test_oracle_and_wrong_drafts_keep_outputs_logprobs_and_cache(
    tiny_model_dir, default_tokenizer, tiny_refs, wrong
):
    msgs = [
        gen(f"r{i}", p, max_new_tokens=40, ignore_eos=True, return_logprob=True)
        for i, (p, _) in enumerate(tiny_refs)
    ]
    off = make_scheduler(tiny_model_dir, default_tokenizer, max_running_requests=4)
    res_off = drive(off, msgs)
    sched = spec_sched(tiny_model_dir, default_tokenizer, tiny_refs, wrong, max_running_requests=4)
    res = drive(sched, msgs)
    for i, (_, out) in enumerate(tiny_refs):
        assert res[f"r{i}"][0] == out
        assert [e[1] for e in res[f"r{i}"][2]] == out  # one logprob entry per emitted token
        assert [e[0] for e in res[f"r{i}"][2]] == pytest.approx([e[0] for e in res_off[f"r{i}"][2]], abs=1e-4)
    st = sched.stats
    assert st["spec_verified_drafts"] > 0
    if wrong:
        assert st["spec_accepted_tokens"] == 0
    else:
        assert st["spec_accepted_tokens"] == st["spec_draft_tokens"]
        assert st["decode_steps"] < off.stats["decode_steps"] / 2
    # rejected tokens never reach the radix cache: it holds exactly what it holds without speculation
    assert sched.cm.cache.total_size() == off.cm.cache.total_size()
    assert_all_free(sched)


def test_a_request_bounds_or_turns_off_its_own_speculation(tiny_model_dir, default_tokenizer, tiny_refs):
    # the oracle drafts every request's exact continuation: only the per-request bound limits the drafts
    msgs = [
        gen("off", tiny_refs[0][0], max_new_tokens=40, ignore_eos=True, speculative_num_draft_tokens=0),
        gen("two", tiny_refs[1][0], max_new_tokens=40, ignore_eos=True, speculative_num_draft_tokens=2),
        gen("all", tiny_refs[2][0], max_new_tokens=40, ignore_eos=True, speculative_num_draft_tokens=32),
    ]
    sched = spec_sched(tiny_model_dir, default_tokenizer, tiny_refs, speculative_num_draft_tokens=4)
    res = drive(sched, msgs)
    assert [res[r][0] for r in ("off", "two", "all")] == [out for _, out in tiny_refs[:3]]
    assert res["off"][3] is None  # never drafted: no drafting state at all
    steps, accepted = res["two"][3]
    assert 2 * steps - 1 <= accepted <= 2 * steps  # drafts of 2 (the last may be cut by max_new_tokens)
    steps, accepted = res["all"][3]
    assert 2 * steps < accepted <= 4 * steps  # the server's bound (4) caps the request's 32
    assert_all_free(sched)
    # every request off: a step costs what it costs without speculation (no drafting, no step timing)
    sched = spec_sched(tiny_model_dir, default_tokenizer, tiny_refs)
    drive(sched, [gen(f"r{i}", p, speculative_num_draft_tokens=0) for i, (p, _) in enumerate(tiny_refs[:4])])
    assert sched.stats["spec_draft_steps"] == sched.stats["spec_verify_steps"] == 0
    assert not sched.spec.budget.cost.samples
    assert_all_free(sched)


def test_request_draft_bound_is_checked():
    assert SamplingParams(speculative_num_draft_tokens=0).speculative_num_draft_tokens == 0
    for bad, why in (
        (-1, r"must be in \[0, 32\]"),
        (33, r"must be in \[0, 32\]"),
        (2.0, "of type int"),
        (True, "boolean"),
    ):
        with pytest.raises(ValueError, match=f"speculative_num_draft_tokens .*{why}"):
            SamplingParams(speculative_num_draft_tokens=bad)


def test_max_new_tokens_and_stop_token_inside_an_accepted_run(tiny_model_dir, default_tokenizer, tiny_refs):
    p, out = tiny_refs[0]
    i = next(j for j in range(5, len(out)) if out[j] not in out[:j])  # a token's first occurrence
    sched = spec_sched(tiny_model_dir, default_tokenizer, tiny_refs, speculative_num_draft_tokens=8)
    res = drive(
        sched,
        [
            gen("len", p, max_new_tokens=11, ignore_eos=True),
            gen("stop", p, max_new_tokens=40, ignore_eos=True, stop_token_ids=[out[i]]),
        ],
    )
    assert res["len"][0] == out[:11] and res["len"][1] == {"type": "length", "length": 11}
    assert res["stop"][0] == out[: i + 1] and res["stop"][1] == {"type": "stop", "matched": out[i]}
    assert sched.stats["spec_accepted_tokens"] > 0
    assert_all_free(sched)


def test_stop_string_inside_an_accepted_run(tiny_model_dir, default_tokenizer, tiny_refs):
    p, out = tiny_refs[1]
    text = default_tokenizer.decode(out, skip_special_tokens=True)
    at = next(
        j for j in range(len(text) // 3, len(text)) if text[j : j + 3].isascii() and text[j : j + 3].isalpha()
    )
    stop = text[at : at + 3]
    msgs = [gen("s", p, max_new_tokens=40, ignore_eos=True, stop=[stop])]
    res_off = drive(make_scheduler(tiny_model_dir, default_tokenizer), msgs)
    sched = spec_sched(tiny_model_dir, default_tokenizer, tiny_refs, speculative_num_draft_tokens=16)
    res = drive(sched, msgs)
    assert res["s"][1] == {"type": "stop", "matched": stop} == res_off["s"][1]
    assert res["s"][0] == res_off["s"][0] and 3 < len(res["s"][0]) < 40
    assert sched.stats["spec_accepted_tokens"] > 0
    assert_all_free(sched)


def test_aborts_and_retraction_leave_no_kv(tiny_model_dir, default_tokenizer, tiny_refs):
    msgs = [gen(f"r{i}", p, max_new_tokens=40, ignore_eos=True) for i, (p, _) in enumerate(tiny_refs)]
    # drafts of 4: the oracle's drafts are always accepted, so 5 tokens a step leave every request running
    # when the aborts arrive (at the default 8 some would finish 40 tokens first)
    sched = spec_sched(
        tiny_model_dir, default_tokenizer, tiny_refs, max_running_requests=12, speculative_num_draft_tokens=4
    )
    res = drive(sched, msgs, abort_at={3: "r0", 5: "r4", 6: "r7"})
    assert {res[r][1]["type"] for r in ("r0", "r4", "r7")} == {"abort"}
    assert_all_free(sched)
    # a pool too small for all of them: decode retracts, outputs survive
    small = spec_sched(
        tiny_model_dir,
        default_tokenizer,
        tiny_refs,
        max_running_requests=12,
        max_total_tokens=300,
        new_token_ratio=0.0,
    )
    res = drive(small, msgs)
    assert small.stats["retractions"] > 0
    assert all(res[f"r{i}"][0] == out for i, (_, out) in enumerate(tiny_refs))
    assert_all_free(small)


def _chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of a two-sample chi-square homogeneity test (categories under 10 expected are pooled);
    Wilson-Hilferty approximation of the chi-square tail (no scipy here)."""
    na, nb = sum(a.values()), sum(b.values())
    pooled: Counter = Counter()
    for key in set(a) | set(b):
        pooled[key if a[key] + b[key] >= 20 else "rest"] += 0
    cats = list(pooled)
    ca = Counter({c: 0 for c in cats})
    cb = Counter({c: 0 for c in cats})
    for key, v in a.items():
        ca[key if key in pooled else "rest"] += v
    for key, v in b.items():
        cb[key if key in pooled else "rest"] += v
    stat = 0.0
    for c in cats:
        tot = ca[c] + cb[c]
        if tot == 0:
            continue
        for obs, n in ((ca[c], na), (cb[c], nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    df = max(1, len([c for c in cats if ca[c] + cb[c]]) - 1)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_distribution_unchanged_chi_square(tiny_model_dir, default_tokenizer, tiny_refs):
    """Drafts are the greedy continuation (the oracle), so sampled tokens often equal them (accepted) and
    often do not (resampled); the distribution of whole outputs must not move."""
    p, out = tiny_refs[2]
    n = 600
    params = dict(max_new_tokens=4, ignore_eos=True, temperature=0.8, top_k=4, repetition_penalty=1.2)
    msgs = [gen(f"d{i}", p, **params) for i in range(n)]

    def draws(sched):
        res = drive(sched, msgs)
        assert_all_free(sched)
        return Counter(tuple(v[0]) for v in res.values())

    off = draws(make_scheduler(tiny_model_dir, default_tokenizer, max_running_requests=64))
    sched = spec_sched(tiny_model_dir, default_tokenizer, tiny_refs, max_running_requests=64)
    on = draws(sched)
    stats = sched.stats
    assert stats["spec_accepted_tokens"] > n // 4  # the rule was exercised: many drafts accepted
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"] * 0.9  # and many rejected
    assert _chi_square_p(on, off) > 0.001, (on.most_common(8), off.most_common(8))
    # an always-accept rule would be caught: the drafted sequence is far likelier with it
    drafted = tuple(out[:4])
    assert abs(on[drafted] - off[drafted]) < 0.1 * n, (on[drafted], off[drafted])


def test_seeded_sampling_draws_the_same_tokens(tiny_model_dir, default_tokenizer, tiny_refs):
    params = dict(max_new_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9)
    msgs = [gen(f"s{i}", tiny_refs[i % 4][0], seed=i, **params) for i in range(24)]
    off = drive(make_scheduler(tiny_model_dir, default_tokenizer, max_running_requests=8), msgs)
    sched = spec_sched(tiny_model_dir, default_tokenizer, tiny_refs, max_running_requests=8)
    on = drive(sched, msgs)
    assert {r: v[0] for r, v in on.items()} == {r: v[0] for r, v in off.items()}
    assert sched.stats["spec_accepted_tokens"] > 0


# ---- constrained requests: drafts cut by the grammar, rows masked per position -----------------------------
def _grammar_manager(tokenizer, backend: str = "outlines"):
    from runtime.managers.scheduler.grammar_manager import GrammarManager
    from runtime.server_args import ServerArgs

    return GrammarManager(tokenizer, 49152, ServerArgs(grammar_backend=backend, grammar_workers=1))


def _constrained_req(manager, rid: str, regex: str, return_logprob: bool = False):
    from runtime.managers.scheduler.req import Req

    # max_new_tokens far from closing (grammar_manager.closing_token)
    params = SamplingParams(regex=regex, max_new_tokens=64)
    req = Req(rid=rid, prompt_ids=[5, 6], params=params, return_logprob=return_logprob)
    req.grammar = manager.compile_async(params).result(timeout=300).new_matcher()
    return req


def test_verify_masks_cut_drafts_and_mask_each_row_from_its_grammar_state(default_tokenizer):
    """Row j of a constrained request holds the mask after draft[:j]; the draft ends before a rejected
    token, after a terminating one, and after one into forced text (only where jump-forward applies); the
    matcher ends where it started; a grammar that raises fails its request alone."""
    import torch

    enc = lambda text: default_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids = enc("12-forced-abc")
    assert len(ids) == 6  # '1', '2', '-', 'forced', '-', 'abc'
    regex = r"[0-9]{2}-forced-[a-z]{1,3}"
    manager = _grammar_manager(default_tokenizer)
    try:
        jumps = _constrained_req(manager, "jumps", regex)
        logprobs = _constrained_req(manager, "logprobs", regex, return_logprob=True)  # no jump-forward
        rejects = _constrained_req(manager, "rejects", regex)
        moved = _constrained_req(manager, "moved", regex, return_logprob=True)
        moved.grammar.accept_token(ids[0])  # starts after '1'
        free = _constrained_req(manager, "free", regex)
        free.grammar = None
        reqs = [jumps, free, logprobs, rejects, moved]
        drafts = [ids, [7, 8, 9], ids, [ids[0], 1, ids[1]], ids[1:3] + enc("3")]
        before = [r.grammar.accepted_ids if r.grammar else None for r in reqs]
        got_reqs, got, mask = manager.verify_masks(reqs, drafts, fail=lambda r: pytest.fail(r.rid))
        assert got_reqs == reqs
        assert (
            got
            == [
                ids[:2],  # after '12' the grammar forces '-forced-': jump-forward's, not the draft's
                [7, 8, 9],
                ids,  # 'abc' completes the regex: nothing may follow
                ids[:1],  # <|im_start|> is rejected
                ids[1:3],  # '3' is rejected after '12-'
            ]
        )
        assert [r.grammar.accepted_ids if r.grammar else None for r in reqs] == before
        assert mask.shape == (sum(1 + len(d) for d in got), 49152)
        at = 0
        for req, draft, start in zip(reqs, got, before):
            for j in range(1 + len(draft)):
                if req.grammar is None:
                    assert bool(mask[at].all())
                else:
                    m = req.grammar.grammar.new_matcher()  # a fresh matcher walked to the row's state
                    m.accept_tokens(start + draft[:j])
                    want = torch.zeros(49152, dtype=torch.bool)
                    m.fill_vocab_mask(want)
                    assert torch.equal(mask[at], want), (req.rid, j)
                at += 1

        # a matcher that raises fails its request only; the others' rows are unaffected
        class Broken:
            def fill_vocab_mask(self, row):
                raise RuntimeError("injected fault")

            def rollback(self, n):
                pass

        broken = _constrained_req(manager, "broken", regex)
        broken.grammar = Broken()
        failed = []
        got_reqs, got, mask2 = manager.verify_masks([broken, rejects], [ids, [ids[0], 1]], fail=failed.append)
        assert failed == [broken] and got_reqs == [rejects] and got == [ids[:1]]
        assert mask2.shape[0] == 2 and int(mask2[0].sum()) == 10  # the ten digits
    finally:
        manager.shutdown()


CONSTRAINED_CASES = {
    "tool": (
        'Call get_weather for Paris for 3 days. Reply with JSON like {"name": "get_time", "arguments": '
        '{"city": "Lima", "days": 2}}.',
        {
            "json_schema": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": ["get_weather", "get_time"]},
                    "arguments": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 20},
                            "days": {"type": "integer", "minimum": 1, "maximum": 14},
                        },
                        "required": ["city", "days"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        },
    ),
    "copy": (
        'Return this JSON unchanged: {"name": "alpha_31", "tags": ["river_7", "stone_12", "cloud_5"]}',
        {
            "json_schema": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
                },
                "required": ["name", "tags"],
                "additionalProperties": False,
            }
        },
    ),
    "date": (
        "When did the first person walk on the moon? Answer YYYY-MM-DD.",
        {"regex": r"(19|20)\d{2}-[01]\d-[0-3]\d"},
    ),
    "email": (
        "Write the address alice@example.com and then stop.",
        {"regex": r"[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)"},
    ),
}


def _valid(text: str, params: dict) -> bool:
    import re

    import jsonschema

    if "regex" in params:
        return re.fullmatch(params["regex"], text) is not None
    jsonschema.validate(json.loads(text), params["json_schema"])
    return True


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("backend", ["outlines", "llguidance", "xgrammar"])
def test_constrained_requests_speculate_with_identical_greedy_outputs(
    default_model_dir, default_tokenizer, backend
):
    """Schemas and regexes, greedy, fp32: speculation off, with the real ngram drafter, with an oracle drafter
    (the output as drafted: constrained requests must verify drafts), with the oracle's draft broken by a
    token the grammar rejects after two tokens (cut there: never verified), and with only rejected tokens
    (no draft survives): the same tokens, finish reasons and valid outputs every time, and no KV left."""
    pytest.importorskip(backend if backend != "outlines" else "outlines_core")
    bad = 1  # <|im_start|>: a special token no grammar allows
    prompts = {
        rid: default_tokenizer.encode(
            default_tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for rid, (text, _) in CONSTRAINED_CASES.items()
    }
    msgs = [
        gen(rid, prompts[rid], max_new_tokens=120, **params) for rid, (_, params) in CONSTRAINED_CASES.items()
    ]
    sched = make_scheduler(
        default_model_dir,
        default_tokenizer,
        max_running_requests=8,
        speculative_algorithm="ngram",
        grammar_backend=backend,
    )
    spec, real_propose = sched.spec, sched.spec.drafter.propose

    def run(decoder, propose=None):
        sched.spec = decoder
        spec.drafter.propose = propose or real_propose
        before = dict(sched.stats)
        res = drive(sched, msgs)
        assert_all_free(sched)  # every slot back, and the next run starts from an empty cache
        for rid, (ids, finish, *_) in res.items():
            assert finish["type"] == "stop", (rid, finish)
            assert _valid(default_tokenizer.decode(ids, skip_special_tokens=True), CONSTRAINED_CASES[rid][1])
        return res, {k: sched.stats[k] - before[k] for k in before if isinstance(before[k], (int, float))}

    try:
        off, off_stats = run(None)
        refs = [(prompts[rid], off[rid][0]) for rid in CONSTRAINED_CASES]
        right = oracle(refs)

        def broken(at: int):
            def propose(state, ids, k, shared_ok):
                draft = right(state, ids, k, shared_ok)
                return draft[:at] + [bad] * (k - at) if draft else []

            return propose

        for mode, propose in [("ngram", None), ("right", right), ("cut", broken(2)), ("wrong", broken(0))]:
            on, st = run(spec, propose)
            assert {r: v[:2] for r, v in on.items()} == {r: v[:2] for r, v in off.items()}, mode
            if mode == "right":  # the constrained requests verified drafts and accepted them
                assert st["spec_verified_drafts"] > 0 and st["spec_accepted_tokens"] > 0, st
                assert st["decode_steps"] < off_stats["decode_steps"], (st, off_stats)
            elif mode == "cut":  # verified drafts hold at most the two tokens before the rejected one
                assert st["spec_verified_drafts"] > 0, st
                assert st["spec_draft_tokens"] <= 2 * st["spec_verified_drafts"], st
            elif mode == "wrong":  # nothing the grammar rejects is ever verified
                assert st["spec_verified_drafts"] == 0, st
    finally:
        sched.grammars.shutdown()


def test_logit_bias_applies_to_every_verified_row(tiny_model_dir, default_tokenizer, tiny_refs):
    """The oracle drafts the unbiased continuation; a bias that bans its 6th token must win over the draft
    (the verify rows are biased as the decode step's would be): the same tokens as without speculation."""
    prompt, out = tiny_refs[0]
    bias = {str(out[5]): -100.0, str(out[9]): -50.0}
    msgs = [gen("b", prompt, max_new_tokens=40, ignore_eos=True, logit_bias=bias)]
    plain = drive(make_scheduler(tiny_model_dir, default_tokenizer), msgs)["b"][0]
    assert plain[:5] == out[:5] and plain[5] != out[5]
    sched = spec_sched(tiny_model_dir, default_tokenizer, tiny_refs)
    assert drive(sched, msgs)["b"][0] == plain
    assert sched.stats["spec_accepted_tokens"] > 0  # the draft was used up to the banned token
    assert_all_free(sched)
