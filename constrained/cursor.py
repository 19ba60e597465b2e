"""What every engine's per-request cursor shares: many-token accept and reset, built on the engine's own
``accept_token`` (raises GrammarError) and ``rollback``, over ``self._ids`` (the accepted token ids)."""

from __future__ import annotations

from collections.abc import Sequence

from constrained.errors import GrammarError


class TokenCursor:
    _ids: list[int]

    def accept_token(self, token_id: int) -> None:
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError

    def accept_tokens(self, token_ids: Sequence[int]) -> None:
        """Accept several tokens; all or nothing."""
        start = len(self._ids)
        try:
            for tid in token_ids:
                self.accept_token(tid)
        except GrammarError:
            self.rollback(len(self._ids) - start)
            raise

    def reset_to(self, token_ids: Sequence[int]) -> None:
        """Make the accepted sequence ``token_ids``: rolls back to the common prefix, then accepts the rest.

        Raises GrammarError (and keeps the previous sequence) if ``token_ids`` is not accepted.
        """
        common = 0
        limit = min(len(token_ids), len(self._ids))
        while common < limit and token_ids[common] == self._ids[common]:
            common += 1
        previous = self._ids[common:]
        self.rollback(len(self._ids) - common)
        try:
            self.accept_tokens(token_ids[common:])
        except GrammarError:
            self.accept_tokens(previous)
            raise
