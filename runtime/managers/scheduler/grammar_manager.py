"""The scheduler's view of constrained decoding: compile off the critical path, masks, jump-forward plans.

Compiles run in capped worker processes (``constrained.compile_pool``; limits from ServerArgs): a schema that
needs too much memory or time fails its own request with a 400 naming the limit, and never touches the
scheduler's memory. A request waits at most ``wait_s`` for its grammar (then 503, and a compile no worker
has started is dropped), and an aborted request stops waiting at once (``cancel``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from constrained.errors import GrammarError, GrammarUnavailable
from runtime.managers.scheduler.output_stream import take_back
from runtime.managers.scheduler.req import Req
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs

# Steering starts when the remaining budget is this many tokens more than the closing path: jump-forward
# (off while steering, on before) may re-tokenize forced text a token or two longer than the path walks it
# (` "` then the string's end where the path took ` ","`).
CLOSE_MARGIN = 3
# The longest closing path walked (one mask per token: ~0.1-1 ms each): a grammar that needs more to close
# (hundreds of required properties) is not steered.
CLOSE_WALK_LIMIT = 256


@dataclass
class ClosingState:
    """A request's closing bookkeeping (`GrammarManager.closing_token`): the path computed at output length
    `pos`, the next output length to compute it again, and whether its grammar was ever inside a structure."""

    pos: int = 0
    path: list[int] | None = None
    need: int = 0  # len(path) at the last check
    first_need: int = 0  # the first path's length + a little: what one more structure costs, roughly
    next_check: int = 0
    entered: bool = False
    steering: bool = False  # following `path`: jump-forward is off, so the path's count holds exactly
    thoughts: str = "none"  # constrained.closing.thoughts_of the grammar: where its output starts


class GrammarManager:
    def __init__(self, tokenizer, vocab_size: int, args: ServerArgs | None = None):
        """``args``: the server's (its --grammar-* limits); None: ServerArgs' defaults."""
        args = args if args is not None else ServerArgs()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.jump_forward_enabled = not args.disable_jump_forward
        self.limits = args.grammar_pool_limits
        self.cache_bytes = args.grammar_cache_mb << 20
        self.wait_s = args.grammar_wait_s
        self.backend = args.grammar_backend  # constrained.backends.backend_chain per request
        self.expired = 0  # requests failed for waiting past wait_s
        self._compiler = None  # built on first use: the vocabulary takes a moment
        self._mask_buf: torch.Tensor | None = None  # [rows, vocab] bool, reused by every step's mask
        self._ranks = None  # constrained.closing.ClosingRanks of the vocabulary, built on first use

    @property
    def compiler(self):
        if self._compiler is None:
            from constrained import GrammarCompiler

            self._compiler = GrammarCompiler(
                self.tokenizer,
                self.vocab_size,
                pool_limits=self.limits,
                cache_bytes=self.cache_bytes,
                backend=self.backend,
            )
        return self._compiler

    def compile_async(self, params: SamplingParams) -> Future:
        """This request's future of its CompiledGrammar. It fails with GrammarError (400) or
        GrammarUnavailable (503: queue full, worker crashed, or not compiled within ``wait_s``). The backend
        is --grammar-backend's, or one that can express the kind (``constrained.backends.choose_backend``)."""
        kind, spec = params.grammar
        try:
            ticket = self.compiler.compile_async(kind, spec)
        except GrammarError as err:  # no installed backend can express this kind: the request's 400
            ticket = Future()
            ticket.set_exception(err)
        ticket.deadline = time.monotonic() + self.wait_s
        return ticket

    def expire(self, futures: list[Future]) -> None:
        """Fail the futures whose deadline has passed (GrammarUnavailable), dropping their queued compiles."""
        now = time.monotonic()
        for ticket in futures:
            if not ticket.done() and ticket.deadline is not None and ticket.deadline <= now:
                self.expired += 1
                self.compiler.cache.fail(
                    ticket,
                    GrammarUnavailable(
                        f"the grammar was not compiled within {self.wait_s:g} s (--grammar-queue-timeout-s): "
                        "the grammar workers are busy; this is temporary, retry later"
                    ),
                )

    @staticmethod
    def cancel(future: Future | None) -> None:
        """The request left (aborted): stop waiting; the last waiter gone drops a compile not yet started."""
        if future is not None:
            future.cancel()

    def vocab_mask(self, reqs: list[Req], vocab: int, device: torch.device) -> torch.Tensor | None:
        """[bs, vocab] bool, True = allowed; None when no request in the batch is constrained.

        The host tensor is a view of one buffer reused every step: valid until the next call.
        """
        if all(r.grammar is None for r in reqs):
            return None
        mask = self._rows(len(reqs), vocab)
        mask.zero_()
        for i, req in enumerate(reqs):
            if req.grammar is None:
                mask[i] = True
            elif (tok := self.closing_token(req)) is not None:
                mask[i, tok] = True
            else:
                req.grammar.fill_vocab_mask(mask[i])
        return mask.to(device)

    # ---- closing before the budget ends (constrained.closing) ---------------------------------------------
    def closing_token(self, req: Req) -> int | None:
        """The token `req` must take now for its grammar to end inside its max_new_tokens, or None while the
        model may choose. Steering starts once the remaining budget is no more than the greedy closing path
        (+ CLOSE_MARGIN) and follows that path, unless the path does not fit (the output is cut either way,
        and the model's own text is worth more). A grammar that may end where it is (free text before a tool
        call, or after a whole call) is left alone, except that after a structure the model has closed, EOS
        is taken once the budget could not hold another."""
        remaining = req.params.max_new_tokens - len(req.output_ids)
        g = req.grammar
        if req.closing is None:  # a budget past CLOSE_WALK_LIMIT: the grammar's facts when first needed
            compiled = getattr(g, "grammar", None)  # every engine's cursor holds its compiled grammar
            thoughts = self.closing_facts(compiled, compiled.new_matcher())[0] if compiled else "none"
            req.closing = ClosingState(thoughts=thoughts)
        state: ClosingState = req.closing
        pos = len(req.output_ids)
        k = pos - state.pos  # the path's tokens taken since it was walked, if the output followed it
        if (
            state.path is not None
            and 0 <= k <= len(state.path)
            and req.output_ids[state.pos : pos] == state.path[:k]
        ):
            rest = state.path[pos - state.pos :]
            if rest and len(rest) <= remaining <= len(rest) + CLOSE_MARGIN:
                state.steering = True
                return rest[0]
        state.steering = False
        if pos < state.next_check and remaining > state.need + CLOSE_MARGIN:
            return None
        from constrained.closing import closing_path

        ranks = self._closing_ranks()
        if g.can_finish():
            if not state.entered or g.is_terminated():
                state.next_check = pos + 1
                return None
            # after a closed structure: EOS unless the budget still holds a minimal one more
            if remaining <= state.first_need + CLOSE_MARGIN and g.is_allowed(ranks.eos_token_id):
                state.steering = True
                return ranks.eos_token_id
            state.next_check = pos + max(1, (remaining - state.first_need - CLOSE_MARGIN) // 4)
            return None
        state.entered = True
        path = closing_path(g, ranks, min(remaining + 1, CLOSE_WALK_LIMIT), state.thoughts)
        if path is None:  # no greedy way out within reach (or the budget): leave it to the model
            state.path, state.need, state.next_check = None, 0, pos + CLOSE_WALK_LIMIT // 8
            return None
        if state.first_need == 0:
            state.first_need = len(path) + 8  # a rough size of one more structure (tool call, value)
        state.pos, state.path, state.need = pos, path, len(path)
        slack = remaining - len(path) - CLOSE_MARGIN
        state.next_check = pos + max(1, slack // 4)
        # a budget the path does not fit is cut whatever is chosen: then the model writes on as it would
        state.steering = slack <= 0 and len(path) <= remaining
        return path[0] if state.steering else None

    def closing_facts(self, compiled, matcher) -> tuple[str, int | None]:
        """(Where `compiled`'s output starts as to thoughts, the tokens of the shortest output the steer can
        close it in): the greedy closing path of a fresh `matcher`, EOS included; None past CLOSE_WALK_LIMIT.
        Computed once per compiled grammar (one mask per token), kept on it: the compile cache shares it."""
        facts = getattr(compiled, "closing_facts", None)
        if facts is None:
            from constrained.closing import closing_path, thoughts_of

            ranks = self._closing_ranks()
            thoughts = thoughts_of(matcher, ranks)
            path = closing_path(matcher, ranks, CLOSE_WALK_LIMIT, thoughts)
            facts = compiled.closing_facts = (thoughts, len(path) if path is not None else None)
        return facts

    def start(self, req: Req, compiled) -> str | None:
        """Give `req` its matcher of `compiled`; the reason it must fail (400) when its max_new_tokens cannot
        hold any output the grammar accepts (`budget_error`), else None."""
        req.grammar = compiled.new_matcher()
        if req.params.max_new_tokens >= CLOSE_WALK_LIMIT:
            return None  # the facts wait until the steer needs them
        thoughts, need = self.closing_facts(compiled, req.grammar)
        req.closing = ClosingState(thoughts=thoughts)
        return self.budget_error(req.params.max_new_tokens, need)

    @staticmethod
    def budget_error(budget: int, need: int | None) -> str | None:
        """Why a budget of `budget` tokens cannot hold any output of a grammar whose shortest takes `need`
        (a budget too small for any valid call is the client's error, not a cut call), or None when it can.
        A grammar that may end at once (free text before an optional call) needs one token. The count is the
        steer's: a budget at least this large ends with a whole call or answer (`closing_token`)."""
        if need is None or budget >= need:
            return None
        return (
            f"max_tokens: a budget of {budget} tokens cannot hold any output this request's grammar accepts; "
            f"the shortest (a whole tool call or structured answer, end of text included) takes {need} tokens"
        )

    @staticmethod
    def near_closing(req: Req, draft_len: int) -> bool:
        """Whether steering would start within a draft of `draft_len` tokens (by the last closing path)."""
        state = req.closing
        if state is None or state.path is None:
            return False
        return req.params.max_new_tokens - len(req.output_ids) - draft_len <= state.need + CLOSE_MARGIN

    def _closing_ranks(self):
        if self._ranks is None:
            from constrained.closing import ClosingRanks

            vocab = self.compiler.vocab
            self._ranks = ClosingRanks(vocab.token_bytes, vocab.eos_token_id)
        return self._ranks

    def _rows(self, n: int, vocab: int) -> torch.Tensor:
        """[n, vocab] bool rows of the reused buffer; contents undefined: every user writes every row."""
        if self._mask_buf is None or self._mask_buf.shape[0] < n or self._mask_buf.shape[1] != vocab:
            self._mask_buf = torch.empty((n, vocab), dtype=torch.bool)
        return self._mask_buf[:n]

    def jumps(self, req: Req) -> bool:
        """Jump-forward applies to `req`: it has a grammar, asks no logprobs (forced tokens have none) and is
        not being steered to close (`closing_token`: the path's tokens are counted, a jump's are not)."""
        closing = req.closing
        steering = closing is not None and closing.steering
        return (
            req.grammar is not None and self.jump_forward_enabled and not req.return_logprob and not steering
        )

    def verify_masks(
        self, reqs: list[Req], drafts: list[list[int]], fail: Callable[[Req], None]
    ) -> tuple[list[Req], list[list[int]], torch.Tensor | None]:
        """Cut the drafts of constrained requests to what their grammars allow and build the masks of the
        speculative verify step: (requests, their drafts, [rows, vocab] bool host mask or None when no
        request has a grammar).

        Rows follow `build_verify_batch`: per request 1 + len(draft), row j scoring the token after
        draft[:j]. An unconstrained request's rows allow everything; a constrained request's row j allows
        what its grammar allows after draft[:j], and its draft ends before the first token the grammar
        rejects, after a token that terminates it, and after a token into text the grammar forces where
        jump-forward applies (the jump, not the draft, supplies that text). One walk per request (fill,
        accept, ..., then rollback): the matcher ends where it started. A grammar that raises fails its
        request alone (`fail(req)`), which is left out. The mask is a view of the buffer `vocab_mask`
        reuses: valid until its next call."""
        if all(r.grammar is None for r in reqs):
            return reqs, drafts, None
        mask = self._rows(sum(1 + len(d) for d in drafts), self.vocab_size)
        kept_reqs, kept, at = [], [], 0
        for req, draft in zip(reqs, drafts):
            if req.grammar is None:
                mask[at : at + 1 + len(draft)] = True
            else:
                try:
                    tok = self.closing_token(req)
                    if tok is not None or self.near_closing(req, len(draft)):
                        draft = []  # steering now, or it would start within the draft: no draft
                    if tok is not None:
                        mask[at].zero_()
                        mask[at, tok] = True
                        kept_reqs.append(req)
                        kept.append(draft)
                        at += 1
                        continue
                    draft = self._walk(req, draft, mask[at:])
                except Exception:  # its rows are rewritten by the next request's
                    fail(req)
                    continue
            kept_reqs.append(req)
            kept.append(draft)
            at += 1 + len(draft)
        return kept_reqs, kept, mask[:at]

    def _walk(self, req: Req, draft: list[int], rows: torch.Tensor) -> list[int]:
        """`verify_masks` for one constrained request: fills rows[0 .. len(kept)], returns the kept draft."""
        grammar, jumps, n = req.grammar, self.jumps(req), 0
        try:
            for tok in draft:
                rows[n].zero_()
                grammar.fill_vocab_mask(rows[n])
                if not (0 <= tok < rows.shape[1] and bool(rows[n, tok])):
                    return draft[:n]  # rejected: row n (filled) is where the sampler picks instead
                try:
                    grammar.accept_token(tok)
                except GrammarError:
                    return draft[:n]
                n += 1
                if grammar.is_terminated() or (jumps and grammar.jump_forward_string()):
                    break
            rows[n].zero_()
            grammar.fill_vocab_mask(rows[n])
            return draft[:n]
        finally:
            grammar.rollback(n)

    def jump_forward(self, req: Req, drop_kv_from: Callable[[Req, int], None]) -> int | None:
        """Append the text the grammar forces from here without running the model; returns the tokens gained,
        or None when nothing is forced (the output is untouched).

        Forced text is re-tokenized with the tail of the output, so the last few tokens may be rewritten:
        ``drop_kv_from(req, position)`` frees their KV first (it must never reach the radix cache under the
        new tokens), and the output stream takes back text already sent for them."""
        forced = req.grammar.jump_forward_string()
        if not forced:
            return None
        keep, new_ids = self.compiler.plan_jump_forward(req.output_ids, forced)
        old_len = len(req.output_ids)
        drop_kv_from(req, len(req.prompt_ids) + keep)
        req.output_ids = req.output_ids[:keep] + new_ids
        take_back(req, keep)
        req.grammar.reset_to(req.output_ids)
        if len(req.output_ids) >= req.params.max_new_tokens:
            req.output_ids = req.output_ids[: req.params.max_new_tokens]
            req.grammar.reset_to(req.output_ids)
            req.finish({"type": "length", "length": req.params.max_new_tokens})
        elif req.grammar.is_terminated():
            req.finish({"type": "stop", "matched": None})
        return len(new_ids) - (old_len - keep)

    def shutdown(self) -> None:
        """Stop the compile workers (they also die with this process: PR_SET_PDEATHSIG)."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=False)

    def clear_cache(self) -> None:
        """Drop every compiled grammar (the memory guard sheds them; the next request compiles again)."""
        if self._compiler is not None:
            self._compiler.clear()

    def stats(self) -> dict:
        """Compile cache and pool counters (``GrammarCompiler.stats``: queued, running, cache_bytes,
        evictions, ``compiled_<backend>`` counts, ...) plus ``expired`` and ``backend`` (--grammar-backend);
        empty before the first grammar."""
        if self._compiler is None:
            return {}
        return {**self._compiler.stats(), "expired": self.expired, "backend": self.backend}
