"""Draft tokens for speculative decoding, from text that already exists: no draft model.

Two sources, both plain Python dictionaries updated incrementally (no torch, no device work):

- `LocalIndex`, one per request: where each n-gram (n <= max_n) of its prompt + output last occurred. The
  draft is what followed the most recent earlier occurrence of the request's last n tokens, longest n
  first ("prompt lookup"): tool-call JSON echoing its context, an edited file copied back, a quoted document.
- `SequenceIndex`, one per scheduler (`suffix` only): n-gram -> next-token counts over the sequences of
  finished requests, i.e. what the radix cache receives. The draft follows the most frequent continuation,
  token by token, so one agent's third tool call is drafted from the first two and one request's output
  from another's. The tree itself is keyed by prefix, so a lookup by suffix needs this index of its own;
  it is fed the part of a request the tree did not hold yet (from its cache hit on).

Salted requests (`cache_salt`) neither feed the shared index nor draft from it: drafts never change outputs,
but acceptance changes timing, which must not leak across salts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# prompt lookup tries the last 3, 2, then 1 tokens; finished-sequence counts use contexts of 4 down to 2
LOCAL_MAX_N = 3
SHARED_MIN_N, SHARED_MAX_N = 2, 4
SHARED_MAX_KEYS = 300_000  # past it the oldest quarter of the contexts is dropped (~100 MB at the cap)
SHARED_MAX_NEXT = 8  # continuations kept per context (the rarest goes first)
MAX_COOLDOWN = 16  # steps a request skips drafting after repeated full rejections, at most


class LocalIndex:
    """Where each n-gram of one request's tokens last occurred (its end: where the continuation starts)."""

    def __init__(self, max_n: int = LOCAL_MAX_N):
        self.max_n = max_n
        self.last: dict[tuple[int, ...], int] = {}  # n-grams of every n share one table (lengths differ)
        self.indexed = 0  # end positions below this are in `last`

    def update(self, ids: list[int]) -> None:
        """Index the n-grams of `ids` that end at a position with a continuation (below len(ids))."""
        if len(ids) < self.indexed:  # the tokens were rewritten: start again
            self.last.clear()
            self.indexed = 0
        last, max_n = self.last, self.max_n
        for e in range(max(self.indexed, 1), len(ids)):
            for n in range(1, min(max_n, e) + 1):
                last[tuple(ids[e - n : e])] = e
        self.indexed = max(self.indexed, len(ids))

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching tail."""
        for n in range(min(self.max_n, len(ids) - 1), 0, -1):
            e = self.last.get(tuple(ids[-n:]))
            if e is not None:
                return ids[e : e + k]
        return []


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


@dataclass
class SpecState:
    """One request's drafting state (`Req.spec`): its index, its adaptive draft length, its counters."""

    k: int  # draft length for the next step (1..max)
    index: LocalIndex = field(default_factory=LocalIndex)
    cooldown: int = 0  # steps to skip after repeated full rejections (doubles each time)
    skip: int = 0  # steps still skipped
    verify_steps: int = 0  # forwards in which this request had a draft
    accepted: int = 0  # draft tokens accepted in all

    def record(self, drafted: int, accepted: int, max_k: int) -> None:
        """Adapt the draft length to this verify: all accepted -> double it, none -> halve it (and, at 1,
        skip drafting for a while), some -> one more than was accepted."""
        self.verify_steps += 1
        self.accepted += accepted
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


class Drafter:
    """Proposes each step's drafts; `algorithm` is 'ngram' or 'suffix'."""

    def __init__(self, algorithm: str, max_draft: int):
        self.algorithm = algorithm
        self.max_draft = max_draft
        self.shared = SequenceIndex() if algorithm == "suffix" else None

    def propose(self, state: SpecState, ids: list[int], k: int, shared_ok: bool) -> list[int]:
        """Up to `k` tokens to follow `ids` (the request's prompt + output); [] when nothing matches."""
        if state.skip > 0:
            state.skip -= 1
            return []
        state.index.update(ids)
        draft = state.index.propose(ids, k)
        if self.shared is not None and shared_ok and len(draft) < k:
            draft = draft + self.shared.propose(ids[-SHARED_MAX_N:] + draft, k - len(draft))
        return draft

    def learn(self, ids: list[int], start: int) -> None:
        """A finished sequence: count it from `start` (what the cache held of it before) on."""
        if self.shared is not None:
            self.shared.add(ids, max(0, start - SHARED_MAX_N))
