"""How many draft tokens a verify step should carry: the ones expected to pay for themselves.

A draft token is one more row in the forward. At batch 1 a row is almost free (the step reads every weight
once whatever the rows), so a long draft wins even when half of it is rejected; at batch 8, or over a long
context where each row attends to thousands of keys, a row costs a real share of the step, and drafts that
are usually rejected make the step slower than the tokens they add. The break-even depends on the machine,
the model, the batch and the context, so it is measured, not configured:

- `StepCostModel` fits the time of a decode or verify step as a + v * verify + b * rows + c * attended,
  where `verify` marks a verify step (sampling, checking and rewinding many rows costs beyond the forward)
  and `attended` is the sum over requests of rows x context (the attention work), by least squares over the
  recent steps of this process (both plain decodes and verifies), refitted every few steps;
- each request's per-token acceptance rate alpha is tracked in `SpecState` (recent verifies weigh more);
- `DraftBudget.trim` then keeps draft tokens greedily by expected tokens per second: draft token j of a
  request (0-based) is accepted with probability alpha^(j+1) and costs b + c * context; it is kept while that
  ratio beats the step's throughput so far (expected tokens / expected seconds), so the step's expected
  tokens per second only rises; unless the best such step is expected to beat a plain decode step's tokens
  per second by VERIFY_MARGIN, no draft is verified. The margin covers what the linear fit does not see: its
  own error, and the tail of a batch whose requests, sped up unevenly, finish apart and leave smaller, less
  efficient steps (free chat at batch 8 verified drafts whose expected gain was ~5 % and ran 8-12 % slower).

Until enough steps are seen (or when the fit is degenerate) drafts are not trimmed: the per-request draft
length adaptation in `drafting.SpecState` still bounds them.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np

WINDOW = 64  # recent steps the fit uses: the current workload (its contexts, its batch) decides
# steps between fits: one costs ~1 ms in the scheduler (cold caches after a forward); every 32 steps that was
# 0.2 % of free chat's step time at batch 8, where most steps have a request whose draft the budget weighs
REFIT_EVERY = 64
MIN_STEPS = 16  # steps seen before trimming starts
CONTEXT_UNIT = 1000.0  # `attended` is counted in rows x thousands of keys (keeps the fit well scaled)
VERIFY_MARGIN = 0.15  # a verify step must be expected this much faster per token than a plain one


class StepCostModel:
    """seconds ~ a + v * verify + b * rows + c * attended, fitted over the last WINDOW steps. `verify` is 1
    for a verify step: it samples, checks and rewinds many rows, which costs beyond its rows' forward."""

    def __init__(self):
        # (verify 0/1, rows, attended, seconds)
        self.samples: deque[tuple[float, float, float, float]] = deque(maxlen=WINDOW)
        self._coef: tuple[float, float, float, float] | None = None
        self._since_fit = 0

    def observe(self, verify: bool, rows: int, attended: float, seconds: float) -> None:
        self.samples.append((float(verify), float(rows), attended, seconds))
        self._since_fit += 1

    @property
    def coef(self) -> tuple[float, float, float, float] | None:
        """(a, v, b, c): first fitted when asked for once MIN_STEPS are seen, then refitted when REFIT_EVERY
        steps old; None before. Fitting on demand, not per observed step, costs nothing while no request has
        a draft to trim (free text whose drafting is skipped): the refits were ~0.6 % of a free-chat batch's
        scheduler time. The first fit must not wait REFIT_EVERY steps: on an 8B model a step takes ~0.2 s,
        and untrimmed drafts there made a fresh server's first 64 steps 1.7x slower than plain decoding."""
        if len(self.samples) >= MIN_STEPS and (self._coef is None or self._since_fit >= REFIT_EVERY):
            self.fit()
        return self._coef

    def fit(self) -> None:
        """Least squares with a weak ridge pull towards a prior in which half of a median step is fixed cost
        and half is per-row cost, so a window with little spread in rows still gives a sane answer. Steps
        far slower than the fit predicts (a stall: another process took the cores) are dropped and the fit
        redone, so one stall does not make every row look dear."""
        self._since_fit = 0
        data = np.asarray(self.samples, dtype=np.float64)
        x, secs = _features(data), data[:, 3]
        t_med = float(np.median(secs))
        if t_med <= 0:
            return
        # the prior as pseudo-observations, one per coefficient, each worth a quarter of a typical step: half
        # of a median step fixed, half per row
        r_med = float(max(np.median(data[:, 1]), 1.0))
        prior = np.array([0.5 * t_med, 0.0, 0.5 * t_med / r_med, 0.0])
        scale = 0.25 * np.array([1.0, 1.0, r_med, max(float(np.median(data[:, 2])), 1e-3)])
        x_prior, y_prior = np.diag(scale / t_med), scale * prior / t_med
        calm = np.ones(len(data), dtype=bool)
        for _ in range(8):  # each pass drops what the last fit calls a stall, then fits the rest again
            x_aug = np.vstack([x[calm] / t_med, x_prior])
            coef = np.linalg.lstsq(x_aug, np.concatenate([secs[calm] / t_med, y_prior]), rcond=None)[0]
            resid = secs - x @ coef
            mid = float(np.median(resid[calm]))
            spread = 1.4826 * float(np.median(np.abs(resid[calm] - mid))) + 0.02 * t_med
            now = resid <= mid + 3 * spread
            if now.sum() < MIN_STEPS or (now == calm).all():
                break
            calm = now
        a, v, b, c = (float(x) for x in coef)
        floor = 0.02 * t_med / r_med  # a row is never free: keeps the trimming from keeping everything
        self._coef = (max(a, 0.0), max(v, 0.0), max(b, floor), max(c, 0.0))

    def row_cost(self, context: int) -> float:
        _, _, b, c = self._coef
        return b + c * context / CONTEXT_UNIT

    def step_cost(self, verify: bool, rows: int, attended: float) -> float:
        a, v, b, c = self._coef
        return a + v * verify + b * rows + c * attended


def _features(data: np.ndarray) -> np.ndarray:
    """[1, verify, rows, attended] per sample row (verify, rows, attended, seconds)."""
    return np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2]])


def attended(contexts: list[int], rows: list[int]) -> float:
    """The attention work of a step: sum of rows x context, in CONTEXT_UNIT keys."""
    return sum(n * ctx for n, ctx in zip(rows, contexts)) / CONTEXT_UNIT


class DraftBudget:
    """Trims each step's drafts to the tokens expected to raise its tokens per second."""

    def __init__(self):
        self.cost = StepCostModel()

    def observe(self, contexts: list[int], rows: list[int], seconds: float, verify: bool) -> None:
        """A decode or verify step ran: `rows[i]` rows of request i, over `contexts[i]` keys, in `seconds`."""
        self.cost.observe(verify, sum(rows), attended(contexts, rows), seconds)

    def trim(self, drafts: list[list[int]], contexts: list[int], alphas: list[float]) -> list[list[int]]:
        """Each draft cut to the prefix worth verifying; all empty unless the best verify step is expected
        to beat a plain decode step per token by VERIFY_MARGIN. Unchanged before the first fit."""
        if not any(drafts) or self.cost.coef is None:
            return drafts
        base_rows = len(drafts)
        work = attended(contexts, [1] * base_rows)
        plain = self.cost.step_cost(False, base_rows, work)
        tokens = float(base_rows)  # every request emits at least one token
        seconds = self.cost.step_cost(True, base_rows, work)
        if plain <= 0 or seconds <= 0:
            return drafts
        keep = [0] * len(drafts)
        # max-heap of (tokens per second of the next draft token, request); a request's next token is pushed
        # once its previous one is kept (acceptance falls geometrically along a draft)
        heap = []
        for i, (d, ctx, alpha) in enumerate(zip(drafts, contexts, alphas)):
            if d:
                heap.append((-alpha / self.cost.row_cost(ctx), i, alpha))
        heapq.heapify(heap)
        while heap:
            neg_rate, i, gain = heapq.heappop(heap)
            cost = self.cost.row_cost(contexts[i])
            if -neg_rate <= tokens / seconds:
                break
            keep[i] += 1
            tokens += gain
            seconds += cost
            if keep[i] < len(drafts[i]):
                nxt = gain * alphas[i]
                heapq.heappush(heap, (-nxt / cost, i, nxt))
        if tokens / seconds <= (1 + VERIFY_MARGIN) * base_rows / plain:  # verifying does not pay this step
            return [[] for _ in drafts]
        return [d[:n] for d, n in zip(drafts, keep)]
