"""Token sampler: one decode step's raw logits -> next token ids and their logprobs.

Pipeline, applied row by row (one row = one request) and vectorised over the batch:

1. **Penalties** (only rows that set one; other rows are untouched):
   - repetition penalty ``p`` (HF/CTRL) over the *set* of prompt + output tokens: a positive logit is
     divided by ``p``, a negative (or zero) one multiplied by ``p``;
   - then frequency / presence penalties (OpenAI) over *output* tokens only:
     ``logit -= frequency * count + presence * (count > 0)``.
   Repetition goes first, on the raw logit's sign, as in vLLM.
   Then **logit bias** (OpenAI's ``logit_bias``, rows that set one): ``logit[id] += bias[id]``.
2. **Bans and grammar mask**: ``banned_token_ids`` (e.g. EOS / stop ids while the output is shorter than
   ``min_new_tokens``) and ``vocab_mask`` (True = allowed) set disallowed logits to ``-inf``. If that leaves
   *nothing* allowed in a row, the row ignores bans and mask for this step (so no NaN can appear) and
   ``SamplerOutput.no_allowed_token[row]`` is True: its token is the unconstrained choice, not a valid
   continuation, and the caller should finish the request (e.g. abort with a reason).
3. **Greedy rows** (``temperature == 0`` or ``top_k == 1``, i.e. ``SamplingParams.is_greedy``): argmax of the
   logits from step 2; ties go to the lowest token id.
4. **Sampled rows**: ``logits / temperature`` -> top-k -> top-p -> min-p -> sample. Each filter sees the
   distribution left by the previous one (renormalised):
   - top-k keeps exactly the k most likely tokens (among tokens of equal probability, the order is
     ``torch.topk``'s; this only matters for ties at the top-k / top-p cut);
   - top-p keeps the smallest set of most likely tokens whose cumulative probability is >= ``top_p``; the
     most likely token is always kept;
   - min-p keeps tokens with ``prob >= min_p * max_prob``;
   - sampling is inverse-CDF with one uniform draw per row (over token ids in id order, or over the
     top-k/top-p candidates in descending order) and never picks a token of zero probability.

Logprobs are always those of the **raw** model logits (before penalties, masks and temperature), which is
what OpenAI and SGLang report: ``logprobs[i] = log_softmax(logits[i])[next_token_ids[i]]``.

**Seeds.** A request with a seed draws its uniform from its own ``torch.Generator`` (``make_generator``),
exactly one draw per sampled step, so its tokens depend only on its seed, its own logits and its step
number -- not on batch composition or its position in the batch. The caller creates the generator once when
the request is admitted and passes the same object at every step (a fresh generator per step would repeat
the same draw). Unseeded rows use torch's global RNG. Greedy rows draw nothing.

**Cost.** What to skip is decided from the Python ``SamplingParams`` (no device sync). An all-greedy batch
without penalties or masks is one log_softmax plus one max. Rows with top-k / top-p are sampled in a
"candidate space": the ``k`` most likely tokens, sorted, where the filters and the draw are cheap. On CPU a
full vocabulary sort costs 5-13 ms per row (49k vocab, measured), so ``k`` starts at
``max(CPU_FIRST_CANDIDATES, largest top_k)`` and grows only for rows whose top-p set does not fit; on CUDA it
is the whole vocabulary (one sort, no sync). Penalties and bans touch only the listed token ids, but rebuild
them from the id lists each step (cost ~ total tokens of the penalised rows).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixlm_kernels.cpu_backend import has_cpu_kernels
from runtime.sampling_params import SamplingParams

CPU_FIRST_CANDIDATES = 256  # top-p sets of real LM distributions usually fit; bigger ones escalate x8


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for `seed` (None when unseeded).
    Create once per request, keep across steps.
    """
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def make_generators(
    params: Sequence[SamplingParams], device: torch.device | str = "cpu"
) -> list[torch.Generator | None]:
    return [make_generator(p.seed, device) for p in params]


@dataclass
class SamplingBatchInfo:
    """Per-batch sampling tensors, built once per batch from the requests' SamplingParams.

    The ``need_*`` flags and row lists come from Python values, so deciding what to skip never syncs the
    device. Disabled values are neutral: top_p 1, top_k ``vocab_size``, min_p 0, penalties 0 / 1.

    The per-row tensors (``temperatures`` ... ``is_greedy``) are built on first use: an all-greedy batch
    without penalties never reads them, and building them was ~15 us of a batch-1 decode step.
    """

    params: Sequence[SamplingParams]
    device: torch.device | str
    top_k_list: list[int]  # top_k per row; vocab_size where disabled
    seeds: list[int | None]
    vocab_size: int
    is_all_greedy: bool
    has_greedy: bool
    need_top_k: bool  # some sampled row has 1 < top_k < vocab_size
    need_top_p: bool  # some sampled row has top_p < 1
    need_min_p: bool  # some sampled row has min_p > 0
    max_top_k: int  # largest enabled top_k among sampled rows (0 if none)
    truncated_rows: list[int]  # sampled rows with top-k or top-p: sampled in candidate space
    plain_rows: list[int]  # other sampled rows: sampled over the whole vocabulary
    seeded_rows: list[int]  # sampled rows with a seed: they draw from their own generator
    repetition_rows: list[int]  # rows with repetition_penalty != 1
    freq_presence_rows: list[int]  # rows with a non-zero frequency or presence penalty
    bias_rows: list[int]  # rows with a logit_bias

    _tensors: tuple[torch.Tensor, ...] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seeds)

    def _row_tensors(self) -> tuple[torch.Tensor, ...]:
        t = self._tensors
        if t is None:
            params, device = self.params, self.device
            greedy = [p.is_greedy for p in params]
            floats = torch.tensor(
                [
                    [1.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)],
                    [float(p.top_p) for p in params],
                    [float(p.min_p) for p in params],
                    [float(p.frequency_penalty) for p in params],
                    [float(p.presence_penalty) for p in params],
                    [float(p.repetition_penalty) for p in params],
                ],
                dtype=torch.float32,
            ).to(device)  # one host->device copy for all float fields
            top_ks = torch.tensor(self.top_k_list, dtype=torch.int64).to(device)
            is_greedy = torch.tensor(greedy, dtype=torch.bool).to(device)
            t = self._tensors = (floats[0].unsqueeze(1), *floats[1:], top_ks, is_greedy)
        return t

    @property
    def temperatures(self) -> torch.Tensor:  # [bs, 1] float32; 1.0 on greedy rows, so dividing is always safe
        return self._row_tensors()[0]

    @property
    def top_ps(self) -> torch.Tensor:  # [bs] float32
        return self._row_tensors()[1]

    @property
    def min_ps(self) -> torch.Tensor:  # [bs] float32
        return self._row_tensors()[2]

    @property
    def frequency_penalties(self) -> torch.Tensor:  # [bs] float32
        return self._row_tensors()[3]

    @property
    def presence_penalties(self) -> torch.Tensor:  # [bs] float32
        return self._row_tensors()[4]

    @property
    def repetition_penalties(self) -> torch.Tensor:  # [bs] float32
        return self._row_tensors()[5]

    @property
    def top_ks(self) -> torch.Tensor:  # [bs] int64; vocab_size where disabled
        return self._row_tensors()[6]

    @property
    def is_greedy(self) -> torch.Tensor:  # [bs] bool
        return self._row_tensors()[7]

    @property
    def need_penalties(self) -> bool:
        """Whether some row's logits change before the mask (penalties or a logit bias)."""
        return bool(self.repetition_rows or self.freq_presence_rows or self.bias_rows)

    @classmethod
    def from_requests(
        cls, params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str = "cpu"
    ) -> SamplingBatchInfo:
        if not params:
            raise ValueError("SamplingBatchInfo needs at least one request")
        greedy = [p.is_greedy for p in params]
        top_ks = [p.top_k if 1 <= p.top_k < vocab_size else vocab_size for p in params]
        sampled = [i for i, g in enumerate(greedy) if not g]
        truncated = [i for i in sampled if top_ks[i] < vocab_size or params[i].top_p < 1.0]
        plain = sorted(set(sampled) - set(truncated))
        return cls(
            params=params,
            device=device,
            top_k_list=top_ks,
            seeds=[p.seed for p in params],
            vocab_size=vocab_size,
            is_all_greedy=not sampled,
            has_greedy=len(sampled) < len(params),
            need_top_k=any(top_ks[i] < vocab_size for i in sampled),
            need_top_p=any(params[i].top_p < 1.0 for i in sampled),
            need_min_p=any(params[i].min_p > 0.0 for i in sampled),
            max_top_k=max((top_ks[i] for i in sampled if top_ks[i] < vocab_size), default=0),
            truncated_rows=truncated,
            plain_rows=plain,
            seeded_rows=[i for i in sampled if params[i].seed is not None],
            repetition_rows=[i for i, p in enumerate(params) if p.repetition_penalty != 1.0],
            freq_presence_rows=[
                i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            ],
            bias_rows=[i for i, p in enumerate(params) if p.logit_bias],
        )


@dataclass
class SamplerOutput:
    next_token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor | None  # [bs] float32, log_softmax of the RAW logits at next_token_ids; None if
    # not asked (need_logprobs=False)
    top_logprobs: (
        list[list[tuple[float, int]]] | None
    )  # per row, (logprob, token_id) best first; None if not asked
    no_allowed_token: torch.Tensor | None = None  # [bs] bool: bans+mask left nothing; None if none were given

    def logprob_list(self) -> list[float]:
        """`logprobs` as a list, or zeros (which nobody reads) when they were not asked for."""
        if self.logprobs is None:
            return [0.0] * len(self.next_token_ids)
        return self.logprobs.tolist()


def greedy_ids(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (first index on ties, NaN counting as the maximum, as torch.argmax): the C++
    `radixlm::row_argmax` on CPU float32 rows when loaded (torch.argmax is not vectorised on the CPU: ~90 µs
    per 49k-vocabulary row), else torch.argmax."""
    cpu_rows = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    if cpu_rows and _has_row_argmax():
        return torch.ops.radixlm.row_argmax(x)[0]
    return x.argmax(dim=-1)


_row_argmax_loaded = False  # once loaded, a library stays loaded: only a positive answer is remembered


def _has_row_argmax() -> bool:
    global _row_argmax_loaded
    if not _row_argmax_loaded:
        _row_argmax_loaded = has_cpu_kernels("radixlm::row_argmax")
    return _row_argmax_loaded


# ---- filters and draws (tested directly) ----


def truncate_sorted(
    probs_sorted: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p, then min-p on each row's k most likely tokens.

    probs_sorted [m, k]: descending probabilities of the k candidates, from a distribution over the whole
    vocabulary that sums to 1. ``top_ks[i] > k`` must mean "top-k disabled" (callers use k >= every enabled
    top_k). Returns (kept [m, k]: probs with dropped tokens zeroed, unnormalised;
    exact [m] bool: the candidates were enough, i.e. top_k <= k, or they hold >= top_p of the mass).
    A row that is not exact must be retried with more candidates; its `kept` is meaningless.
    """
    k = probs_sorted.shape[1]
    rank = torch.arange(k, device=probs_sorted.device)
    in_top_k = rank < top_ks.unsqueeze(1)  # [m, k]
    top_k_probs = torch.where(in_top_k, probs_sorted, 0.0)
    cum = top_k_probs.cumsum(dim=-1)  # [m, k]
    # Mass of the top-k set, to renormalise for top-p: known if top_k <= k, else top-k is disabled (mass 1).
    top_k_mass = torch.where(top_ks <= k, cum[:, -1], 1.0).unsqueeze(1)
    top_ps = top_ps.unsqueeze(1)
    mass_before = cum - top_k_probs  # exactly 0 for the most likely token, which top-p always keeps
    keep = in_top_k & ((mass_before < top_ps * top_k_mass) | (top_ps >= 1.0))
    keep &= probs_sorted >= min_ps.unsqueeze(1) * probs_sorted[:, :1]
    exact = (top_ks <= k) | (cum[:, -1] >= top_ps.squeeze(1))
    return torch.where(keep, probs_sorted, 0.0), exact


def min_p_keep(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Keep-mask [bs, vocab]: prob >= min_p * max_prob (scale-free, so `probs` need not be normalised)."""
    return probs >= min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw. probs [bs, n] >= 0 (unnormalised ok), uniforms [bs] in (0, 1] -> column ids [bs].

    Picks the first column whose cumulative mass reaches u * total. With u > 0 a zero-probability column
    can never be first (its cumulative mass equals its predecessor's), and u <= 1 keeps the index in range.
    """
    cdf = probs.cumsum(dim=-1)  # [bs, n], non-decreasing
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)  # [bs, 1]
    return torch.searchsorted(cdf, targets).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def sample_truncated(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    uniforms: torch.Tensor,
    first_k: int,
) -> torch.Tensor:
    """Draw from probs [n, vocab] (normalised) after top-k/top-p/min-p -> token ids [n].

    Works on the `first_k` most likely tokens (raised to the largest enabled top_k) and retries the rows
    whose top-p set did not fit with 8x more. A row's draw is the same whatever k it was resolved at.
    """
    n, vocab = probs.shape
    k = min(vocab, max(first_k, 1))
    if k < vocab:  # truncate_sorted needs every enabled top_k inside the candidates
        k = max(k, int(top_ks.masked_fill(top_ks >= vocab, 0).max()))
    out = torch.empty(n, dtype=torch.int64, device=probs.device)
    rows = torch.arange(n, device=probs.device)
    sub = probs
    while True:
        cand_probs, cand_ids = sub.topk(k, dim=-1)  # [m, k], descending
        kept, exact = truncate_sorted(cand_probs, top_ks[rows], top_ps[rows], min_ps[rows])
        picked = cand_ids.gather(1, sample_from_probs(kept, uniforms[rows]).unsqueeze(1)).squeeze(1)
        if k == vocab:  # the whole vocabulary: every row is exact, and no sync is needed
            out[rows] = picked
            return out
        out[rows[exact]] = picked[exact]
        if bool(exact.all()):
            return out
        rows = rows[~exact]
        sub = probs.index_select(0, rows)
        k = min(vocab, k * 8)


# ---- penalties and bans: only the listed token ids are touched ----


def _flat_keys(rows: Sequence[int], id_lists: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """row * vocab + id for every id of id_lists[j] (which belongs to batch row rows[j]); int64, on device."""
    ids = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token id out of range [0, {vocab})")
    row_of = torch.repeat_interleave(
        torch.tensor(list(rows), dtype=torch.int64),
        torch.tensor([len(x) for x in id_lists], dtype=torch.int64),
    )
    return (row_of * vocab + ids).to(device)


def apply_penalties(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    output_ids: Sequence[Sequence[int]],
    prompt_ids: Sequence[Sequence[int]],
) -> None:
    """Repetition, then frequency/presence penalties, then logit biases, in place on contiguous logits
    [bs, vocab]."""
    vocab = logits.shape[1]
    flat = logits.view(-1)
    if info.repetition_rows:
        rows = info.repetition_rows
        seen = [[*prompt_ids[r], *output_ids[r]] for r in rows]
        keys = _flat_keys(rows, seen, vocab, logits.device).unique()  # each (row, token) once
        p = info.repetition_penalties[keys // vocab]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / p, values * p)
    if info.freq_presence_rows:
        rows = info.freq_presence_rows
        keys, counts = _flat_keys(rows, [output_ids[r] for r in rows], vocab, logits.device).unique(
            return_counts=True
        )
        row_of = keys // vocab
        flat[keys] -= info.frequency_penalties[row_of] * counts + info.presence_penalties[row_of]
    if info.bias_rows:
        rows = info.bias_rows
        biases = [info.params[r].logit_bias or {} for r in rows]
        keys = _flat_keys(rows, [[int(k) for k in b] for b in biases], vocab, logits.device)
        values = torch.tensor([v for b in biases for v in b.values()], dtype=logits.dtype)
        flat.index_add_(0, keys, values.to(logits.device))  # keys are unique: a dict per row


_NEG_INF: dict[torch.device, torch.Tensor] = {}  # one 0-dim -inf per device, not one per step


def _neg_inf(device: torch.device) -> torch.Tensor:
    t = _NEG_INF.get(device)
    if t is None:
        t = _NEG_INF[device] = torch.tensor(float("-inf"), device=device)
    return t


def apply_bans_and_mask(
    x: torch.Tensor,
    vocab_mask: torch.Tensor | None,
    banned_token_ids: Sequence[Sequence[int]] | None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits with disallowed ids at -inf, no_allowed_token [bs] or None).

    x [bs, vocab] must be finite (model logits are) and is not modified. The result is written to `out`
    ([bs, vocab], not x: empty rows are restored from x) or to a new tensor. `vocab_mask` is read, not copied:
    per step this costs one [bs, vocab] pass and no [bs, vocab] allocation when `out` is given.
    """
    bs, vocab = x.shape
    bans = list(banned_token_ids) if banned_token_ids is not None else [[] for _ in range(bs)]
    if len(bans) != bs:
        raise ValueError(f"banned_token_ids has {len(bans)} entries for a batch of {bs}")
    if vocab_mask is None and not any(len(b) for b in bans):
        return x, None
    if vocab_mask is not None and vocab_mask.shape != (bs, vocab):
        raise ValueError(f"vocab_mask has shape {tuple(vocab_mask.shape)}, expected {(bs, vocab)}")
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.data_ptr() == x.data_ptr():
        raise ValueError(f"out must be a separate {tuple(x.shape)} tensor, got {tuple(out.shape)}")
    if vocab_mask is None:
        # Without a grammar a row is empty only if its bans name every id (ids are range-checked).
        empty = [len(set(b)) >= vocab for b in bans]
        bans = [[] if e else b for b, e in zip(bans, empty, strict=True)]
        out.copy_(x)
        out.view(-1).index_fill_(0, _flat_keys(range(bs), bans, vocab, x.device), float("-inf"))
        return out, torch.tensor(empty, dtype=torch.bool, device=x.device)
    allowed = vocab_mask.to(device=x.device, dtype=torch.bool)  # no copy when already so
    torch.where(allowed, x, _neg_inf(x.device), out=out)
    if any(len(b) for b in bans):
        out.view(-1).index_fill_(0, _flat_keys(range(bs), bans, vocab, x.device), float("-inf"))
    no_allowed = out.amax(dim=-1) == float("-inf")  # [bs]; x is finite, so only masked ids are -inf
    if bool(no_allowed.any()):  # rare: an empty row falls back to "everything allowed" (x's own values)
        rows = no_allowed.nonzero().squeeze(1)
        out.index_copy_(0, rows, x.index_select(0, rows))
    return out, no_allowed


class Sampler:
    """Per-request state (generators, token history) belongs to the caller. The sampler only keeps two
    [rows, vocab] float scratch buffers (penalised logits, masked logits), grown to the largest batch seen
    and reused every step instead of allocating ~bs x 196 KB twice per step (49k vocab).
    """

    def __init__(self) -> None:
        self._scratch: list[torch.Tensor | None] = [None, None]

    def _buffer(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """Scratch buffer i viewed as [bs, vocab] (contents undefined)."""
        bs, vocab = like.shape
        buf = self._scratch[i]
        if buf is None or buf.shape[0] < bs or buf.shape[1] != vocab or buf.device != like.device:
            buf = self._scratch[i] = torch.empty((bs, vocab), dtype=torch.float32, device=like.device)
        return buf[:bs]

    def __call__(
        self,
        logits: torch.Tensor,  # [bs, vocab] raw model logits
        info: SamplingBatchInfo,
        output_ids: Sequence[Sequence[int]],  # tokens generated so far per request (penalties)
        prompt_ids: Sequence[Sequence[int]],  # prompt tokens per request (repetition penalty)
        vocab_mask: torch.Tensor | None = None,  # [bs, vocab] bool, True = allowed; None = all
        banned_token_ids: Sequence[Sequence[int]] | None = None,  # per request
        top_logprobs_nums: Sequence[int] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        need_logprobs: bool = True,  # False: `logprobs` is None (a full-vocabulary log_softmax saved)
    ) -> SamplerOutput:
        if logits.dim() != 2 or tuple(logits.shape) != (info.batch_size, info.vocab_size):
            raise ValueError(
                f"logits must be {(info.batch_size, info.vocab_size)}, got {tuple(logits.shape)}"
            )
        logits = logits.float().contiguous()  # no copy when already so; never modified below

        x = logits
        if info.need_penalties:
            x = self._buffer(0, logits)
            x.copy_(logits)
            apply_penalties(x, info, output_ids, prompt_ids)
        x, no_allowed = apply_bans_and_mask(x, vocab_mask, banned_token_ids, out=self._buffer(1, logits))

        if info.is_all_greedy:
            next_ids = greedy_ids(x)
        else:
            next_ids = self._sample(x, info, self._uniforms(info, x.device, generators))
            if info.has_greedy:
                next_ids = torch.where(info.is_greedy, greedy_ids(x), next_ids)
        logprobs = raw_logprobs = None
        if need_logprobs or top_logprobs_nums is not None:
            # One fused log_softmax pass is ~25% cheaper on CPU than logsumexp (which decomposes into 4 ops).
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [bs, vocab]
            logprobs = raw_logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        return SamplerOutput(
            next_token_ids=next_ids,
            logprobs=logprobs if need_logprobs else None,
            top_logprobs=_top_logprobs(raw_logprobs, top_logprobs_nums),  # None when nums is None
            no_allowed_token=no_allowed,
        )

    @staticmethod
    def _sample(x: torch.Tensor, info: SamplingBatchInfo, uniforms: torch.Tensor) -> torch.Tensor:
        """Ids [bs] for the sampled rows (greedy rows get an arbitrary id, replaced by the caller)."""
        bs, vocab = x.shape
        probs = torch.softmax(x / info.temperatures, dim=-1)  # [bs, vocab]
        next_ids = torch.zeros(bs, dtype=torch.int64, device=x.device)
        for rows, truncated in ((info.plain_rows, False), (info.truncated_rows, True)):
            if not rows:
                continue
            idx = torch.tensor(rows, device=x.device)
            sub = probs if len(rows) == bs else probs.index_select(0, idx)
            if truncated:
                first_k = vocab if x.is_cuda else CPU_FIRST_CANDIDATES
                ids = sample_truncated(
                    sub, info.top_ks[idx], info.top_ps[idx], info.min_ps[idx], uniforms[idx], first_k
                )
            else:
                if info.need_min_p:
                    sub = torch.where(min_p_keep(sub, info.min_ps[idx]), sub, 0.0)
                ids = sample_from_probs(sub, uniforms[idx])
            next_ids.index_copy_(0, idx, ids)
        return next_ids

    @staticmethod
    def _uniforms(
        info: SamplingBatchInfo, device: torch.device, generators: Sequence[torch.Generator | None] | None
    ) -> torch.Tensor:
        """[bs] in (0, 1]: global RNG for unseeded rows, one draw from its own generator per seeded
        sampled row.
        """
        uniforms = 1.0 - torch.rand(info.batch_size, device=device)
        if not info.seeded_rows:
            return uniforms
        if generators is None or len(generators) != info.batch_size:
            raise ValueError("seeded requests need `generators` (one per row, kept across steps)")
        draws = []
        for i in info.seeded_rows:
            gen = generators[i]
            if gen is None:
                raise ValueError(f"row {i} has seed {info.seeds[i]} but no generator; use make_generator")
            draws.append(1.0 - torch.rand(1, generator=gen, device=gen.device))
        uniforms[torch.tensor(info.seeded_rows, device=device)] = torch.cat(draws).to(device)
        return uniforms


def _top_logprobs(logprobs: torch.Tensor, nums: Sequence[int] | None) -> list[list[tuple[float, int]]] | None:
    if nums is None:
        return None
    if len(nums) != logprobs.shape[0]:
        raise ValueError(f"top_logprobs_nums has {len(nums)} entries for a batch of {logprobs.shape[0]}")
    max_n = min(max(nums, default=0), logprobs.shape[-1])
    if max_n <= 0:
        return [[] for _ in nums]
    values, ids = logprobs.topk(max_n, dim=-1)  # [bs, max_n], descending
    lps = values.tolist()
    ids_l = ids.tolist()
    return [list(zip(lps[i][: max(n, 0)], ids_l[i][: max(n, 0)], strict=True)) for i, n in enumerate(nums)]
