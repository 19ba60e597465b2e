"""outlines-core: the regex -> byte-level DFA backend (``constrained.grammar``, ``constrained.spec``).

JSON Schemas are translated to one regex by ``constrained.json_schema``, so their cost is the DFA's: fine for
flat schemas, seconds to minutes (or past the memory cap) for bounded strings, patterns inside strings and
nested formats. Masks are memoized per DFA state and shared by every request of a grammar.
"""

from __future__ import annotations

import pickle

from constrained.backends import GrammarBackend
from constrained.errors import GrammarError


class OutlinesBackend(GrammarBackend):
    name = "outlines"
    kinds = frozenset({"regex", "json_schema", "json_object"})

    def prepare(self, vocab) -> None:
        import outlines_core  # noqa: F401

        import constrained.spec  # noqa: F401

    def check(self, kind: str, spec: str, whitespace_pattern: str) -> str:
        from constrained.spec import validate_spec

        return validate_spec(kind, spec, whitespace_pattern)

    def build(self, kind: str, spec: str, whitespace_pattern: str, vocab) -> tuple[str, object]:
        """(regex, outlines_core.Index of the regex + end marker)."""
        import outlines_core

        from constrained.vocab import END_MARKER_REGEX

        regex = self.check(kind, spec, whitespace_pattern)
        try:
            index = outlines_core.Index(f"(?:{regex}){END_MARKER_REGEX}", vocab.outlines)
        except ValueError as err:  # the check passed, so this is a vocabulary problem
            raise GrammarError(f"cannot compile {kind} for this tokenizer: {err}") from None
        return regex, index

    def load(self, kind, spec, text, payload, vocab, vocab_size, compile_seconds, nbytes):
        from constrained.grammar import CompiledGrammar

        if not nbytes:  # built on a thread of this process: nothing crossed a pipe
            nbytes = len(pickle.dumps(payload))
        return CompiledGrammar(kind, spec, text, payload, vocab, vocab_size, compile_seconds, nbytes)


BACKEND = OutlinesBackend()
