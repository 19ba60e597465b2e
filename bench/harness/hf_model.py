"""The plain Hugging Face baseline: `transformers` on the same weights and dtype, padded static batches.

Nothing here reuses a prefix: every batch is left-padded to its longest prompt and computed from scratch, as a
program using `model.generate` directly would. Greedy generation and scoring use the same tokenizer as radixlm
(`runtime.models.model_loader.load_tokenizer`, `tokenizer.encode(text)`), so both sides see identical token
ids.

Per-row behaviour inside one static batch (different `max_new_tokens`, stop strings, `ignore_eos`, grammars)
is enforced by a stopping criterion and logits processors; a finished row keeps occupying its batch slot
until the whole batch is done, which is the cost of static batching this baseline is meant to show.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Sampling keys the baseline implements; a request setting anything else to a non-default value is refused.
SUPPORTED_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "regex",
        "json_schema",
        "skip_special_tokens",
        "no_stop_trim",
    }
)


@dataclass
class GenRequest:
    input_ids: list[int]
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # as radixlm: also how stop strings are matched
    grammar: Any = None  # a constrained.GrammarMatcher, fresh for this request
    # Filled by generate_batch:
    output_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0  # generated tokens including a final EOS / stop token
    text: str = ""
    finish_reason: dict[str, Any] = field(default_factory=dict)


def load_hf_model(model_dir: str, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any, float]:
    """(model, tokenizer, load seconds): `AutoModelForCausalLM.from_pretrained` on radixlm's HF folder."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from runtime.models.gguf import float_folder
    from runtime.models.model_loader import load_tokenizer

    t0 = time.perf_counter()
    # a GGUF file's folder holds no weights: transformers gets its float32 copy (written once)
    model = AutoModelForCausalLM.from_pretrained(
        float_folder(model_dir), dtype=DTYPES[dtype], local_files_only=True
    )
    model = model.to(device).eval()
    tok = load_tokenizer(model_dir)
    # A clean generation config: greedy unless a request asks otherwise, no folder-provided sampling defaults.
    eos = model.config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if isinstance(eos, int) else eos[0])
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=pad, bos_token_id=model.config.bos_token_id
    )
    return model, tok, time.perf_counter() - t0


def left_pad(seqs: list[list[int]], pad_id: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [bs, L], attention_mask [bs, L]) with every row right-aligned (left padding)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token (what HF generate does for left
    padding).
    """
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.inference_mode()
def score_batch(model: Any, seqs: list[list[int]], num_scored: list[int], pad_id: int) -> list[list[float]]:
    """Log-probabilities of the last `num_scored[i]` tokens of each sequence given what precedes them.

    One padded forward pass; only the positions that predict scored tokens go through the LM head
    (`logits_to_keep`), so the [bs, L, vocab] logits tensor is never built. Log-softmax over raw float32
    logits, as radixlm's `input_token_logprobs`.
    """
    if any(n >= len(s) for s, n in zip(seqs, num_scored) if n > 0):
        raise ValueError("a scored token needs at least one token before it")
    device = next(model.parameters()).device
    ids, mask = left_pad(seqs, pad_id, device)
    keep = max(num_scored) + 1
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions_from_mask(mask),
        logits_to_keep=keep,
        use_cache=False,
    )
    logprobs = torch.log_softmax(out.logits.float(), dim=-1)  # [bs, keep, vocab]; kept position j is L-keep+j
    results = []
    for row, (seq, n) in enumerate(zip(seqs, num_scored)):
        if n <= 0:
            results.append([])
            continue
        # Token at padded position L-n+k (k < n) is predicted by position L-n+k-1 = kept index keep-n-1+k.
        pos = torch.arange(keep - n - 1, keep - 1, device=device)
        targets = torch.tensor(seq[-n:], dtype=torch.long, device=device)
        results.append(logprobs[row, pos, targets].tolist())
    return results


class _RowStops:
    """Stopping criterion with per-row limits: max_new_tokens, stop strings, stop token ids.

    Returns a [bs] bool tensor (transformers ANDs it into its `unfinished_sequences`); records the generated
    length at which each row finished so the caller can cut its output.
    """

    def __init__(self, tokenizer: Any, reqs: list[GenRequest], prompt_width: int):
        self.tok = tokenizer
        self.reqs = reqs
        self.width = prompt_width
        self.finished_at: list[int | None] = [None] * len(reqs)
        self.reason: list[dict[str, Any]] = [{} for _ in reqs]
        # Enough trailing tokens to contain the longest stop string (a token holds at least one character).
        self.tail = [max((len(s) for s in r.stop), default=0) + 1 for r in reqs]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        n_gen = input_ids.shape[1] - self.width
        done = torch.zeros(len(self.reqs), dtype=torch.bool, device=input_ids.device)
        for i, req in enumerate(self.reqs):
            if self.finished_at[i] is not None:
                done[i] = True
                continue
            last = int(input_ids[i, -1])
            _sync_grammar(req, input_ids[i, self.width :])
            if not req.ignore_eos and last == self.tok.eos_token_id:
                self._finish(i, n_gen, {"type": "stop", "matched": last})
            elif last in req.stop_token_ids:
                self._finish(i, n_gen, {"type": "stop", "matched": last})
            elif req.stop and self._stop_string(i, input_ids[i, self.width :]):
                pass
            elif req.grammar is not None and req.grammar.is_terminated():
                self._finish(i, n_gen, {"type": "stop", "matched": "grammar"})
            elif n_gen >= req.max_new_tokens:
                self._finish(i, n_gen, {"type": "length", "length": req.max_new_tokens})
            done[i] = self.finished_at[i] is not None
        return done

    def _stop_string(self, i: int, gen: torch.Tensor) -> bool:
        req = self.reqs[i]
        tail = self.tok.decode(gen[-self.tail[i] :].tolist(), skip_special_tokens=req.skip_special_tokens)
        for s in req.stop:
            if s in tail:
                self._finish(i, len(gen), {"type": "stop", "matched": s})
                return True
        return False

    def _finish(self, i: int, n_gen: int, reason: dict[str, Any]) -> None:
        self.finished_at[i], self.reason[i] = n_gen, reason


def _sync_grammar(req: GenRequest, gen: torch.Tensor) -> None:
    """Feed the grammar the tokens generated since it last looked (at most one per step)."""
    m = req.grammar
    if m is not None and len(gen) > len(m.accepted_ids):
        m.accept_tokens(gen[len(m.accepted_ids) :].tolist())


class _RowLogits:
    """Logits processor: forbids EOS on `ignore_eos` rows and applies each grammar row's vocabulary mask."""

    def __init__(self, reqs: list[GenRequest], prompt_width: int, eos_id: int, stops: _RowStops):
        self.reqs, self.width, self.eos, self.stops = reqs, prompt_width, eos_id, stops

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for i, req in enumerate(self.reqs):
            if self.stops.finished_at[i] is not None:
                continue
            if req.ignore_eos and self.eos < scores.shape[1]:
                scores[i, self.eos] = float("-inf")
            m = req.grammar
            if m is None:
                continue
            _sync_grammar(req, input_ids[i, self.width :])
            mask = torch.zeros(scores.shape[1], dtype=torch.bool)
            m.fill_vocab_mask(mask)
            scores[i].masked_fill_(~mask.to(scores.device), float("-inf"))
        return scores


@torch.inference_mode()
def generate_batch(
    model: Any, tok: Any, reqs: list[GenRequest], sampling: dict[str, Any] | None = None
) -> None:
    """Run one padded static batch through `model.generate`; fills each request's output fields.

    `sampling` (shared by the batch): `temperature` (0 = greedy), `top_p`, `top_k`.
    """
    from transformers import LogitsProcessorList, StoppingCriteriaList

    sampling = sampling or {}
    device = next(model.parameters()).device
    ids, mask = left_pad([r.input_ids for r in reqs], tok.pad_token_id, device)
    width = ids.shape[1]
    stops = _RowStops(tok, reqs, width)
    procs = LogitsProcessorList()
    if any(r.ignore_eos or r.grammar is not None for r in reqs):
        procs.append(_RowLogits(reqs, width, tok.eos_token_id, stops))
    temperature = float(sampling.get("temperature") or 0.0)
    kw: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        kw = {
            "do_sample": True,
            "temperature": temperature,
            "top_p": float(sampling.get("top_p", 1.0)),
            "top_k": int(sampling.get("top_k", -1)) if int(sampling.get("top_k", -1)) > 0 else 0,
        }
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max(r.max_new_tokens for r in reqs),
        logits_processor=procs,
        stopping_criteria=StoppingCriteriaList([stops]),
        **kw,
    )
    for i, req in enumerate(reqs):
        gen = out[i, width:].tolist()
        end = stops.finished_at[i] if stops.finished_at[i] is not None else len(gen)
        reason = stops.reason[i] or {"type": "length", "length": req.max_new_tokens}
        gen = gen[:end]
        req.completion_tokens = len(gen)
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and gen:
            gen = gen[:-1]  # EOS / stop token ids are not part of the output text
        req.output_ids = gen
        text = tok.decode(gen, skip_special_tokens=req.skip_special_tokens)
        matched = reason.get("matched")
        if isinstance(matched, str) and matched != "grammar" and matched in text:
            text = text[: text.index(matched)]
        req.text, req.finish_reason = text, reason
