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

Cost: one mask per path token (llguidance: ~0.1-1 ms over a 49k vocabulary); the caller runs it only when
the budget is near (`runtime/managers/scheduler/grammar_manager.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from constrained.errors import GrammarError

OUT, IN, ESCAPED = 0, 1, 2  # lexical states: outside a string, inside one, after a backslash inside one
FREE_CHOICE = 256  # more allowed tokens than this: the grammar leaves the text free here


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
        for tid, data in enumerate(token_bytes):
            if not data:
                continue
            self.length[tid] = len(data)
            for start in (OUT, IN, ESCAPED):
                self.end_state[start, tid], self.depth_delta[start, tid] = _scan(data, start, 0)

    def state_of(self, ids: Sequence[int]) -> tuple[int, int]:
        """(lexical state, depth) after the text of `ids`."""
        state, depth = OUT, 0
        for tid in ids:
            data = self.token_bytes[tid] if 0 <= tid < len(self.token_bytes) else None
            if data:
                state, depth = _scan(data, state, depth)
        return state, depth

    def best(self, allowed: np.ndarray, state: int, depth: int) -> int | None:
        """The allowed id that leaves the text least open (EOS first, then the longest), None if none."""
        allowed = allowed[(allowed >= 0) & (allowed < len(self.length))]
        allowed = allowed[(self.length[allowed] > 0) | (allowed == self.eos_token_id)]  # no special ids
        if not len(allowed):
            return None
        if self.eos_token_id in allowed:
            return self.eos_token_id
        openness = np.maximum(depth + self.depth_delta[state, allowed], 0) * 2
        openness += self.end_state[state, allowed] != OUT
        key = openness.astype(np.int64) * (1 << 22)
        if len(allowed) > FREE_CHOICE:  # free text (a string's content): the least text
            key += self.length[allowed]
        else:  # forced or nearly (a name, a key, an enum value): in the fewest tokens
            key -= self.length[allowed]
        return int(allowed[np.argmin(key)])


def closing_path(cursor, ranks: ClosingRanks, limit: int) -> list[int] | None:
    """Token ids (EOS last, unless the grammar ends without it) that take `cursor` from its state to the
    grammar's end, or None when the greedy walk does not get there within `limit` tokens. The cursor is left
    where it was."""
    path: list[int] = []
    state, depth = ranks.state_of(cursor.accepted_ids)
    try:
        while len(path) < limit:
            if cursor.is_terminated():
                return path
            tok = ranks.best(np.asarray(cursor.allowed_token_ids()), state, depth)
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
                state, depth = _scan(data, state, depth)
        return path if cursor.is_terminated() else None
    finally:
        cursor.rollback(len(path))
