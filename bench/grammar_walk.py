"""Model-free figures of a compiled grammar: per-token mask time and the validity of random walks.

A walk samples a random allowed token at every step (EOS a third of the time it is allowed, punctuation half
of the other steps, so walks end in tens of tokens) until the cursor terminates or ``max_steps`` pass.
Each step times ``fill_vocab_mask`` into a zeroed row of the model's width: what the scheduler pays per
token and request, first visits of a state included. A finished walk's text is checked with ``jsonschema``
like a model's output (bench.json_schema_coverage.classify_output), so every backend's masks are checked on
every compiled schema, not only on the few a model run reaches.
"""

from __future__ import annotations

import time
from typing import Any

WALK_KINDS = ("valid", "invalid", "unfinished", "unchecked")
# the targets for `auto`: compile share, mask p99 (µs per token), and no invalid finished output
TARGET_COMPILED_SHARE = 0.99
TARGET_MASK_P99_US = 1000.0


def _punctuation(vocab):
    import numpy as np

    punct = np.zeros(vocab.num_ids, dtype=bool)
    for byte in b'"{}[],:.-0 ':
        if vocab.byte_token_ids[byte] >= 0:
            punct[vocab.byte_token_ids[byte]] = True
    return punct


def walk(
    grammar, vocab, vocab_size: int, seed: int, max_steps: int = 64, cpu_us: list[float] | None = None
) -> tuple[str | None, list[float]]:
    """(text, or None if the walk did not finish within ``max_steps``; per-step mask fill in µs).
    ``cpu_us``: gets each step's CPU time of this thread as well (on a loaded machine the wall time also
    counts the time the thread waited for a core)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    punct = _punctuation(vocab)
    matcher = grammar.new_matcher()
    row = torch.zeros(vocab_size, dtype=torch.bool)
    out: list[int] = []
    times: list[float] = []
    for _ in range(max_steps):
        if matcher.is_terminated():
            return vocab.decode_bytes(out).decode("utf-8", "replace"), times
        row.numpy().fill(False)  # not row.zero_(): torch's idle OpenMP threads would spin into the timing
        cpu = time.thread_time() if cpu_us is not None else 0.0
        start = time.perf_counter()
        matcher.fill_vocab_mask(row)
        times.append(1e6 * (time.perf_counter() - start))
        if cpu_us is not None:
            cpu_us.append(1e6 * (time.thread_time() - cpu))
        allowed = np.flatnonzero(row.numpy())
        if len(allowed) == 0:
            return None, times  # a dead end: reported as unfinished, never as valid
        can_end = vocab.eos_token_id in allowed
        allowed = allowed[allowed != vocab.eos_token_id]
        preferred = allowed[punct[allowed]] if len(allowed) else allowed
        if can_end and (len(allowed) == 0 or rng.random() < 0.33):
            return vocab.decode_bytes(out).decode("utf-8", "replace"), times
        pick = int(rng.choice(preferred if len(preferred) and rng.random() < 0.5 else allowed))
        matcher.accept_token(pick)
        out.append(pick)
    return None, times


def classify_walk(schema: Any, text: str | None) -> tuple[str, str | None]:
    """(kind, detail): kind in WALK_KINDS, as classify_output judges a model's finished output."""
    from bench.json_schema_coverage import STOP, classify_output

    if text is None:
        return "unfinished", None
    kind, detail = classify_output(schema, text, STOP)
    return kind, detail


def auto_choice(overall: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Which backend `auto` should be by these figures (``overall``: backend -> its "all" summary).

    Ranked by validity first (no invalid finished output or walk), then by the targets met (compile share
    >= 99%, mask p99 < 1 ms), then by compile share, then by mask p99. Returns the choice and, per
    backend, the targets it met.
    """
    met: dict[str, dict[str, bool]] = {}
    for name, s in overall.items():
        p99 = s["mask_us"]["p99"]
        met[name] = {
            "compiled_share": (s["compiled_share"] or 0) >= TARGET_COMPILED_SHARE,
            "mask_p99": p99 == p99 and p99 < TARGET_MASK_P99_US,  # NaN: nothing was measured
            "all_valid": s["output_counts"]["invalid"] == 0 and s["walks"].get("invalid", 0) == 0,
        }

    def rank(name: str) -> tuple:
        p99 = overall[name]["mask_us"]["p99"]
        return (
            not met[name]["all_valid"],  # an invalid output is a wrong answer, not a slow one: ranks last
            -sum(met[name].values()),
            -(overall[name]["compiled_share"] or 0),
            p99 if p99 == p99 else 1e18,
        )

    order = sorted(overall, key=rank)
    return {"choice": order[0] if order else None, "order": order, "targets_met": met}
