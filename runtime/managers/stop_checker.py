"""Finish conditions checked after every new token: length, EOS, stop token ids, stop strings."""

from __future__ import annotations

from typing import Any

from runtime.managers.req import Req


class StopChecker:
    def __init__(self, tokenizer, model_eos_ids: tuple[int, ...] = ()):
        eos = set(model_eos_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = eos
        self.tokenizer = tokenizer

    def banned_ids(self, req: Req) -> list[int]:
        """Tokens that would end the request before `min_new_tokens` (so the sampler never picks them)."""
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens:
            return []
        return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids))

    def check(self, req: Req) -> dict[str, Any] | None:
        p, out = req.params, req.output_ids
        if req.grammar is not None and req.grammar.is_terminated():
            return {"type": "stop", "matched": out[-1] if out and out[-1] in self.eos_ids else None}
        if len(out) >= p.min_new_tokens:
            tok = out[-1]
            if not p.ignore_eos and tok in self.eos_ids:
                return {"type": "stop", "matched": tok}
            if tok in p.stop_token_ids:
                return {"type": "stop", "matched": tok}
            if p.stop:
                # Each token decodes to >= 1 character, so the last max_len + 1 tokens hold any fresh match.
                span = max(len(s) for s in p.stop) + 1
                tail = self.tokenizer.decode(out[-span:], skip_special_tokens=p.skip_special_tokens)
                for s in p.stop:
                    if s in tail:
                        return {"type": "stop", "matched": s}
        if len(out) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        return None
