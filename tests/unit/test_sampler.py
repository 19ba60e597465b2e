"""Sampler: exact filter masks, exact penalties, greedy/bans/grammar, logprobs, seeds, mixed batches."""

import math

import pytest
import torch

from runtime.model_executor.sampler import (
    Sampler,
    SamplingBatchInfo,
    apply_penalties,
    make_generator,
    make_generators,
    min_p_keep,
    sample_from_probs,
    sample_truncated,
    truncate_sorted,
)
from runtime.sampling_params import SamplingParams

V = 8  # vocab of the hand-made rows; the sampler then works on the whole vocabulary as candidates


def info_for(*params: SamplingParams, vocab: int = V) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_requests(list(params), vocab)


def sample(logits, params, n_rows=None, **kw):
    """Run the sampler on `logits` [1, V] repeated n_rows times (or [bs, V] as given)."""
    if n_rows is not None:
        logits = logits.expand(n_rows, -1).contiguous()
        params = [params] * n_rows
    bs = logits.shape[0]
    info = SamplingBatchInfo.from_requests(params, logits.shape[1])
    kw.setdefault("output_ids", [[] for _ in range(bs)])
    kw.setdefault("prompt_ids", [[] for _ in range(bs)])
    return Sampler()(logits, info, **kw)


def log_probs(ps: list[float]) -> torch.Tensor:
    return torch.tensor([ps]).log()


# ---------------------------------------------------------------- batch info


def test_batch_info_neutral_values_and_flags():
    info = info_for(
        SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2),  # greedy: filters irrelevant
        SamplingParams(temperature=0.7, top_k=100),  # top_k >= vocab: disabled
        SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.3),
    )
    assert info.temperatures.shape == (3, 1)
    assert info.temperatures.squeeze(1).tolist() == pytest.approx([1.0, 0.7, 1.0])  # greedy row -> 1.0
    assert info.top_ks.dtype == torch.int64 and info.top_ks.tolist() == [3, V, V]
    assert info.is_greedy.tolist() == [True, False, False]
    assert (info.is_all_greedy, info.has_greedy) == (False, True)
    assert not info.need_top_k and not info.need_top_p and not info.need_min_p  # only the greedy row asked
    assert info.repetition_rows == [2] and info.freq_presence_rows == [] and info.need_penalties
    assert info.seeded_rows == [2] and info.seeds == [None, None, 5]

    info = info_for(SamplingParams(top_k=1), SamplingParams(temperature=0.0))
    assert info.is_all_greedy and not info.need_penalties and info.seeded_rows == []

    info = info_for(SamplingParams(top_k=3), SamplingParams(top_k=5, top_p=0.9, min_p=0.1))
    assert (info.need_top_k, info.max_top_k, info.need_top_p, info.need_min_p) == (True, 5, True, True)


# ---------------------------------------------------------------- filter helpers


def kept_ids(kept_row: torch.Tensor) -> list[int]:
    return kept_row.nonzero().flatten().tolist()


def truncate(probs: list[float], top_k=V, top_p=1.0, min_p=0.0):
    """truncate_sorted on one row of descending probs; returns (kept positions, exact)."""
    kept, exact = truncate_sorted(
        torch.tensor([probs]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p])
    )
    return kept_ids(kept[0]), bool(exact[0])


def test_truncate_sorted_top_k_exact():
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    assert truncate(probs, top_k=2) == ([0, 1], True)
    assert truncate(probs, top_k=1) == ([0], True)
    assert truncate(probs, top_k=V) == ([0, 1, 2, 3, 4], True)  # disabled; candidates hold all the mass
    kept, _ = truncate_sorted(
        torch.tensor([probs]), torch.tensor([3]), torch.tensor([1.0]), torch.tensor([0.0])
    )
    assert kept[0].tolist() == pytest.approx([0.3, 0.25, 0.2, 0.0, 0.0])  # unnormalised, zeros elsewhere


def test_truncate_sorted_top_p_smallest_set_reaching_top_p():
    probs = [0.5, 0.3, 0.15, 0.05]  # mass before each: 0, .5, .8, .95
    assert truncate(probs, top_p=0.7)[0] == [0, 1]
    assert truncate(probs, top_p=0.85)[0] == [0, 1, 2]
    assert truncate(probs, top_p=0.1)[0] == [0]  # the most likely token always survives
    assert truncate(probs, top_p=0.99)[0] == [0, 1, 2, 3]


def test_truncate_sorted_top_p_renormalises_after_top_k():
    probs = [0.30, 0.25, 0.20, 0.15, 0.10]
    # top_k=3 leaves .4/.333/.267: top_p=.7 keeps 2 (on the raw probs it would keep 3)
    assert truncate(probs, top_k=3, top_p=0.7) == ([0, 1], True)
    assert truncate(probs, top_p=0.7) == ([0, 1, 2], True)


def test_truncate_sorted_min_p_relative_to_max():
    probs = [0.4, 0.3, 0.2, 0.1]
    assert truncate(probs, min_p=0.5)[0] == [0, 1, 2]  # threshold .2 is inclusive
    assert truncate(probs, top_p=0.5, min_p=0.9)[0] == [0]
    assert truncate(probs, top_k=3, min_p=0.6)[0] == [0, 1]


def test_truncate_sorted_reports_when_candidates_are_not_enough():
    few = [0.3, 0.2]  # 2 candidates out of a larger vocabulary, holding 0.5 of the mass
    assert truncate(few, top_p=0.4) == ([0, 1], True)  # mass before id1 is .3 < .4, and .5 >= .4 is covered
    assert truncate(few, top_p=0.6)[1] is False  # the set may need more tokens
    assert truncate(few, top_k=2, top_p=0.99) == ([0, 1], True)  # top-k fits: renormalised over 2 tokens


def test_sample_truncated_escalation_matches_whole_vocabulary():
    g = torch.Generator().manual_seed(11)
    n, vocab = 16, 3000
    probs = torch.softmax(torch.randn(n, vocab, generator=g) * 1.5, -1)  # flat: top-p sets need escalation
    top_ps = torch.rand(n, generator=g) * 0.9 + 0.05
    top_ks = torch.tensor([vocab] * 8 + [5, 50, 500, 20] * 2)
    min_ps = torch.tensor([0.0, 0.01] * 8)
    uniforms = 1.0 - torch.rand(n, generator=g)
    full = sample_truncated(probs, top_ks, top_ps, min_ps, uniforms, first_k=vocab)
    # 4 candidates (raised to 500 for the top-k rows) -> 32 -> 256 -> 2048 -> 3000 for top-p-only rows
    assert torch.equal(sample_truncated(probs, top_ks, top_ps, min_ps, uniforms, first_k=4), full)
    no_top_k = torch.full((n,), vocab)
    assert torch.equal(
        sample_truncated(probs, no_top_k, top_ps, min_ps, uniforms, first_k=4),
        sample_truncated(probs, no_top_k, top_ps, min_ps, uniforms, first_k=vocab),
    )
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    kept, exact = truncate_sorted(sorted_probs, top_ks, top_ps, min_ps)
    assert exact.all()
    for row in range(n):  # every id drawn is in its row's kept set
        assert kept[row, (order[row] == full[row]).nonzero().item()] > 0


def test_min_p_keep_exact_and_scale_free():
    probs = torch.tensor([[0.4, 0.2, 0.1, 0.3], [0.4, 0.2, 0.1, 0.3]])
    keep = min_p_keep(probs, torch.tensor([0.5, 0.0]))
    assert keep[0].tolist() == [True, True, False, True]  # threshold 0.5 * 0.4 = 0.2 (inclusive)
    assert keep[1].all()
    assert torch.equal(min_p_keep(probs * 0.25, torch.tensor([0.5, 0.0])), keep)


def test_sample_from_probs_inverse_cdf_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    ids = sample_from_probs(probs, torch.tensor([1e-7, 0.5, 0.5001, 1.0]))
    assert ids.tolist() == [1, 1, 3, 3]
    unnormalised = torch.tensor([[0.0, 2.0, 0.0, 6.0]] * 2)  # cdf 0, 2, 2, 8
    assert sample_from_probs(unnormalised, torch.tensor([0.25, 0.2501])).tolist() == [1, 3]


# ---------------------------------------------------------------- end-to-end filters (many samples)


def sampled_set_and_freqs(logits, params, n=20000):
    torch.manual_seed(1234)
    ids = sample(logits, params, n_rows=n).next_token_ids
    counts = torch.bincount(ids, minlength=logits.shape[1]).float()
    return set(ids.unique().tolist()), (counts / n).tolist()


def test_plain_sampling_matches_softmax_with_temperature():
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5, -3.0, 1.5, 0.2]])
    seen, freqs = sampled_set_and_freqs(logits, SamplingParams(temperature=2.0))
    expected = torch.softmax(logits[0] / 2.0, -1).tolist()
    assert seen == set(range(V))
    assert freqs == pytest.approx(expected, abs=0.012)


def test_top_k_sampling_keeps_exactly_k_and_renormalises():
    logits = torch.tensor([[1.0, 5.0, 3.0, 2.5, 0.0, 2.0, 4.0, -1.0]]) / 2
    seen, freqs = sampled_set_and_freqs(logits, SamplingParams(top_k=3))
    assert seen == {1, 6, 2}
    kept = torch.softmax(logits[0, [1, 6, 2]], -1).tolist()
    assert [freqs[1], freqs[6], freqs[2]] == pytest.approx(kept, abs=0.012)


def test_top_p_applies_to_distribution_left_by_top_k():
    # top_k=3 renormalises to .4/.333/.267, so top_p=0.7 keeps 2 tokens (over the raw probs it would keep 3)
    logits = log_probs([0.30, 0.25, 0.20, 0.15, 0.10, 0.0, 0.0, 0.0])
    seen, freqs = sampled_set_and_freqs(logits, SamplingParams(top_k=3, top_p=0.7))
    assert seen == {0, 1}
    assert freqs[0] == pytest.approx(0.30 / 0.55, abs=0.012)
    seen, _ = sampled_set_and_freqs(logits, SamplingParams(top_p=0.7))
    assert seen == {0, 1, 2}


def test_min_p_applies_after_temperature():
    logits = log_probs([0.5, 0.25, 0.125, 0.125, 0.0, 0.0, 0.0, 0.0])
    # temperature 0.5 squares the ratios to max: 1, .25, .0625, .0625 -> min_p .2 keeps {0, 1}
    seen, freqs = sampled_set_and_freqs(logits, SamplingParams(temperature=0.5, min_p=0.2))
    assert seen == {0, 1}
    assert freqs[0] == pytest.approx(0.8, abs=0.012)
    seen, _ = sampled_set_and_freqs(logits, SamplingParams(min_p=0.2))  # ratios 1, .5, .25, .25
    assert seen == {0, 1, 2, 3}


def test_top_p_then_min_p_both_apply():
    logits = log_probs([0.05, 0.4, 0.3, 0.15, 0.1, 0.0, 0.0, 0.0])
    seen, _ = sampled_set_and_freqs(logits, SamplingParams(top_p=0.9, min_p=0.3))
    assert seen == {1, 2, 3}  # top_p keeps {1,2,3,4}; min_p threshold .12 drops id 4 (.1)


# ---------------------------------------------------------------- penalties


RAW = [2.0, -1.0, 0.5, 0.0, 3.0, -2.0, 1.0, 0.25]


def penalised(params: SamplingParams, output_ids, prompt_ids) -> list[float]:
    logits = torch.tensor([RAW, RAW])
    info = info_for(params, SamplingParams())  # row 1 has no penalties and must stay untouched
    apply_penalties(logits, info, [output_ids, [0, 1, 2]], [prompt_ids, [3, 4]])
    assert logits[1].tolist() == RAW
    return logits[0].tolist()


def test_repetition_penalty_hf_semantics_over_prompt_and_output():
    out = penalised(SamplingParams(repetition_penalty=2.0), output_ids=[2, 2, 3], prompt_ids=[0, 1, 0])
    # seen {0,1,2,3}: positive / 2, negative * 2, zero stays 0; count does not matter
    assert out == [1.0, -2.0, 0.25, 0.0, 3.0, -2.0, 1.0, 0.25]


def test_frequency_and_presence_penalties_openai_semantics_over_output_only():
    out = penalised(SamplingParams(frequency_penalty=0.5), output_ids=[2, 2, 4], prompt_ids=[0, 1])
    assert out == [2.0, -1.0, -0.5, 0.0, 2.5, -2.0, 1.0, 0.25]
    out = penalised(SamplingParams(presence_penalty=0.75), output_ids=[2, 2, 4], prompt_ids=[0, 1])
    assert out == [2.0, -1.0, -0.25, 0.0, 2.25, -2.0, 1.0, 0.25]
    out = penalised(SamplingParams(frequency_penalty=-1.0), output_ids=[7, 7, 7], prompt_ids=[])
    assert out == [2.0, -1.0, 0.5, 0.0, 3.0, -2.0, 1.0, 3.25]  # negative penalties encourage


def test_all_penalties_together_repetition_first():
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = penalised(p, output_ids=[2, 2, 4], prompt_ids=[0, 1])
    # repetition over {0,1,2,4}: 1, -2, .25, 1.5; then id2: .25 - 1 - .25; id4: 1.5 - .5 - .25
    assert out == [1.0, -2.0, -1.0, 0.0, 0.75, -2.0, 1.0, 0.25]


def test_penalties_change_greedy_choice_but_not_logprobs():
    logits = torch.tensor(
        [[0.0, 3.0, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 8.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    )
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0),
    ]
    out = sample(logits, params, output_ids=[[1], [1]], prompt_ids=[[5], []])
    assert out.next_token_ids.tolist() == [2, 1]  # row 1: 8 -> 4 -> 3 still wins
    assert torch.equal(logits, before)  # the caller's logits are never modified
    ref = torch.log_softmax(before, -1)
    assert out.logprobs.tolist() == pytest.approx([ref[0, 2].item(), ref[1, 1].item()], abs=1e-6)


# ---------------------------------------------------------------- greedy, bans, grammar mask


def test_greedy_is_argmax_first_on_ties():
    logits = torch.tensor([[0.0, 4.0, 1.0, 4.0, 0, 0, 0, 0], [9.0, 1.0, 0, 0, 0, 0, 0, 10.0]])
    out = sample(logits, [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=1.5)])
    assert out.next_token_ids.tolist() == [1, 7]
    assert out.next_token_ids.dtype == torch.int64


def test_bans_and_vocab_mask_respected():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.1]] * 2)
    mask = torch.ones(2, V, dtype=torch.bool)
    mask[:, 2] = False
    out = sample(logits, [SamplingParams(temperature=0.0)] * 2, vocab_mask=mask, banned_token_ids=[[1], []])
    assert out.next_token_ids.tolist() == [3, 1]  # row 0: 1 banned, 2 masked; row 1: only 2 masked
    assert out.no_allowed_token.tolist() == [False, False]

    torch.manual_seed(0)
    n = 4000
    mask = torch.zeros(n, V, dtype=torch.bool)
    mask[:, [0, 2, 5, 7]] = True
    out = sample(
        torch.zeros(1, V), SamplingParams(), n_rows=n, vocab_mask=mask, banned_token_ids=[[7, 0]] * n
    )
    assert set(out.next_token_ids.tolist()) == {2, 5}


def test_bans_without_grammar_and_a_row_that_bans_everything():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.1]] * 3)
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 3, banned_token_ids=[[1, 2], list(range(V)), []])
    assert out.next_token_ids.tolist() == [3, 1, 1]
    assert out.no_allowed_token.tolist() == [False, True, False]
    assert torch.equal(logits, before)
    assert sample(logits, [SamplingParams()] * 3, banned_token_ids=[[], [], []]).no_allowed_token is None


def test_nothing_allowed_falls_back_and_flags_without_nan():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0, 0, 0, 0, 0], [0.0, 1.0, 3.0, 2.0, 0, 0, 0, 0]])
    mask = torch.zeros(2, V, dtype=torch.bool)
    mask[1, 0] = True
    mask[0, 3] = True
    for temperature in (0.0, 1.0):
        out = sample(
            logits, [SamplingParams(temperature=temperature)] * 2, vocab_mask=mask, banned_token_ids=[[3], []]
        )
        assert out.no_allowed_token.tolist() == [True, False]
        assert out.next_token_ids[1].item() == 0
        assert 0 <= out.next_token_ids[0].item() < V and torch.isfinite(out.logprobs).all()
    greedy = sample(
        logits, [SamplingParams(temperature=0.0)] * 2, vocab_mask=mask, banned_token_ids=[[3], []]
    )
    assert greedy.next_token_ids[0].item() == 2  # the unconstrained argmax


def test_vocab_mask_shape_is_checked():
    with pytest.raises(ValueError, match="vocab_mask"):
        sample(torch.zeros(1, V), [SamplingParams()], vocab_mask=torch.ones(1, V - 1, dtype=torch.bool))


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_at_chosen_token():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g) * 3
    mask = torch.ones(4, V, dtype=torch.bool)
    mask[:, :4] = False
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.3, top_k=2),
        SamplingParams(frequency_penalty=1.0, top_p=0.5),
        SamplingParams(temperature=1.7, min_p=0.1),
    ]
    out = sample(logits, params, vocab_mask=mask, output_ids=[[4], [5], [6, 6], [7]])
    ref = torch.log_softmax(logits, -1).gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, ref, atol=1e-6)
    assert (out.next_token_ids >= 4).all()
    assert out.top_logprobs is None


def test_top_logprobs_sorted_and_correct():
    logits = torch.tensor([[0.0, 2.0, -1.0, 3.0, 1.0, 0.5, -2.0, 2.5]] * 3)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 3, top_logprobs_nums=[3, 0, 20])
    ref = torch.log_softmax(logits[0], -1)
    top = out.top_logprobs
    assert [tid for _, tid in top[0]] == [3, 7, 1]
    assert [lp for lp, _ in top[0]] == pytest.approx([ref[3].item(), ref[7].item(), ref[1].item()], abs=1e-6)
    assert top[1] == []
    assert len(top[2]) == V and [lp for lp, _ in top[2]] == sorted((lp for lp, _ in top[2]), reverse=True)
    assert math.fsum(math.exp(lp) for lp, _ in top[2]) == pytest.approx(1.0, abs=1e-5)


# ---------------------------------------------------------------- seeds


def run_steps(logits_rows: torch.Tensor, params: list[SamplingParams], steps: int, generators=None):
    """Sample `steps` times from fixed logits; returns [steps][bs] token ids."""
    info = SamplingBatchInfo.from_requests(params, logits_rows.shape[1])
    generators = generators if generators is not None else make_generators(params)
    bs = len(params)
    sampler = Sampler()
    return [
        sampler(logits_rows, info, [[]] * bs, [[]] * bs, generators=generators).next_token_ids.tolist()
        for _ in range(steps)
    ]


def test_same_seed_same_sequence_and_different_seed_differs():
    logits = torch.zeros(1, V)
    a = run_steps(logits, [SamplingParams(seed=42)], 30)
    torch.manual_seed(999)  # the global RNG must not matter for seeded rows
    b = run_steps(logits, [SamplingParams(seed=42)], 30)
    c = run_steps(logits, [SamplingParams(seed=43)], 30)
    assert a == b
    assert a != c
    assert len({row[0] for row in a}) > 3  # it really samples: many different tokens over 30 steps


def test_seeded_request_independent_of_batch_composition_and_position():
    g = torch.Generator().manual_seed(7)
    vocab = 49152
    target = torch.randn(1, vocab, generator=g) * 2
    others = torch.randn(4, vocab, generator=g) * 2
    seeded = SamplingParams(seed=2024, temperature=0.8, top_p=0.95, top_k=50)
    alone = [step[0] for step in run_steps(target, [seeded], 8)]

    batch = torch.cat([others[:2], target, others[2:]])
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        seeded,
        SamplingParams(seed=1, min_p=0.1),
        SamplingParams(top_p=0.5),
    ]
    batched = [step[2] for step in run_steps(batch, params, 8)]
    assert batched == alone
    assert len(set(alone)) > 1


def test_greedy_seeded_rows_do_not_consume_their_generator():
    gen = make_generator(5)
    state = gen.get_state()
    run_steps(torch.randn(1, V), [SamplingParams(seed=5, temperature=0.0)], 3, generators=[gen])
    assert torch.equal(gen.get_state(), state)


def test_seeded_row_without_generator_is_an_error():
    params = [SamplingParams(seed=1)]
    with pytest.raises(ValueError, match="generator"):
        Sampler()(torch.zeros(1, V), info_for(*params), [[]], [[]])
    with pytest.raises(ValueError, match="seed 1"):
        Sampler()(torch.zeros(1, V), info_for(*params), [[]], [[]], generators=[None])
    assert make_generator(None) is None


# ---------------------------------------------------------------- mixed batches


def test_mixed_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.2, 0.1, 0.0, 0.0, 0.3]] * 4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(top_k=1),
        SamplingParams(temperature=5.0, seed=3),
    ]
    steps = run_steps(logits, params, 40)
    assert all(s[0] == 1 and s[2] == 1 for s in steps)
    assert len({s[1] for s in steps}) > 2 and len({s[3] for s in steps}) > 2


def test_logits_shape_is_checked():
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, V), info_for(SamplingParams()), [[]], [[]])
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(1, V + 1), info_for(SamplingParams()), [[]], [[]])
    with pytest.raises(ValueError, match="out of range"):
        sample(torch.zeros(1, V), [SamplingParams(presence_penalty=1.0)], output_ids=[[V]])


# ---- no per-step [bs, vocab] allocations ----


def test_bans_and_mask_write_into_out_and_restore_empty_rows():
    from runtime.model_executor.sampler import apply_bans_and_mask

    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[True, False, True], [False, True, False]])
    out = torch.empty_like(x)
    got, empty = apply_bans_and_mask(x, mask, [[2], [1]], out=out)
    assert got.data_ptr() == out.data_ptr()
    assert got[0].tolist() == [1.0, float("-inf"), float("-inf")]
    assert got[1].tolist() == [4.0, 5.0, 6.0]  # bans + mask left nothing: the row falls back to x
    assert empty.tolist() == [False, True]
    assert x.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]  # input untouched
    with pytest.raises(ValueError, match="separate"):
        apply_bans_and_mask(x, mask, None, out=x)


def test_sampler_reuses_its_buffers_across_steps():
    vocab = 50
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=0.0)]
    info = SamplingBatchInfo.from_requests(params, vocab)
    sampler = Sampler()
    mask = torch.ones(2, vocab, dtype=torch.bool)
    mask[:, 7] = False
    ptrs = set()
    for _step in range(3):
        logits = torch.randn(2, vocab)
        logits[:, 7] = 100.0  # masked out, so never chosen
        out = sampler(logits, info, [[1, 2]] * 2, [[3]] * 2, vocab_mask=mask, banned_token_ids=[[4], []])
        assert 7 not in out.next_token_ids.tolist() and 4 != out.next_token_ids[0]
        ptrs.add(tuple(b.data_ptr() for b in sampler._scratch))
    assert len(ptrs) == 1


def test_logprobs_are_skipped_only_when_not_asked():
    """need_logprobs=False: the same ids (greedy and sampled), no log_softmax; top-k logprobs still come."""
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=5)):
        info = info_for(params, params, params)
        full = Sampler()(logits, info, [[]] * 3, [[]] * 3, generators=[torch.Generator().manual_seed(1)] * 3)
        lean = Sampler()(
            logits,
            info,
            [[]] * 3,
            [[]] * 3,
            generators=[torch.Generator().manual_seed(1)] * 3,
            need_logprobs=False,
            top_logprobs_nums=[2, 0, 1],
        )
        assert torch.equal(full.next_token_ids, lean.next_token_ids)
        assert full.logprobs is not None and lean.logprobs is None
        assert [len(t) for t in lean.top_logprobs] == [2, 0, 1]


# ---------------------------------------------------------------- logit bias (OpenAI's logit_bias)


def test_logit_bias_moves_greedy_choice_and_leaves_logprobs_raw():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, 0.0, 0.0, 0.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0.0)])
    assert out.next_token_ids.tolist() == [1]
    out = sample(logits, [SamplingParams(temperature=0.0, logit_bias={"1": -1.0})])
    assert out.next_token_ids.tolist() == [3]  # 3.0 - 1.0 < 2.5
    out = sample(logits, [SamplingParams(temperature=0.0, logit_bias={"6": 100})])
    assert out.next_token_ids.tolist() == [6]
    assert out.logprobs.tolist() == pytest.approx(torch.log_softmax(logits, -1)[0, [6]].tolist())
    # only the row that sets a bias is biased; the other row of the same batch is untouched
    both = sample(
        logits.expand(2, -1).contiguous(),
        [SamplingParams(temperature=0.0, logit_bias={"6": 100}), SamplingParams(temperature=0.0)],
    )
    assert both.next_token_ids.tolist() == [6, 1]


def test_logit_bias_shifts_the_sampled_distribution_exactly():
    logits = log_probs([0.1] * 8)
    bias = {"2": math.log(3.0), "5": -100.0}  # token 2: 3x as likely; token 5: never (e^-100)
    out = sample(logits, SamplingParams(temperature=1.0, logit_bias=bias), n_rows=20_000)
    counts = torch.bincount(out.next_token_ids, minlength=8).float() / 20_000
    expected = torch.tensor([1, 1, 3, 1, 1, 0, 1, 1]) / 9
    assert counts.tolist() == pytest.approx(expected.tolist(), abs=0.015)
    assert counts[5] == 0


def test_logit_bias_cannot_override_the_grammar_mask():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[False, False, True, True, False, False, False, False]])
    params = [SamplingParams(temperature=0.0, logit_bias={"0": 100, "7": 100, "2": -100})]
    out = sample(logits, params, vocab_mask=mask)
    assert out.next_token_ids.tolist() == [3]  # 2 biased below 3; the biased-up 0 and 7 stay masked
    assert not bool(out.no_allowed_token.any())
    sampled = sample(
        logits,
        SamplingParams(temperature=1.0, logit_bias={"0": 100}),
        n_rows=500,
        vocab_mask=mask.expand(500, -1),
    )
    assert set(sampled.next_token_ids.tolist()) <= {2, 3}


def test_logit_bias_validation_names_the_field():
    assert SamplingParams(logit_bias={7: 1, "8": -100.0}).logit_bias == {"7": 1.0, "8": -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad, why in (
        ({"x": 1.0}, "key 'x' is not a token id"),
        ({"-1": 1.0}, "key '-1' is not a token id"),
        ({"1": 101}, r"logit_bias\['1'\] must be a number in \[-100, 100\]"),
        ({"1": True}, r"logit_bias\['1'\] must be a number"),
        ({"1": 1, "01": 2}, "names token 1 twice"),
        ([1, 2], "must be an object"),
    ):
        with pytest.raises(ValueError, match=why):
            SamplingParams(logit_bias=bad)
    assert SamplingParams(logit_bias={"8": 1}).logit_bias_problem(8) == (
        "logit_bias: token ids must be in [0, 8) (the vocabulary), got [8]"
    )
    assert SamplingParams(logit_bias={"7": 1}).logit_bias_problem(8) is None
