"""Finish conditions checked after every new token: length, EOS, stop token ids, stop strings, stop regexes.

Stop strings are matched incrementally: each step decodes only the new tokens (with a few tokens of context)
and feeds the new characters to a `StopMatcher`, so the work per token is bounded by the stop strings'
length, never by the output's. Stop regexes (SGLang's `stop_regex`) are searched in a bounded tail of the
text (`RegexTail`) under a time budget. The detokenizer uses the same pieces for its stop trim.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.sampling_params import compile_stop_regex

if TYPE_CHECKING:  # the detokenizer process imports this module and needs no torch
    from runtime.managers.scheduler.req import Req

# Tokens of already committed text decoded again before new ones, so that a token's text comes out as it
# does in context (a leading space, a multi-byte character split over tokens).
SURROUNDING_TOKENS = 6
# Stop regexes: the longest tail of the output (characters) a pattern is searched in, and the time all of one
# request's patterns may take per step; past it (a backtracking pattern) the request ends with a 400.
STOP_REGEX_WINDOW = 1024
STOP_REGEX_BUDGET_S = 0.02
# Undecodable tail tokens (text ending in U+FFFD) wait at most this many tokens for the rest of their
# character: any UTF-8 character has at most 4 bytes, so more is garbage and is committed as it is.
MAX_PENDING_TOKENS = 16


class StopMatcher:
    """Finds stop strings in text fed piece by piece (one Knuth-Morris-Pratt automaton per stop string).

    `feed` costs O(len(piece) + len(stop)) per stop string at worst, amortized O(len(piece)); `overlap` is
    the longest end of the text fed so far that is a proper prefix of a stop string (text a stream must
    hold back), known without rescanning.
    """

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.fail = [_failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)  # characters of stop i matched at the end of the text
        self.fed = 0  # characters fed so far

    def feed(self, piece: str) -> tuple[int, str] | None:
        """Feed the next characters. On a match: (start offset of the earliest-starting match that ends in
        `piece`, in characters of all text fed, and its stop string); the state is then spent."""
        best: tuple[int, str] | None = None
        for i, s in enumerate(self.stops):
            k, fail, n = self.state[i], self.fail[i], len(s)
            for j, ch in enumerate(piece):
                while k and s[k] != ch:
                    k = fail[k - 1]
                if s[k] == ch:
                    k += 1
                if k == n:
                    start = self.fed + j + 1 - n
                    if best is None or start < best[0]:
                        best = (start, s)
                    k = fail[k - 1]
                    break
            self.state[i] = k
        self.fed += len(piece)
        return best

    @property
    def overlap(self) -> int:
        return max(self.state, default=0)

    @property
    def max_len(self) -> int:
        return max((len(s) for s in self.stops), default=0)


def _failure(s: str) -> list[int]:
    """KMP failure function: f[i] = length of the longest proper border of s[: i + 1]."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class StopRegexTimeout(Exception):
    """A stop_regex used up the time budget of one step (a backtracking pattern); names the pattern."""


class RegexTail:
    """Searches stop regexes in the last `window` characters of text fed piece by piece (as SGLang searches
    its decoded tail): the window is the longest match a pattern can span (at most `limit`), so a step costs
    one search of at most `limit` characters per pattern, stopped at `budget_s` in all."""

    def __init__(
        self, patterns: list[str], limit: int = STOP_REGEX_WINDOW, budget_s: float = STOP_REGEX_BUDGET_S
    ):
        compiled = [compile_stop_regex(p) for p in patterns]
        self.patterns = list(patterns)
        self.compiled = [c for c, _ in compiled]
        # a few characters more than a match for look-behinds and \b at its start
        self.window = min(limit, max(w for _, w in compiled) + 8)
        self.budget_s = budget_s
        self.tail = ""
        self.fed = 0  # characters fed so far; `tail` is the end of them

    def feed(self, piece: str) -> tuple[int, int, str] | None:
        """Feed the next characters. On a match in the tail: (start, end) in characters of all text fed, and
        the pattern, for the earliest-starting match. Raises StopRegexTimeout past the budget."""
        self.fed += len(piece)
        self.tail = (self.tail + piece)[-self.window :]
        base = self.fed - len(self.tail)
        best = None
        for start, end, pattern in self._search(partial=False):
            if best is None or start < best[0]:
                best = (base + start, base + end, pattern)
        return best

    def overlap(self) -> int:
        """Characters at the end of the text a continuation could turn into a match (a stream holds them)."""
        starts = [start for start, _, _ in self._search(partial=True)]
        return len(self.tail) - min(starts) if starts else 0

    def _search(self, partial: bool):
        deadline = time.monotonic() + self.budget_s
        for pattern, compiled in zip(self.patterns, self.compiled):
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                m = compiled.search(self.tail, partial=partial, timeout=left)
            except TimeoutError:
                raise StopRegexTimeout(
                    f"stop_regex {pattern!r} took more than {self.budget_s * 1000:g} ms on "
                    f"{len(self.tail)} characters of output per token: use a simpler pattern"
                ) from None
            if m is not None and (m.partial or not partial):
                yield m.start(), m.end(), pattern


@dataclass
class IncrementalText:
    """Text of a growing token list, decoded a few tokens at a time (`ids[surr:]` against `ids[surr:read]`).

    `advance` returns the characters the tokens from `read` on add, or "" while they end in an incomplete
    character (held at most MAX_PENDING_TOKENS tokens, or until `final`).
    """

    decode: Any  # ids -> str
    surr: int = 0
    read: int = 0
    chars: int = 0  # characters committed
    track_marks: bool = False  # keep `marks`, which `rewind` needs
    marks: list[tuple[int, int]] = field(default_factory=list)  # (read, chars) after each commit

    def advance(self, ids: list[int], final: bool = False) -> str:
        if len(ids) <= self.read:
            return ""
        prefix = self.decode(ids[self.surr : self.read]) if self.read > self.surr else ""
        full = self.decode(ids[self.surr :])
        overdue = final or len(ids) - self.read >= MAX_PENDING_TOKENS
        if full.endswith("\ufffd") and not overdue:
            return ""
        if len(full) <= len(prefix):  # the tokens add no text (e.g. skipped special tokens)
            if overdue:  # move on: decoding must not grow with a run of such tokens
                self.surr, self.read = max(self.surr, len(ids) - SURROUNDING_TOKENS), len(ids)
            return ""
        new = full[len(prefix) :]
        # context for the next step: the last few committed tokens, not the whole last chunk
        self.surr, self.read = max(self.read, len(ids) - SURROUNDING_TOKENS), len(ids)
        self.chars += len(new)
        if self.track_marks:
            self.marks.append((self.read, self.chars))
        return new

    def rewind(self, tokens: int) -> int:
        """Forget the text of tokens from `tokens` on (they were rewritten); returns the characters kept,
        those of the last commit at or before `tokens`."""
        while self.marks and self.marks[-1][0] > tokens:
            self.marks.pop()
        self.read, self.chars = self.marks[-1] if self.marks else (0, 0)
        self.surr = max(0, self.read - SURROUNDING_TOKENS)
        return self.chars


@dataclass
class StopScan:
    """A request's stop-string scan state (`Req.stop_scan`): what was decoded and fed so far."""

    ids: list[int]  # the output list scanned (a rewrite replaces the list: the scan starts again)
    snapshot: list[int]  # its last tokens up to `text.read`, to notice an in-place rewrite
    text: IncrementalText
    matcher: StopMatcher
    regexes: RegexTail | None = None


class StopChecker:
    def __init__(self, tokenizer, model_eos_ids: tuple[int, ...] = ()):
        eos = set(model_eos_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = eos
        self.tokenizer = tokenizer

    def banned_ids(self, req: Req, ahead: int = 0) -> list[int]:
        """Tokens that would end the request before `min_new_tokens` (so the sampler never picks them);
        `ahead`: output tokens assumed beyond `req.output_ids` (a speculative draft's position)."""
        p = req.params
        if len(req.output_ids) + ahead >= p.min_new_tokens:
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
            if p.stop or p.stop_regex:
                try:
                    matched = self._scan_stop_strings(req)
                except StopRegexTimeout as e:
                    req.error, req.error_status = str(e), 400
                    return {"type": "abort", "message": str(e)}
                if matched is not None:  # the stop string, or the stop_regex pattern (as SGLang reports it)
                    return {"type": "stop", "matched": matched}
        if len(out) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        return None

    def _scan_stop_strings(self, req: Req) -> str | None:
        out, scan = req.output_ids, req.stop_scan
        if (
            scan is None
            or scan.ids is not out
            or len(out) < scan.text.read
            or out[max(0, scan.text.read - len(scan.snapshot)) : scan.text.read] != scan.snapshot
        ):
            scan = req.stop_scan = self._start_scan(req)
        new = scan.text.advance(out)
        if not new:
            return None
        scan.snapshot = out[max(0, scan.text.read - 8) : scan.text.read]
        hit = scan.matcher.feed(new)
        if scan.regexes is not None:
            rhit = scan.regexes.feed(new)
            if rhit is not None and (hit is None or rhit[0] < hit[0]):
                return rhit[2]
        return hit[1] if hit else None

    def _start_scan(self, req: Req) -> StopScan:
        """A scan from a few tokens before the end: enough of them for the longest stop string or stop regex
        window (so a stop that ended in tokens generated before min_new_tokens, or before a rewrite, still
        counts)."""
        out, p = req.output_ids, req.params

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)

        matcher = StopMatcher(p.stop)
        regexes = RegexTail(p.stop_regex) if p.stop_regex else None
        need = max(matcher.max_len, regexes.window if regexes is not None else 0)
        # Each token decodes to >= 1 character except for multi-byte characters and skipped special
        # tokens: start `need` tokens back, and further back (at most 4x) while that holds fewer chars.
        back = need + 1
        start = max(0, len(out) - back)
        while start > 0 and back < 4 * (need + 1) and len(decode(out[start:])) < need:
            back *= 2
            start = max(0, len(out) - back)
        text = IncrementalText(decode, surr=start, read=start)
        return StopScan(ids=out, snapshot=[], text=text, matcher=matcher, regexes=regexes)
