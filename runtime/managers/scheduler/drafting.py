"""Draft tokens for speculative decoding, from text that already exists: no draft model.

Two sources, both plain Python dictionaries updated incrementally (no torch, no device work):

- `LocalIndex`, one per request: where each n-gram (n <= max_n) of its prompt + output occurred. The draft
  is what followed the earlier occurrence that best matches the request's tail, or the continuation of the
  text the last draft was copied from while the output keeps copying it ("prompt lookup"): tool-call JSON
  echoing its context, an edited file copied back, a quoted document.
- `SequenceIndex`, one per scheduler (`suffix` only): n-gram -> next-token counts over the sequences of
  finished requests, i.e. what the radix cache receives. The draft follows the most frequent continuation,
  token by token, so one agent's third tool call is drafted from the first two and one request's output
  from another's. The tree itself is keyed by prefix, so a lookup by suffix needs this index of its own;
  it is fed the part of a request the tree did not hold yet (from its cache hit on).

Prompt lookup drafts first and the shared index fills what it leaves short, unless the shared index has
lately been right where the two disagreed (`SpecState.judge_sources`): an output that writes the prompt's
text in another form, which the shared index has seen a finished request write, is then drafted from it.

Salted requests (`cache_salt`) neither feed the shared index nor draft from it: drafts never change outputs,
but acceptance changes timing, which must not leak across salts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from runtime.sampling_params import MAX_DRAFT_TOKENS

# prompt lookup keys on the last 3, 2, then 1 tokens and compares up to 32 tokens of the latest 32
# occurrences of the key; finished-sequence counts use contexts of 4 down to 2
LOCAL_MAX_N = 3
LOCAL_MATCH_SPAN = 32
LOCAL_MAX_CANDIDATES = 32
LOCAL_RESYNC = 8  # source tokens past an edit where its copy may go on (a longer or shorter replacement)
SHARED_MIN_N, SHARED_MAX_N = 2, 4
# Memory, measured with tracemalloc on CPython 3.11 (random token ids above 256): a shared context with its
# counts ~330 bytes, a request's indexed token (~2.9 n-gram keys and their position lists) ~470 bytes
SHARED_KEY_BYTES = 330
LOCAL_TOKEN_BYTES = 470
SHARED_MAX_BYTES = 96 << 20  # the shared index's cap: past it the oldest quarter of its contexts is dropped
SHARED_MAX_KEYS = SHARED_MAX_BYTES // SHARED_KEY_BYTES  # ~305k contexts
SHARED_MAX_NEXT = 8  # continuations kept per context (the rarest goes first)
# per-token acceptance estimate (SpecState.alpha): prior 0.6 worth 2 tokens, older evidence decayed by 0.75
# per verify, and per draft the budget cut once the tokens it guessed are out (`SpecState.cut`)
ALPHA_PRIOR, ALPHA_PRIOR_WEIGHT, ALPHA_DECAY, ALPHA_MAX = 0.6, 2.0, 0.75, 0.95
MIN_RUN = 12  # tokens a followed copy must have matched before an edit for it to go on past it (`LocalIndex`)
MAX_EDIT = 4  # tokens of an edit a followed copy goes on past before it re-anchors (`LocalIndex`)
MAX_SUBS = 4  # one-token edits a followed copy repeats (the latest)
MAX_COOLDOWN = 16  # steps a request skips drafting after repeated full rejections, at most
LEAD_MAX = 2  # how far the shared index's lead over prompt lookup swings (`SpecState.judge_sources`)
COPY_SIGNAL = 6  # ... unless its last this many tokens occurred before (`Drafter._copying`)


class LocalIndex:
    """Where each n-gram of one request's tokens occurred (its end: where the continuation starts), and where
    the last draft was copied from.

    Copying text that repeats itself (code, tables, a document quoted twice) defeats "the latest occurrence of
    the last 3 tokens": the same 3 tokens end many lines, and the latest is rarely the line being copied. So a
    proposal first follows the copy: while every token emitted since the last draft equals its source, the
    next draft continues from there. Otherwise it re-anchors at the occurrence whose preceding tokens match
    the request's tail longest (up to LOCAL_MATCH_SPAN tokens; ties: the latest).

    An edited copy (an identifier renamed, a counter in repeated lines: "item_44" copied as "item_45", a
    city "Paris" written as "Os" "lo") breaks the exact match at the edit, and the tail there is new text
    that rarely occurs anywhere, so a re-anchor lands on an unrelated short match. So the copy goes on past
    the edit: where the tokens emitted after the edit's first token occur again in the source just past the
    edit (within LOCAL_RESYNC tokens: a longer or shorter replacement), else right after the one source
    token the edit replaced; unless an anchor elsewhere matches the tail over more tokens than the copy had
    matched, or the edit grows past MAX_EDIT tokens (the output left the copy). A one-token-for-one edit is
    repeated where its source token comes again in the copy (a renamed parameter's later uses; a line
    "f_4(x=4): g_4_4" written as "f_5(x=5): g_5_5" is one edit, not four), until the output writes that
    token unchanged."""

    def __init__(self, max_n: int = LOCAL_MAX_N):
        self.max_n = max_n
        self.ends: dict[tuple[int, ...], list[int]] = {}  # every n shares one table (lengths differ)
        self.indexed = 0  # end positions below this are in `ends`
        self.follow: tuple[int, int] | None = None  # (source position, len(ids)) of the last draft
        self.run = 0  # tokens the followed copy matched since its anchor (its match counts) or last edit
        # the open edit of the followed copy: (source position, output position where it starts, the copy's
        # `run` before it, capped at LOCAL_MATCH_SPAN)
        self.edit: tuple[int, int, int] | None = None
        self.subs: dict[int, int] = {}  # the copy's one-token edits, source token -> written token

    def update(self, ids: list[int]) -> None:
        """Index the n-grams of `ids` that end at a position with a continuation (below len(ids))."""
        if len(ids) < self.indexed:  # the tokens were rewritten: start again
            self.ends.clear()
            self.indexed = 0
            self.follow, self.run, self.edit = None, 0, None
            self.subs.clear()
        ends, max_n = self.ends, self.max_n
        for e in range(max(self.indexed, 1), len(ids)):
            for n in range(1, min(max_n, e) + 1):
                key = tuple(ids[e - n : e])
                seen = ends.get(key)
                if seen is None:
                    ends[key] = [e]
                else:
                    seen.append(e)
        self.indexed = max(self.indexed, len(ids))

    def propose(self, ids: list[int], k: int) -> list[int]:
        """`k` tokens (none when nothing matches): the continuation of the followed copy, else of the
        best-matching occurrence of the longest known tail."""
        src, exact = self._followed(ids)
        if not exact:
            anchor, length = self._anchor(ids)
            if src is None or (anchor is not None and length > self.edit[2]):
                src, self.run, self.edit = anchor, length, None
                self.subs.clear()
        if src is None:
            self.follow = None
            return []
        self.follow = (src, len(ids))
        subs = self.subs
        draft = [subs.get(t, t) for t in ids[src : src + k]] if subs else ids[src : src + k]
        # a source that runs into the end of `ids` is text repeating with period len(ids) - src ("1111",
        # "abcabc"): the copy goes on through the draft itself
        for j in range(len(draft), k):
            draft.append(draft[src + j - len(ids)])
        return draft

    def _followed(self, ids: list[int]) -> tuple[int | None, bool]:
        """Where the followed copy goes on: (position, True) while every token since the last draft matched
        it; (position past the edit, False) after an edit; (None, False) when there is no copy to follow."""
        if self.follow is None:
            return None, False
        src, at = self.follow
        grown = len(ids) - at
        if grown <= 0:
            return None, False
        subs, matched = self.subs, 0
        while matched < grown:
            tok, source = ids[at + matched], ids[src + matched]
            if tok != subs.get(source, source):
                if tok != source:
                    break
                del subs[source]  # the edit is not repeated here: copy the token as it is
            matched += 1
        self.run += matched
        if matched == grown:
            self.edit = None
            return src + grown, True
        if matched or self.edit is None:  # a new edit starts at the first token that differs
            if self.run < MIN_RUN:  # too short a copy to be sure of: re-anchor
                self.edit = None
                return None, False
            self.edit = (src + matched, at + matched, min(self.run, LOCAL_MATCH_SPAN))
            self.run = 0
        return self._past_edit(ids), False

    def _past_edit(self, ids: list[int]) -> int | None:
        """Where the source goes on after the open edit: the latest emitted tokens after the edit's first one
        (3 down to 1) found again ending within LOCAL_RESYNC tokens after the edit's source position (the
        closest to a same-length replacement), else one past that position; None past MAX_EDIT tokens."""
        q0, e0, _ = self.edit
        d = len(ids) - e0  # the edit's tokens so far
        if d == 2 and self.subs.get(ids[q0]) == ids[e0]:  # not one token for one after all
            del self.subs[ids[q0]]
        if d > MAX_EDIT:
            self.edit = None
            return None
        for m in range(min(self.max_n, d - 1), 0, -1):
            seen = self.ends.get(tuple(ids[-m:]))
            if not seen:
                continue
            lo = bisect.bisect_left(seen, q0 + 1)
            hi = bisect.bisect_right(seen, q0 + d + LOCAL_RESYNC)
            if lo < hi:
                return min(seen[lo:hi], key=lambda e: abs(e - q0 - d))
        if d == 1:  # one token for one: the copy repeats it where the source token comes again
            self.subs.pop(ids[q0], None)
            self.subs[ids[q0]] = ids[e0]
            if len(self.subs) > MAX_SUBS:
                del self.subs[next(iter(self.subs))]
        return q0 + 1

    def _anchor(self, ids: list[int]) -> tuple[int | None, int]:
        """(where the best occurrence's continuation starts, how many tokens before it match the tail)."""
        last = len(ids) - 1
        for n in range(min(self.max_n, last), 0, -1):
            seen = self.ends.get(tuple(ids[-n:]))
            if not seen:
                continue
            best, best_len = seen[-1], -1
            for e in reversed(seen[-LOCAL_MAX_CANDIDATES:]):
                span = min(LOCAL_MATCH_SPAN, e)
                length = n
                while length < span and ids[e - 1 - length] == ids[last - length]:
                    length += 1
                if length > best_len:
                    best, best_len = e, length
            return best, best_len
        return None, 0


class SequenceIndex:
    """Next-token counts per context of SHARED_MIN_N..SHARED_MAX_N tokens over finished sequences."""

    def __init__(self, max_keys: int = SHARED_MAX_KEYS):
        self.max_keys = max_keys
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, ids: list[int], start: int = 0) -> None:
        """Count the continuations of `ids` from position `start` on."""
        counts = self.counts
        for e in range(max(start, SHARED_MIN_N), len(ids)):
            nxt = ids[e]
            for n in range(SHARED_MIN_N, min(SHARED_MAX_N, e) + 1):
                key = tuple(ids[e - n : e])
                d = counts.get(key)
                if d is None:
                    counts[key] = {nxt: 1}
                    continue
                d[nxt] = d.get(nxt, 0) + 1
                if len(d) > SHARED_MAX_NEXT:
                    del d[min(d, key=d.__getitem__)]
        if len(counts) > self.max_keys:  # dicts keep insertion order: drop the oldest contexts
            for key in list(counts)[: len(counts) // 4]:
                del counts[key]

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens, each the most frequent continuation of the longest known context."""
        ctx = ids[-SHARED_MAX_N:]
        out: list[int] = []
        while len(out) < k:
            nxt = None
            for n in range(min(SHARED_MAX_N, len(ctx)), SHARED_MIN_N - 1, -1):
                d = self.counts.get(tuple(ctx[-n:]))
                if d:
                    nxt = max(d, key=d.__getitem__)
                    break
            if nxt is None:
                break
            out.append(nxt)
            ctx = ctx[1:] + [nxt] if len(ctx) >= SHARED_MAX_N else ctx + [nxt]
        return out

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def approx_bytes(self) -> int:
        return len(self.counts) * SHARED_KEY_BYTES

    def clear(self) -> None:
        """Forget every sequence (`/flush_cache`, the memory guard). A new dict: a cleared one keeps its
        table's size."""
        self.counts = {}


@dataclass
class SpecState:
    """One request's drafting state (`Req.spec`): its index, its adaptive draft length, its counters."""

    k: int  # draft length for the next step (1..max_k)
    max_k: int = MAX_DRAFT_TOKENS  # this request's bound: the server's, or its own lower one
    index: LocalIndex = field(default_factory=LocalIndex)
    cooldown: int = 0  # steps to skip after repeated full rejections (doubles each time)
    skip: int = 0  # steps still skipped
    verify_steps: int = 0  # forwards in which this request had a draft
    accepted: int = 0  # draft tokens accepted in all
    hits: float = 0.0  # recent accepted draft tokens (decayed per verify), for `alpha`
    trials: float = 0.0  # recent draft tokens judged: accepted ones plus the first rejected one
    shadow: tuple[int, list[int]] | None = None  # a draft the budget cut: (seq len at proposal, draft)
    # `suffix`: the last step whose two sources disagreed, (seq len, own draft, shared draft), and how many
    # such steps the shared index won more than the request's own tokens lately (> 0: it drafts first)
    rival: tuple[int, list[int], list[int]] | None = None
    lead: int = 0

    @property
    def alpha(self) -> float:
        """Recent per-token acceptance rate (a draft token is accepted given the ones before it were),
        pulled towards ALPHA_PRIOR while there is little evidence and capped below 1."""
        prior = ALPHA_PRIOR * ALPHA_PRIOR_WEIGHT
        return min(ALPHA_MAX, (self.hits + prior) / (self.trials + ALPHA_PRIOR_WEIGHT))

    def cut(self, seq_len: int, draft: list[int]) -> None:
        """The budget cut this step's whole `draft` (proposed after `seq_len` tokens). It is judged once the
        tokens it guessed are out (`judge_cut`), as a verify would have judged it. Before, `alpha` only
        drifted back towards its prior while drafts were cut, so a request whose acceptance fell on free
        text went ~50 steps undrafted after its output turned into a copy (a 135M model's JSON turning into
        "1234567890" repeated)."""
        self.shadow = (seq_len, list(draft))

    def judge_cut(self, ids: list[int], max_k: int) -> None:
        """Score the last cut draft against the tokens emitted since (greedy: exactly what a verify would
        have accepted; sampled: a match has the acceptance probability's expectation) and adapt the draft
        length as a verify would (`record`). A rejected first guess halves `k` and, at 1, starts the
        cooldown: before, only matches were acted on, so every free-chat request whose drafts the budget
        cut kept proposing one (and the budget kept weighing it) every step."""
        if self.shadow is None:
            return
        at, draft = self.shadow
        seen = ids[at : at + len(draft)] if len(ids) >= at else []
        if not seen:
            if len(ids) < at:  # rewritten (retokenized after a jump-forward): nothing to judge
                self.shadow = None
            return
        self.shadow = None
        self._adapt(len(seen), _matched(draft, seen), max_k)

    def judge_sources(self, ids: list[int]) -> None:
        """Score the last disagreement of the two sources against the tokens emitted since: the one whose
        draft matched more of them gains a point (`lead` kept in [-LEAD_MAX, LEAD_MAX]). Prompt lookup goes
        first while `lead` <= 0: it is the better source for a copy of the request's own text. But an output
        that writes that text in another form ("apple_17" per line written back as "1. apple_17.") keeps
        drafting the prompt's form, while the shared index, which has seen that output, drafts the right one
        (a repeated request: 1.4 tokens per draft instead of ~4.7)."""
        if self.rival is None or len(ids) <= self.rival[0]:
            return
        at, own, shared = self.rival
        self.rival = None
        seen = ids[at : at + max(len(own), len(shared))]
        score = _matched(shared, seen) - _matched(own, seen)
        if score:
            self.lead = max(-LEAD_MAX, min(LEAD_MAX, self.lead + (1 if score > 0 else -1)))

    def record(self, drafted: int, accepted: int, max_k: int) -> None:
        """Adapt the draft length to this verify: all accepted -> double it, none -> halve it (and, at 1,
        skip drafting for a while), some -> one more than was accepted."""
        self.verify_steps += 1
        self.accepted += accepted
        self._adapt(drafted, accepted, max_k)

    def _adapt(self, drafted: int, accepted: int, max_k: int) -> None:
        """`accepted` of `drafted` judged draft tokens matched: update the counts of `alpha` and `k`."""
        self.hits = self.hits * ALPHA_DECAY + accepted
        self.trials = self.trials * ALPHA_DECAY + accepted + (accepted < drafted)
        if accepted == drafted:
            self.k = min(max_k, max(self.k, drafted) * 2)
            self.cooldown = 0
        elif accepted == 0:
            if self.k <= 1:
                self.cooldown = min(MAX_COOLDOWN, max(1, self.cooldown * 2))
                self.skip = self.cooldown
            self.k = max(1, self.k // 2)
        else:
            self.k = min(max_k, accepted + 1)
            self.cooldown = 0


def _matched(draft: list[int], seen: list[int]) -> int:
    """How many leading tokens of `draft` equal the emitted tokens `seen`."""
    n = 0
    for a, b in zip(draft, seen):
        if a != b:
            break
        n += 1
    return n


class Drafter:
    """Proposes each step's drafts; `algorithm` is 'ngram' or 'suffix'."""

    def __init__(self, algorithm: str, max_draft: int):
        self.algorithm = algorithm
        self.max_draft = max_draft
        self.shared = SequenceIndex() if algorithm == "suffix" else None

    def propose(self, state: SpecState, ids: list[int], k: int, shared_ok: bool) -> list[int]:
        """Up to `k` tokens to follow `ids` (the request's prompt + output); [] when nothing matches."""
        state.judge_cut(ids, min(self.max_draft, state.max_k))
        state.index.update(ids)
        if state.skip > 0:
            if not self._copying(state.index, ids, shared_ok):
                state.skip -= 1
                return []
            state.skip = 0  # the output runs into known text: draft again now (a rejection skips again)
        draft = state.index.propose(ids, k)
        if self.shared is None or not shared_ok:
            return draft
        state.judge_sources(ids)
        if draft and state.lead <= 0 and state.index.run >= LOCAL_MATCH_SPAN:  # a long exact copy: trust it
            alt = []
        else:
            alt = self.shared.propose(ids[-SHARED_MAX_N:], k)
        if not draft:
            return alt
        if alt and alt[0] != draft[0]:  # the two sources disagree: judged once the tokens are out
            state.rival = (len(ids), draft, alt)
            if state.lead > 0:
                return alt
        if len(draft) < k:
            draft = draft + self.shared.propose(ids[-SHARED_MAX_N:] + draft, k - len(draft))
        return draft

    def _copying(self, index: LocalIndex, ids: list[int], shared_ok: bool) -> bool:
        """Whether the output's last COPY_SIGNAL tokens occurred before in the request (or with `suffix`, its
        last SHARED_MAX_N as a context of finished sequences): a dictionary lookup and a short compare, so a
        request that skips drafting after rejections (free text) sees at once that its output has turned
        into a copy. Before, the skip ran its course (up to MAX_COOLDOWN steps, again after each rejected
        try): an edit's answer that began with free text went ~60 tokens of copied code undrafted. A shorter
        signal (3 tokens) also fired on free text's common phrases and cost chat ~5 % in verifies."""
        if len(ids) <= COPY_SIGNAL:
            return False
        tail = ids[-COPY_SIGNAL:]
        for e in reversed(index.ends.get(tuple(tail[-LOCAL_MAX_N:]), ())[-LOCAL_MAX_CANDIDATES:]):
            if e >= COPY_SIGNAL and ids[e - COPY_SIGNAL : e] == tail:
                return True
        return self.shared is not None and shared_ok and tuple(ids[-SHARED_MAX_N:]) in self.shared.counts

    def learn(self, ids: list[int], start: int) -> None:
        """A finished sequence: count it from `start` (what the cache held of it before) on."""
        if self.shared is not None:
            self.shared.add(ids, max(0, start - SHARED_MAX_N))
