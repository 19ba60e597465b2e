"""The exception types of the constrained-decoding package, by what the HTTP layer answers.

* ``GrammarError`` (and its ``GrammarTimeout``): the spec's fault -> 400 naming the problem.
* ``GrammarUnavailable``: the server's state, not the spec (queue full, waited too long, a worker crashed or
  failed to start, shutting down) -> 503; the same request may succeed on retry, so it is never cached.
"""


class GrammarError(ValueError):
    """A grammar spec that cannot be used, or a token the grammar does not allow.

    Subclasses ValueError so the HTTP layer can map it to a 400 with ``str(err)`` as the reason; the message
    always names the problem (bad regex syntax, unsupported schema keyword, unsatisfiable bounds, ...).
    """


class GrammarUnsupported(GrammarError):
    """The spec is valid but this backend cannot enforce part of it (a JSON Schema keyword, a format): under
    ``--grammar-backend auto`` the next backend that can express the kind tries it; else a 400 like any
    GrammarError."""


class GrammarTimeout(GrammarError):
    """A compile ran past --grammar-timeout-s: a 400 like any too-complex spec, but compile time depends on
    the machine's load, so the verdict is cached only briefly (``grammar_cache.TIMEOUT_TTL_S``)."""


class GrammarUnavailable(RuntimeError):
    """The grammar could not be checked or compiled now, through no fault of the spec: HTTP 503, retry."""
