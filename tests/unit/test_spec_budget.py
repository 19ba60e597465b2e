"""The draft budget: the step-cost fit and the trimming of drafts by expected tokens per second."""

import random

import pytest

from runtime.managers.scheduler.drafting import SpecState
from runtime.managers.scheduler.spec_budget import MIN_STEPS, WINDOW, DraftBudget, StepCostModel, attended


def _feed(
    model: StepCostModel, a: float, b: float, c: float, v: float = 0.0, n: int = 200, noise: float = 0.0
) -> None:
    """Steps of 1-8 requests over 50-4000 keys, a third of them plain decodes, the rest verifies."""
    rng = random.Random(0)
    for _ in range(n):
        contexts = [rng.randrange(50, 4000) for _ in range(rng.randrange(1, 9))]
        verify = rng.random() < 2 / 3
        rows = [1 + rng.randrange(0, 6) if verify else 1 for _ in contexts]
        work = attended(contexts, rows)
        secs = a + v * verify + b * sum(rows) + c * work
        model.observe(verify, sum(rows), work, secs * (1 + rng.uniform(-noise, noise)))


def test_the_fit_recovers_fixed_row_and_attention_costs():
    model = StepCostModel()
    _feed(model, a=5e-3, b=2e-4, c=1e-4, v=1e-3, noise=0.02)
    a, v, b, c = model.coef
    assert a == pytest.approx(5e-3, rel=0.1)
    assert v == pytest.approx(1e-3, rel=0.3)
    assert b == pytest.approx(2e-4, rel=0.25)
    assert c == pytest.approx(1e-4, rel=0.25)


def test_no_fit_and_no_trim_before_enough_steps():
    budget = DraftBudget()
    for _ in range(MIN_STEPS - 1):
        budget.observe([100], [1], 0.01, False)
    assert budget.cost.coef is None
    drafts = [[1, 2, 3], []]
    assert budget.trim(drafts, [100, 100], [0.1, 0.1]) == drafts


def test_the_first_fit_comes_once_enough_steps_are_seen():
    """A fresh server trims from its MIN_STEPS-th step on, not only after a whole refit interval."""
    budget = DraftBudget()
    for _ in range(MIN_STEPS):  # verify steps where each row costs as much as the whole fixed part
        for rows in (2, 5):
            budget.observe([100], [rows], 1e-3 + 1e-3 * rows, True)
    assert budget.cost.coef is not None
    assert budget.trim([[1, 2, 3, 4]], [100], [0.3]) == [[]]


def test_cheap_rows_keep_whole_drafts_and_dear_rows_keep_only_likely_ones():
    cheap = DraftBudget()
    _feed(cheap.cost, a=6e-3, b=1e-5, c=0.0)  # memory-bound batch-1 step: a row is ~free
    assert cheap.trim([[1, 2, 3, 4]], [200], [0.5]) == [[1, 2, 3, 4]]

    dear = DraftBudget()
    _feed(dear.cost, a=1e-3, b=1e-3, c=0.0)  # compute-bound: a row costs like the fixed part
    # 8 requests: the step makes 8 tokens in 9 ms; a token accepted with p=0.3 costs 1 ms -> not worth it
    assert dear.trim([[1, 2, 3, 4]] * 8, [200] * 8, [0.3] * 8) == [[]] * 8
    # with rows a tenth of that, near-certain drafts pay, but their tails (0.95^k) stop paying at some length
    tenth = DraftBudget()
    _feed(tenth.cost, a=1e-3, b=1e-4, c=0.0)
    kept = tenth.trim([[1, 2, 3, 4, 5, 6, 7, 8]] * 8, [200] * 8, [0.95] * 8)
    assert all(1 <= len(d) < 8 for d in kept)


def test_long_contexts_cost_more_rows_than_short_ones():
    budget = DraftBudget()
    _feed(budget.cost, a=2e-3, b=1e-4, c=2e-3)
    long_ctx, short_ctx = budget.trim([[1, 2, 3, 4], [1, 2, 3, 4]], [8000, 100], [0.6, 0.6])
    assert len(long_ctx) < len(short_ctx)


def test_acceptance_estimate_follows_recent_verifies_and_cut_drafts_judged_later():
    state = SpecState(k=4)
    for _ in range(6):
        state.record(4, 0, 8)
    assert state.alpha < 0.25 and state.k == 1
    # the budget now cuts every draft; the output turns into the text the drafts guessed
    ids = list(range(100))
    for _ in range(12):
        state.cut(len(ids), [ids[-1] + 1, ids[-1] + 2])
        ids.append(ids[-1] + 1)  # a plain decode step emits the first guessed token
        state.judge_cut(ids, 8)
    assert state.alpha > 0.8 and state.k == 8
    assert state.shadow is None
    # guesses that the output does not follow bring it down again
    for _ in range(12):
        state.cut(len(ids), [7])
        ids.append(ids[-1] + 1)
        state.judge_cut(ids, 8)
    assert state.alpha < 0.25


def test_rejected_cut_drafts_shrink_the_draft_and_skip_drafting_as_rejected_verifies_do():
    """Free text at batch 8: the budget cuts every draft and the output follows none of them. The request must
    stop proposing (a shorter draft, then skipped steps) instead of drafting every step for nothing."""
    judged, verified = SpecState(k=8), SpecState(k=8)
    ids = list(range(100))
    for _ in range(5):
        judged.cut(len(ids), [7] * judged.k)
        ids.append(ids[-1] + 1)
        judged.judge_cut(ids, 8)
        verified.record(verified.k, 0, 8)
    assert judged.k == verified.k == 1
    assert judged.skip == verified.skip > 0
    assert (judged.hits, judged.trials) == pytest.approx((verified.hits, verified.trials))


def test_a_cut_draft_waits_for_its_tokens_and_is_dropped_when_the_tokens_are_rewritten():
    state = SpecState(k=2)
    state.cut(10, [5, 6])
    before = (state.hits, state.trials)
    state.judge_cut(list(range(10)), 4)  # nothing emitted yet
    assert state.shadow is not None and (state.hits, state.trials) == before
    state.judge_cut(list(range(8)), 4)  # retokenized shorter: nothing to judge
    assert state.shadow is None and (state.hits, state.trials) == before


def test_stalled_steps_do_not_make_rows_look_dear():
    model = StepCostModel()
    _feed(model, a=5e-3, b=2e-4, c=0.0, n=WINDOW)
    clean = model.coef
    rng = random.Random(1)
    for _ in range(WINDOW // 10):  # one step in ten stalls for 50-200 ms, whatever its rows
        rows = rng.randrange(1, 40)
        model.observe(True, rows, 0.0, rng.uniform(0.05, 0.2))
    model.fit()
    assert model.coef[2] == pytest.approx(clean[2], rel=0.3)
    assert model.coef[0] == pytest.approx(clean[0], rel=0.3)


def test_a_dear_verify_step_is_skipped_unless_its_drafts_pay_for_it():
    budget = DraftBudget()
    # rows nearly free, but a verify step costs 5 ms more than a 5 ms plain step
    _feed(budget.cost, a=5e-3, b=1e-5, c=0.0, v=5e-3)
    # one request, drafts of 2 at alpha 0.3: ~1.4 tokens in ~10 ms < 1 token in 5 ms -> plain decode
    assert budget.trim([[1, 2]], [100], [0.3]) == [[]]
    # drafts of 8 at alpha 0.95: ~6.6 tokens in ~10 ms -> verify them
    assert budget.trim([[1] * 8], [100], [0.95]) == [[1] * 8]


def test_a_verify_step_must_beat_a_plain_one_by_the_margin():
    budget = DraftBudget()
    _feed(budget.cost, a=5e-3, b=1e-3, c=0.0)  # a plain step: 1 token in 6 ms; a draft token adds 1 ms
    # alpha 0.25: 1.25 tokens in 7 ms, 7 % better than plain: within the fit's error, so not worth it
    assert budget.trim([[1]], [100], [0.25]) == [[]]
    # alpha 0.6: 1.6 tokens in 7 ms, 37 % better: verify
    assert budget.trim([[1]], [100], [0.6]) == [[1]]
