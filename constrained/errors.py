"""The one exception type of the constrained-decoding package."""


class GrammarError(ValueError):
    """A grammar spec that cannot be used, or a token the grammar does not allow.

    Subclasses ValueError so the HTTP layer can map it to a 400 with ``str(err)`` as the reason; the message
    always names the problem (bad regex syntax, unsupported schema keyword, unsatisfiable bounds, ...).
    """
