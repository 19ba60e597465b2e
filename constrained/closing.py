"""Closing a grammar before the token budget ends (issue 47: a tool call is never cut by max_tokens).

`closing_path` rolls a cursor forward greedily towards the grammar's end and rolls it back (the cursor ends
where it started). Every grammar radixlm serves is JSON or wraps JSON (tool calls), so the walk measures
how open the text is as JSON: the containers (`{`, `[`) open outside strings, plus one for an open string.
At each step it takes, among the tokens the grammar allows, EOS where the grammar may end, else the token
that leaves the text least open; on ties, where the grammar leaves the text free (more than FREE_CHOICE
tokens allowed) the shortest, else the longest (forced text such as a tool call's name in the fewest
tokens). `ClosingRanks` holds what each token does to that measure from each lexical state (outside a
string, inside one, right after a backslash in one), computed once per vocabulary, so a step is one mask
and a few vectorised operations.

A request steered along the path once its remaining budget is no more than its length ends inside the
budget (jump-forward may re-tokenize forced text differently: the caller keeps a margin and walks again).
It needs only the cursor contract (allowed_token_ids, accept_token, rollback, is_terminated,
accepted_ids), so it works on every engine.

Reasoning models' grammars put free thoughts before the answer (`<think>...</think>`, see
runtime/entrypoints/wire/reasoning.py). The walk knows where the thoughts stand (`Thoughts`: a grammar that
starts inside them, one that may open them, or none) and closes open thoughts with their tag before it
measures the answer; it never opens them. The JSON measure counts the answer's text only.

Cost: one mask per path token (llguidance: ~0.1-1 ms over a 49k vocabulary); the caller runs it only when
the budget is near (`runtime/managers/scheduler/grammar_manager.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from constrained.errors import GrammarError

OUT, IN, ESCAPED = 0, 1, 2  # lexical states: outside a string, inside one, after a backslash inside one
FREE_CHOICE = 256  # more allowed tokens than this: the grammar leaves the text free here
# The tags around reasoning models' thoughts (the reasoning parsers of runtime/entrypoints/wire use these).
THOUGHTS_OPEN, THOUGHTS_CLOSE = "<think>", "</think>"
_OPEN, _CLOSE = THOUGHTS_OPEN.encode(), THOUGHTS_CLOSE.encode()
# Where a grammar's output starts (`thoughts_of`): no thoughts; thoughts it may open (qwen3: the output may
# begin with the open tag); inside thoughts (deepseek-r1: the prompt opened them).
NO_THOUGHTS, MAY_OPEN_THOUGHTS, IN_THOUGHTS = "none", "optional", "inside"


def _scan(data: bytes, state: int, depth: int) -> tuple[int, int]:
    """(state, depth) after `data` from (state, depth); depth counts `{`/`[` opened outside strings."""
    for b in data:
        if state == ESCAPED:
            state = IN
        elif state == IN:
            if b == 0x5C:  # backslash
                state = ESCAPED
            elif b == 0x22:  # quote
                state = OUT
        elif b == 0x22:
            state = IN
        elif b in (0x7B, 0x5B):  # { [
            depth += 1
        elif b in (0x7D, 0x5D):  # } ]
            depth -= 1
    return state, depth


class _Text:
    """Where the walk stands in the output: before the answer in a prefix of the open tag (`pre`), inside
    the thoughts (`thoughts`: `pending` is the longest tail that begins the close tag), or in the answer
    (its JSON `state` and `depth`)."""

    __slots__ = ("mode", "pending", "state", "depth")

    def __init__(self, thoughts: str):
        self.mode = {NO_THOUGHTS: "answer", MAY_OPEN_THOUGHTS: "pre", IN_THOUGHTS: "thoughts"}[thoughts]
        self.pending, self.state, self.depth = b"", OUT, 0

    def feed(self, data: bytes) -> None:
        for i, b in enumerate(data):
            if self.mode == "answer":
                self.state, self.depth = _scan(data[i:], self.state, self.depth)
                return
            seen = self.pending + bytes((b,))
            if self.mode == "pre":
                if seen == _OPEN:
                    self.mode, self.pending = "thoughts", b""
                elif _OPEN.startswith(seen):
                    self.pending = seen
                else:  # no thoughts: all of it is the answer
                    self.mode, self.pending = "answer", b""
                    self.state, self.depth = _scan(seen + data[i + 1 :], OUT, 0)
                    return
            elif seen == _CLOSE:
                self.mode, self.pending = "answer", b""
            else:
                while seen and not _CLOSE.startswith(seen):
                    seen = seen[1:]
                self.pending = seen


class ClosingRanks:
    """What each token does to the openness measure, per starting lexical state (built once per vocabulary
    from its token bytes; None: special or unused ids, never chosen except EOS)."""

    def __init__(self, token_bytes: Sequence[bytes | None], eos_token_id: int):
        n = len(token_bytes)
        self.token_bytes = token_bytes
        self.eos_token_id = eos_token_id
        self.end_state = np.zeros((3, n), dtype=np.int8)  # [start state, token] -> lexical state after
        self.depth_delta = np.zeros((3, n), dtype=np.int32)  # [start state, token] -> change of depth
        self.length = np.zeros(n, dtype=np.int32)  # bytes
        self.blank = np.zeros(n, dtype=bool)  # whitespace only: never progress outside a string
        # tag -> [k] -> ids whose text begins the tag's bytes from k (the walk spells a tag with them)
        pieces: dict[bytes, list[list[int]]] = {tag: [[] for _ in tag] for tag in (_OPEN, _CLOSE)}
        opens_thoughts = []  # ids whose text begins the open tag or starts with it: the walk never opens it
        for tid, data in enumerate(token_bytes):
            if not data:
                continue
            self.length[tid] = len(data)
            self.blank[tid] = not data.strip()
            for start in (OUT, IN, ESCAPED):
                self.end_state[start, tid], self.depth_delta[start, tid] = _scan(data, start, 0)
            for tag, by_start in pieces.items():
                if len(data) <= len(tag):
                    for k in range(len(tag)):
                        if tag.startswith(data, k):
                            by_start[k].append(tid)
            if _OPEN.startswith(data) or data.startswith(_OPEN):
                opens_thoughts.append(tid)
        self.pieces = {
            tag: [np.asarray(ids, dtype=np.int64) for ids in by_start] for tag, by_start in pieces.items()
        }
        self.opens_thoughts = np.asarray(opens_thoughts, dtype=np.int64)

    def piece(self, tag: bytes, at: int, allowed: np.ndarray) -> int | None:
        """The longest allowed id whose text continues `tag` from byte `at`, None if none."""
        ids = self.pieces[tag][at]
        ids = ids[np.isin(ids, allowed)]
        return int(ids[np.argmax(self.length[ids])]) if len(ids) else None

    def text_of(self, ids: Sequence[int], thoughts: str) -> _Text:
        """Where the output of `ids` stands (a grammar of `thoughts`)."""
        text = _Text(thoughts)
        for tid in ids:
            data = self.token_bytes[tid] if 0 <= tid < len(self.token_bytes) else None
            if data:
                text.feed(data)
        return text

    def best(self, allowed: np.ndarray, text: _Text) -> int | None:
        """The allowed id that leaves the text least open (EOS first; in thoughts, the longest piece of their
        close tag; then the longest), None if none."""
        allowed = allowed[(allowed >= 0) & (allowed < len(self.length))]
        allowed = allowed[(self.length[allowed] > 0) | (allowed == self.eos_token_id)]  # no special ids
        if not len(allowed):
            return None
        if self.eos_token_id in allowed:
            return self.eos_token_id
        if text.mode == "thoughts":  # the close tag; where it cannot go yet (inside a character), the least
            tok = self.piece(_CLOSE, len(text.pending), allowed)
            return tok if tok is not None else int(allowed[np.argmin(self.length[allowed])])
        state, depth = text.state, text.depth
        if text.mode == "pre" and not text.pending:  # the answer at once, unless only thoughts may start
            allowed = _unless_none_left(allowed, ~np.isin(allowed, self.opens_thoughts))
        if state == OUT:  # whitespace between values (after the thoughts' tag, say) only where it is forced
            allowed = _unless_none_left(allowed, ~self.blank[allowed])
        openness = np.maximum(depth + self.depth_delta[state, allowed], 0) * 2
        openness += self.end_state[state, allowed] != OUT
        key = openness.astype(np.int64) * (1 << 22)
        if len(allowed) > FREE_CHOICE:  # free text (a string's content): the least text
            key += self.length[allowed]
        else:  # forced or nearly (a name, a key, an enum value): in the fewest tokens
            key -= self.length[allowed]
        return int(allowed[np.argmin(key)])


def _unless_none_left(ids: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """`ids[keep]`, or all of `ids` where that leaves none."""
    kept = ids[keep]
    return kept if len(kept) else ids


def thoughts_of(cursor, ranks: ClosingRanks) -> str:
    """Where a fresh `cursor`'s grammar starts: IN_THOUGHTS when it takes the close tag at once (the prompt
    opened the thoughts), MAY_OPEN_THOUGHTS when it takes the open tag, else NO_THOUGHTS. The cursor is left
    where it was."""
    for tag, where in ((_CLOSE, IN_THOUGHTS), (_OPEN, MAY_OPEN_THOUGHTS)):
        if _takes(cursor, ranks, tag):
            return where
    return NO_THOUGHTS


def _takes(cursor, ranks: ClosingRanks, text: bytes) -> bool:
    """Whether the grammar takes `text` next (spelled greedily with the longest allowed tokens); the cursor
    is left where it was."""
    n, at = 0, 0
    try:
        while at < len(text):
            tok = ranks.piece(text, at, np.asarray(cursor.allowed_token_ids()))
            if tok is None:
                return False
            cursor.accept_token(tok)
            n += 1
            at += len(ranks.token_bytes[tok])
        return True
    except GrammarError:
        return False
    finally:
        cursor.rollback(n)


def closing_path(cursor, ranks: ClosingRanks, limit: int, thoughts: str = NO_THOUGHTS) -> list[int] | None:
    """Token ids (EOS last, unless the grammar ends without it) that take `cursor` from its state to the
    grammar's end, or None when the greedy walk does not get there within `limit` tokens. `thoughts`: where
    the grammar's output starts (`thoughts_of`). The cursor is left where it was."""
    path: list[int] = []
    text = ranks.text_of(cursor.accepted_ids, thoughts)
    try:
        while len(path) < limit:
            if cursor.is_terminated():
                return path
            tok = ranks.best(np.asarray(cursor.allowed_token_ids()), text)
            if tok is None:
                return None
            try:
                cursor.accept_token(tok)
            except GrammarError:
                return None
            path.append(tok)
            if tok == ranks.eos_token_id:
                return path
            data = ranks.token_bytes[tok]
            if data:
                text.feed(data)
        return path if cursor.is_terminated() else None
    finally:
        cursor.rollback(len(path))
