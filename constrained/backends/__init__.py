"""Grammar backends: which engine turns a (kind, spec) into a compiled grammar and per-request cursors.

Each backend is one module with one ``GrammarBackend`` subclass; ``get_backend(name)`` imports it on first
use (a compile worker must not pull in engines it never runs). Every backend's compiled grammar and cursor
implement the contract of ``constrained.grammar`` (``CompiledGrammar`` / ``GrammarMatcher``):

* compiled grammar: ``.kind``, ``.spec``, ``.backend`` (its name), ``.compile_seconds``, ``memory_bytes()``,
  ``new_matcher()``; shared by every request using it, so it must be thread-safe to share;
* cursor: ``fill_vocab_mask(row)`` (row arrives zeroed, [vocab_size] bool), ``allowed_token_ids()``,
  ``is_allowed(id)``, ``accept_token(id)`` (GrammarError if not allowed, state unchanged),
  ``accept_tokens(ids)`` (all or nothing), ``rollback(n)``, ``reset_to(ids)``, ``can_finish()``,
  ``is_terminated()``, ``jump_forward_string()`` (forced text or None; the runtime re-tokenizes it with
  ``constrained.jump_forward.plan_jump_forward``), ``accepted_ids``. The model's EOS id is allowed exactly
  when ``can_finish()``; ids past the tokenizer's vocabulary are never allowed.

The three steps a grammar goes through, and where they run:

1. ``check(kind, spec, whitespace)`` -- no vocabulary; in a capped sandbox worker for the HTTP process's
   early check (``runtime.managers.tokenizer.grammar_validator``). GrammarError (a 400 naming the problem)
   if unusable.
2. ``build(kind, spec, whitespace, vocab)`` -- in a capped sandbox worker of the scheduler
   (``constrained.compile_pool``): check, then compile against the tokenizer. Returns ``(text, payload)``,
   both picklable (they cross a pipe): ``text`` is for diagnostics (the regex, the grammar text), ``payload``
   is what ``load`` needs.
3. ``load(...)`` -- in the scheduler: wrap the payload into the compiled grammar. Must be cheap.
"""

from __future__ import annotations

import importlib
import threading
import weakref

from constrained.errors import GrammarError, GrammarUnsupported

BACKEND_NAMES = ("outlines", "llguidance", "xgrammar")
BACKEND_CHOICES = ("auto", *BACKEND_NAMES)  # --grammar-backend
ALL_KINDS = ("regex", "json_schema", "json_object", "lark")
# `auto`, per kind: the backends in order of preference (the first one installed that expresses the kind).
# JSON on llguidance: compile ~1-10 ms and no DFA blow-up (bounded strings, patterns inside strings, nested
# formats), where outlines-core needs 0.5-70 s or runs out of memory; masks are in the same range (see
# docs/architecture.md, "Grammar backends", for the figures). Plain regexes stay on outlines-core: its
# masks are memoized per DFA state and its regex dialect and error messages are what clients already see.
AUTO_PREFERENCE: dict[str, tuple[str, ...]] = {
    "regex": ("outlines", "llguidance"),
    "json_schema": ("llguidance", "outlines"),
    "json_object": ("llguidance", "outlines"),
    "lark": ("llguidance",),
}


class GrammarBackend:
    """One grammar engine. Stateless apart from caches; one instance per process (``get_backend``)."""

    name: str = ""
    kinds: frozenset[str] = frozenset()  # grammar kinds this engine can express
    package: str | None = None  # the optional package the engine needs

    def unavailable(self) -> str | None:
        """Why this backend cannot be used in this environment (its package is missing), or None."""
        if self.package is None:
            return None
        try:
            importlib.import_module(self.package)
        except ImportError as err:
            return f"the {self.package} package is not installed ({err})"
        return None

    def prepare(self, vocab) -> None:
        """Called once in each sandbox worker before its memory cap is set (``vocab``: the TokenVocabulary,
        None in a check-only worker): import the engine, build per-vocabulary tables."""

    def check(self, kind: str, spec: str, whitespace_pattern: str) -> str:
        """Validate without a vocabulary; returns the diagnostic text. Raises GrammarError."""
        raise NotImplementedError

    def build(self, kind: str, spec: str, whitespace_pattern: str, vocab) -> tuple[str, object]:
        """Check and compile against ``vocab`` (a ``constrained.vocab.TokenVocabulary``) inside a sandbox
        worker; ``(text, payload)``, both picklable. Raises GrammarError (or MemoryError past the cap)."""
        raise NotImplementedError

    def load(
        self,
        kind: str,
        spec: str,
        text: str,
        payload: object,
        vocab,
        vocab_size: int,
        compile_seconds: float,
        nbytes: int,
    ):
        """The compiled grammar (the contract above) from ``build``'s payload, in the scheduler; cheap.
        ``vocab_size``: the model's logits width; ``nbytes``: the pickled reply's size (a memory hint)."""
        raise NotImplementedError


_text_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TokenVocabulary -> HF tokenizer


def register_text_tokenizer(vocab, tokenizer) -> None:
    """Tell backends the real tokenizer of ``vocab`` (GrammarCompiler does, in the scheduler): an engine
    that tokenizes forced text itself (llguidance) then offers the tokenizer's own split of it."""
    _text_tokenizers[vocab] = tokenizer


def text_tokenizer(vocab):
    """The tokenizer registered for ``vocab``, or None (sandbox workers have only the vocabulary)."""
    return _text_tokenizers.get(vocab)


_MODULES = {name: f"constrained.backends.{name}" for name in BACKEND_NAMES}
_instances: dict[str, GrammarBackend] = {}
_lock = threading.Lock()


def get_backend(name: str) -> GrammarBackend:
    """The backend called ``name`` (one of BACKEND_NAMES). Raises GrammarError for an unknown name or one
    whose package is not installed."""
    with _lock:
        backend = _instances.get(name)
        if backend is None:
            module = _MODULES.get(name)
            if module is None:
                expected = ", ".join(BACKEND_NAMES)
                raise GrammarError(f"unknown grammar backend {name!r}; expected one of {expected}")
            try:
                backend = importlib.import_module(module).BACKEND
            except ImportError as err:
                raise GrammarError(f"grammar backend {name!r} is not available: {err}") from None
            _instances[name] = backend
    problem = backend.unavailable()
    if problem:
        raise GrammarError(f"grammar backend {name!r} is not available: {problem}")
    return backend


def is_available(name: str) -> bool:
    try:
        get_backend(name)
    except GrammarError:
        return False
    return True


def choose_backend(requested: str, kind: str, spec: str | None = None) -> str:
    """The backend that compiles this request's grammar: ``requested`` (a --grammar-backend choice) when it
    can express ``kind``, else (``auto``, or the per-request fallback) the first installed backend of
    AUTO_PREFERENCE[kind]. ``spec`` is unused today (the choice is per kind); it is part of the interface so
    a backend may later turn down single specs. Raises GrammarError when no backend can express ``kind``."""
    if kind not in ALL_KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(ALL_KINDS)}")
    if requested != "auto":
        if requested not in BACKEND_NAMES:
            raise GrammarError(
                f"unknown grammar backend {requested!r}; expected one of {', '.join(BACKEND_CHOICES)}"
            )
        if is_available(requested) and kind in get_backend(requested).kinds:
            return requested
    for name in AUTO_PREFERENCE[kind]:
        if is_available(name) and kind in get_backend(name).kinds:
            return name
    raise GrammarError(f"no installed grammar backend can compile a {kind} grammar")


def backend_chain(requested: str, kind: str) -> tuple[str, ...]:
    """The backends to try, in order, for one request. ``auto``: every installed backend of
    AUTO_PREFERENCE[kind] (a spec the first cannot enforce -- GrammarUnsupported -- goes to the next); a named
    backend: just ``choose_backend``'s pick (itself, or the fallback for a kind it cannot express)."""
    first = choose_backend(requested, kind)
    if requested != "auto":
        return (first,)
    rest = [
        n for n in AUTO_PREFERENCE[kind] if n != first and is_available(n) and kind in get_backend(n).kinds
    ]
    return (first, *rest)


def backends_used(requested: str) -> tuple[str, ...]:
    """Every installed backend a --grammar-backend choice may hand a job to (over all kinds): the ones a
    sandbox worker prepares before its memory cap. xgrammar is never in ``auto``'s chains: its import
    (torch, transformers) would cost every grammar worker ~3 s and ~600 MB for a third fallback."""
    names: list[str] = []
    for kind in ALL_KINDS:
        try:
            chain = backend_chain(requested, kind)
        except GrammarError:
            continue
        names += [n for n in chain if n not in names]
    return tuple(names)


def run_chain(
    chain: tuple[str, ...] | str,
    kind: str,
    spec: str,
    whitespace_pattern: str,
    vocab=None,
    check: bool = False,
) -> tuple[str, str, object]:
    """Check (``check``) or build ``spec`` with the first backend of ``chain`` (a tuple, or names joined by
    commas) that can enforce it: (backend name, text, payload). A backend's GrammarUnsupported moves on to
    the next; if every backend refuses, the GrammarError names each one's reason."""
    names = tuple(chain.split(",")) if isinstance(chain, str) else tuple(chain)
    refusals: list[str] = []
    for i, name in enumerate(names):
        backend = get_backend(name)
        try:
            if check:
                return name, backend.check(kind, spec, whitespace_pattern), None
            text, payload = backend.build(kind, spec, whitespace_pattern, vocab)
            return name, text, payload
        except GrammarUnsupported as err:
            if i == len(names) - 1:
                if not refusals:
                    raise
                refusals.append(f"{name}: {err}")
                break
            refusals.append(f"{name}: {err}")
        except GrammarError as err:
            if not refusals:
                raise
            refusals.append(f"{name}: {err}")
            break
    raise GrammarError(f"no grammar backend can enforce this {kind} ({'; '.join(refusals)})")
