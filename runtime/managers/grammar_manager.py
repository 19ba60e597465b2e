"""The scheduler's view of constrained decoding: compile off the critical path, masks, jump-forward plans.

Compiles run in capped worker processes (``constrained.compile_pool``): a schema that needs too much memory or
time fails its own request with a 400 naming the limit, and never touches the scheduler's memory.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from runtime.managers.req import Req
from runtime.sampling_params import SamplingParams

# Defaults of --grammar-timeout-s / --grammar-workers / --grammar-memory-mb (outlines-core can take minutes
# and gigabytes on some real-world schemas). Two workers, so one pathological schema does not stall the rest.
COMPILE_TIMEOUT_S = 120.0
COMPILE_WORKERS = 2
COMPILE_MEMORY_MB = 2048


class GrammarManager:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        jump_forward: bool = True,
        workers: int = COMPILE_WORKERS,
        memory_mb: int = COMPILE_MEMORY_MB,
        timeout_s: float = COMPILE_TIMEOUT_S,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.jump_forward = jump_forward
        self.limits = dict(workers=workers, memory_mb=memory_mb, timeout_s=timeout_s)
        self._compiler = None  # built on first use: the vocabulary takes a moment
        self._mask_buf: torch.Tensor | None = None  # [rows, vocab] bool, reused by every step's mask

    @property
    def compiler(self):
        if self._compiler is None:
            from constrained import GrammarCompiler

            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, pool_limits=self.limits)
        return self._compiler

    def compile_async(self, params: SamplingParams) -> Future:
        if params.regex is not None:
            return self.compiler.compile_async("regex", params.regex)
        return self.compiler.compile_async("json_schema", params.json_schema)

    def vocab_mask(self, reqs: list[Req], vocab: int, device: torch.device) -> torch.Tensor | None:
        """[bs, vocab] bool, True = allowed; None when no request in the batch is constrained.

        The host tensor is a view of one buffer reused every step: valid until the next call.
        """
        if all(r.grammar is None for r in reqs):
            return None
        bs = len(reqs)
        if self._mask_buf is None or self._mask_buf.shape[0] < bs or self._mask_buf.shape[1] != vocab:
            self._mask_buf = torch.empty((bs, vocab), dtype=torch.bool)
        mask = self._mask_buf[:bs]
        mask.zero_()
        for i, req in enumerate(reqs):
            if req.grammar is None:
                mask[i] = True
            else:
                req.grammar.fill_vocab_mask(mask[i])
        return mask.to(device)

    def plan_jump(self, req: Req) -> tuple[int, list[int]] | None:
        """(tokens of output to keep, tokens to append) when the grammar forces text from here."""
        forced = req.grammar.jump_forward_string()
        if not forced:
            return None
        return self.compiler.plan_jump_forward(req.output_ids, forced)

    def shutdown(self) -> None:
        """Stop the compile workers (they also die with this process: PR_SET_PDEATHSIG)."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=False)

    def stats(self) -> dict:
        if self._compiler is None:
            return {}
        s = getattr(self._compiler, "stats", None)
        return s() if callable(s) else (dict(s) if s else {})
