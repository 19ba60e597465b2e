"""llguidance: an Earley parser over a lazily built lexer DFA, masks computed per step (no per-grammar
automaton over the vocabulary), so compile is milliseconds whatever the schema's bounds and patterns.

* kinds: regex, json_schema, json_object, and lark (llguidance's Lark dialect; may embed ``%json{...}``).
* strict JSON Schema: llguidance's ``lenient`` stays off, so a keyword it cannot enforce is an error, which
  becomes a GrammarError naming it (a 400). ``oneOf`` is rewritten exactly (or refused) by
  ``constrained.one_of`` first, as on every backend; ``coerce_one_of`` stays off, so a ``oneOf`` llguidance
  cannot prove disjoint (in a lark ``%json``) is a 400, never an ``anyOf``. A custom (non-standard)
  ``format`` is dropped first, as the JSON Schema specification says unknown formats are ignored; a
  standard format llguidance lacks is a 400. No bounded-string relaxation: ``maxLength`` is enforced as
  written, and formats with an RFC length limit (``email`` 254, ``hostname`` 253) get it as ``maxLength``
  where the schema gives none or a larger one (llguidance's format regexes bound no length).
* layout: ``DUMPS_LAYOUT`` (the server's) is ``", "`` / ``": "`` and no other whitespace, as on outlines.
* the sandbox worker validates the grammar against the tokenizer and sends the grammar text back; the
  scheduler builds one template matcher per grammar and ``deep_copy``-s it per request (microseconds);
  loading it also computes the start mask, so a new grammar's first lexer states are built there, not in
  the first request's decode step.
* EOS is the model's eos id, allowed exactly when the matcher accepts; it is tracked here, not fed to
  llguidance, so rollback over it is trivial.
"""

from __future__ import annotations

import array
import functools
import json
import threading
import weakref

import numpy as np

from constrained.backends import GrammarBackend
from constrained.cursor import TokenCursor
from constrained.errors import GrammarError, GrammarUnsupported

MAX_LARK_CHARS = 400_000  # a tool-set grammar embeds every tool's schema: 40 tools of ~2-5 KB fit easily
MAX_JUMP_BYTES = 256  # as constrained.grammar: longest forced string returned at once
# forced-text tokenizations remembered per tokenizer, texts of at most FORCED_MEMO_BYTES: ~1.5 KB an entry
FORCED_MEMO_ENTRIES = 4096
FORCED_MEMO_BYTES = 256
MATCHER_BASE_BYTES = 256 << 10  # memory_bytes(): a template matcher's parser and lexer tables, roughly
_JSON_STRICT = {"lenient": False, "coerce_one_of": False}
_DUMPS_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def _json_options(whitespace_pattern: str) -> dict:
    from constrained.json_schema import DUMPS_LAYOUT

    if whitespace_pattern == DUMPS_LAYOUT:
        return {**_JSON_STRICT, **_DUMPS_OPTIONS}
    return {
        **_JSON_STRICT,
        "item_separator": ",",
        "key_separator": ":",
        "whitespace_flexible": bool(whitespace_pattern),
        "whitespace_pattern": whitespace_pattern or None,
    }


_COMBINATORS = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas", "dependencies")
_DEPENDENCY_KEYS = ("dependencies", "dependentRequired", "dependentSchemas")


def _prepare_schema(schema: dict) -> dict:
    """``schema`` as llguidance gets it (``_prepare``); the input is not modified."""
    return _prepare(schema, _open_targets(schema))


def _prepare(node, open_ids: set, depth: int = 0, in_all_of: bool = False):
    """``node`` with every non-standard ``format`` removed (validators ignore unknown formats; llguidance
    would refuse them), the RFC length limit of a format that has one as ``maxLength`` (llguidance's
    ``email`` / ``hostname`` bound no length: ``formats.cap_format_length``), ``not`` as what it leaves
    (``constrained.negation``: exact, or a subset where a condition cannot be spelled; a 400 where none
    can), ``dependencies`` / ``dependentRequired`` /
    ``dependentSchemas`` spelled with ``anyOf`` / ``allOf`` (exact; llguidance has no such keyword), and
    ``additionalProperties: false`` where an object lists ``properties`` and says nothing of others --
    what outlines-core emits (and xgrammar's strict mode): only the listed keys (and the ``required``
    ones), a valid subset, so a small model cannot ramble in invented keys. Never where the object meets
    other subschemas (``in_all_of``: an ``allOf`` item, a branch beside other keywords, a dependency's
    schema, a ``$ref`` target of such a place: ``open_ids``), where closing would change what is valid.
    Only schema positions are walked."""
    from constrained.formats import FORMAT_REGEXES, UNSUPPORTED_FORMATS, cap_format_length
    from constrained.json_schema import _LIST_KEYS, _MAP_KEYS, _SCHEMA_KEYS
    from constrained.negation import negate
    from constrained.schema_keywords import KEYWORDS, accepts_nothing

    if not isinstance(node, dict) or depth > 200:
        return node
    if accepts_nothing(node):
        return False
    opened = in_all_of or id(node) in open_ids
    beside = set(node) & KEYWORDS
    out = {}
    for key, value in node.items():
        if key == "format" and isinstance(value, str):
            if value not in FORMAT_REGEXES and value not in UNSUPPORTED_FORMATS:
                continue
        elif key in ("dependencies", "dependentSchemas") and isinstance(value, dict):
            value = {k: _prepare(v, open_ids, depth + 1, True) for k, v in value.items()}
        elif key in _MAP_KEYS and isinstance(value, dict):
            value = {k: _prepare(v, open_ids, depth + 1) for k, v in value.items()}
        elif key in _LIST_KEYS and isinstance(value, list):
            intersected = key == "allOf" or (key in ("anyOf", "oneOf") and (opened or len(beside) > 1))
            value = [_prepare(v, open_ids, depth + 1, intersected) for v in value]
        elif key in _SCHEMA_KEYS:
            value = _prepare(value, open_ids, depth + 1)
        out[key] = value
    out = cap_format_length(out)
    names_only = all(
        isinstance(v, list) for k in _DEPENDENCY_KEYS if isinstance(out.get(k), dict) for v in out[k].values()
    )
    closable = not opened and not any(k in out for k in _COMBINATORS if k not in _DEPENDENCY_KEYS)
    if "not" in out:
        fails, exact = negate(node["not"], within=node.get("type"))
        if exact and not fails:
            return False  # `not` of a schema every value meets
        if fails:  # llguidance has no `not`: what it leaves (or a non-empty subset), as an allOf item
            del out["not"]
            out["allOf"] = [*(out.get("allOf") or []), fails[0] if len(fails) == 1 else {"anyOf": fails}]
    out, needed = _spell_dependencies(out)
    closable = closable and names_only and isinstance(out.get("properties"), dict)
    closed = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if closable and not any(k in out for k in closed):
        required = out.get("required") if isinstance(out.get("required"), list) else []
        missing = [n for n in (*required, *needed) if isinstance(n, str) and n not in out["properties"]]
        if missing:  # a required (or depended-on) name not listed: any value, as before the closing
            out["properties"] = {**out["properties"], **{n: {} for n in missing}}
        out["additionalProperties"] = False
    return out


def _spell_dependencies(node: dict) -> tuple[dict, list]:
    """(``node`` with its dependency keywords as ``required`` names and ``allOf`` items, every name a
    dependency may demand). A required trigger's names become required and its schema an ``allOf`` item;
    an optional trigger's becomes ``anyOf: [trigger absent, trigger present and what it demands]``."""
    deps = [(k, node[k]) for k in _DEPENDENCY_KEYS if isinstance(node.get(k), dict)]
    if not deps:
        return node, []
    out = {k: v for k, v in node.items() if k not in dict(deps)}
    required = list(out["required"]) if isinstance(out.get("required"), list) else []
    items, needed = [], []
    for _, entries in deps:
        for trigger, need in entries.items():
            if isinstance(need, list):
                needed += need
                if trigger in required:
                    required += [n for n in need if n not in required]
                    continue
                then: dict = {"required": [trigger, *need]}
            elif need is True or need == {}:
                continue
            elif trigger in required:
                items.append(need)
                continue
            else:
                then = {"required": [trigger], "allOf": [need]}
            items.append({"anyOf": [{"properties": {trigger: False}}, then]})
    if required:
        out["required"] = required
    if items:
        out["allOf"] = [*(out.get("allOf") or []), *items]
    return out, needed


def _open_targets(root: dict) -> set:
    """ids of the subschemas a ``$ref`` reaches from a place where they meet other subschemas (an ``allOf``
    item, a ``$ref`` beside other keywords, a branch beside other keywords, a dependency's schema), and of
    the ``$ref`` targets of those (a chain of ``$ref``s): closing them would change what is valid."""
    from constrained.json_schema import _LIST_KEYS, _MAP_KEYS, _SCHEMA_KEYS
    from constrained.schema_facts import resolve_ref
    from constrained.schema_keywords import KEYWORDS

    found: dict[int, object] = {}
    stack: list[tuple[object, bool, int]] = [(root, False, 0)]
    while stack:
        node, shared, depth = stack.pop()
        if not isinstance(node, dict) or depth > 200:
            continue
        beside = set(node) & KEYWORDS
        ref = node.get("$ref")
        if isinstance(ref, str) and (shared or beside - {"$ref"}):
            target = resolve_ref(ref, root)
            if isinstance(target, dict) and id(target) not in found:
                found[id(target)] = target
                stack.append((target, True, depth + 1))  # its own $ref (a chain) meets the same
        for key, value in node.items():
            if key in ("dependencies", "dependentSchemas") and isinstance(value, dict):
                stack += [(v, True, depth + 1) for v in value.values()]
            elif key in _MAP_KEYS and isinstance(value, dict):
                stack += [(v, False, depth + 1) for v in value.values()]
            elif key in _LIST_KEYS and isinstance(value, list):
                intersected = key == "allOf" or (key in ("anyOf", "oneOf") and (shared or len(beside) > 1))
                stack += [(v, intersected, depth + 1) for v in value]
            elif key in _SCHEMA_KEYS:
                stack.append((value, False, depth + 1))
    return set(found)


def _error(kind: str, message: str) -> GrammarError:
    """llguidance's error as a GrammarError naming the problem; GrammarUnsupported for what the spec may
    validly say but llguidance cannot enforce (a keyword, a format): another backend may."""
    reason = _explain(kind, message)
    unsupported = "Unimplemented keys:" in message or "Unknown format:" in message
    return GrammarUnsupported(reason) if unsupported else GrammarError(reason)


def _explain(kind: str, message: str) -> str:
    """llguidance's error as a 400 reason that names the problem."""
    text = message.strip()
    if "Unimplemented keys:" in text:
        keys = text.split("Unimplemented keys:", 1)[1].split("]", 1)[0].strip(" [")
        names = ", ".join(k.strip(' "') for k in keys.split(",") if k.strip(' "'))
        return f"JSON Schema keyword(s) {names} cannot be enforced by the llguidance grammar backend"
    if "oneOf constraints are not supported" in text:
        return f"`oneOf` whose branches may overlap cannot be enforced exactly in this {kind}"
    if "Unknown format:" in text:
        name = text.split("Unknown format:", 1)[1].split("\n", 1)[0].strip()
        return f"format {name!r} cannot be enforced by the llguidance grammar backend"
    if len(text) > 600:
        text = text[:600] + " ..."
    return f"invalid {kind} (llguidance): {text}"


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    kinds = frozenset({"regex", "json_schema", "json_object", "lark"})
    package = "llguidance"

    def __init__(self):
        self._tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TokenVocabulary ->
        self._lock = threading.Lock()

    def prepare(self, vocab) -> None:
        import llguidance  # noqa: F401

        import constrained.json_schema  # noqa: F401

        if getattr(vocab, "token_bytes", None) is not None:  # a check-only worker has no vocabulary
            self.tokenizer(vocab)

    def tokenizer(self, vocab):
        """The LLTokenizer of a TokenVocabulary (memoized; ~0.2-0.7 s once). Built from the vocabulary's
        token bytes, so the worker and the scheduler see the same tokens; ids without bytes (special,
        unused) are special tokens, which no grammar allows unless it names them."""
        with self._lock:
            tok = self._tokenizers.get(vocab)
            if tok is None:
                tok = self._tokenizers[vocab] = _build_tokenizer(vocab)
            return tok

    def grammar_text(self, kind: str, spec: str, whitespace_pattern: str) -> str:
        """The llguidance grammar (its JSON form) of a spec; size limits checked. Raises GrammarError."""
        import llguidance

        from constrained.json_schema import strip_anchors
        from constrained.one_of import resolve_one_of
        from constrained.spec import MAX_REGEX_CHARS, check_size_limits

        if kind not in self.kinds:
            raise GrammarError(f"the llguidance grammar backend cannot compile a {kind} grammar")
        if kind != "json_object" and not isinstance(spec, str):
            raise GrammarError(f"{kind} spec must be a string, got {type(spec).__name__}")
        if kind == "regex":
            check_size_limits(kind, spec)
            if len(spec) > MAX_REGEX_CHARS:
                raise GrammarError(
                    f"regex is too long ({len(spec)} characters; the limit is {MAX_REGEX_CHARS})"
                )
            return llguidance.LLMatcher.grammar_from_regex(strip_anchors(spec))
        if kind == "lark":
            if len(spec) > MAX_LARK_CHARS:
                raise GrammarError(
                    f"lark is too long ({len(spec)} characters; the limit is {MAX_LARK_CHARS})"
                )
            if not spec.strip():
                raise GrammarError("lark grammar is empty")
            return llguidance.LLMatcher.grammar_from_lark(spec)
        if kind == "json_object":
            schema: object = {"type": "object"}
        else:
            check_size_limits(kind, spec)
            try:
                schema = json.loads(spec)
            except json.JSONDecodeError as err:
                raise GrammarError(f"json_schema is not valid JSON: {err}") from None
            except RecursionError:
                raise GrammarError("json_schema is nested too deeply") from None
            if schema is False:
                raise GrammarError("json_schema is `false`: no value is valid")
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise GrammarError("json_schema must be a JSON object (or true)")
            schema = _prepare_schema(resolve_one_of(schema))
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides=_json_options(whitespace_pattern)
            )
        except ValueError as err:
            raise _error(kind, str(err)) from None

    def _validate(self, kind: str, grammar: str, tokenizer) -> None:
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise _error(kind, messages[0] if messages else "rejected")

    def check(self, kind: str, spec: str, whitespace_pattern: str) -> str:
        grammar = self.grammar_text(kind, spec, whitespace_pattern)
        self._validate(kind, grammar, None)
        return grammar

    def build(self, kind: str, spec: str, whitespace_pattern: str, vocab) -> tuple[str, object]:
        """(grammar text, grammar text): validated against the tokenizer; the text is what crosses back."""
        grammar = self.grammar_text(kind, spec, whitespace_pattern)
        self._validate(kind, grammar, self.tokenizer(vocab))
        return grammar, grammar

    def load(self, kind, spec, text, payload, vocab, vocab_size, compile_seconds, nbytes):
        return LLGuidanceGrammar(
            kind, spec, payload, self.tokenizer(vocab), vocab, vocab_size, compile_seconds
        )


def _build_tokenizer(vocab):
    import llguidance

    from constrained.backends import text_tokenizer

    text = text_tokenizer(vocab)

    tokens: list[bytes] = []
    special: list[int] = []
    for tid, data in enumerate(vocab.token_bytes):
        if data is None:
            tokens.append(b"\xff<|special_%d|>" % tid)  # llguidance marks special tokens with a 0xFF byte
            special.append(tid)
        else:
            tokens.append(data)

    def split(data: bytes) -> array.array:
        # the real tokenizer when registered (the scheduler's), else (sandbox workers, which only
        # validate) a longest-match split of the bytes
        if text is not None:
            try:
                ids = list(text.encode(data.decode("utf-8"), add_special_tokens=False))
                if vocab.decode_bytes(ids) == data and all(vocab.token_bytes[i] for i in ids):
                    return array.array("i", ids)
            except (UnicodeDecodeError, IndexError, TypeError, ValueError):
                pass
        return array.array("i", vocab.encode_bytes_greedy(data))

    # llguidance calls back for every mask in a forced stretch (the last token's bytes + the forced
    # text), 20-60 µs of Python tokenizer each; the same texts recur in every request of a grammar
    memo_split = functools.lru_cache(maxsize=FORCED_MEMO_ENTRIES)(split)

    class _Tokens:  # what llguidance.TokenizerWrapper reads
        eos_token_id = vocab.eos_token_id
        bos_token_id = None
        special_token_ids = special

        def __init__(self):
            self.tokens = tokens

        def __call__(self, data: bytes) -> list[int]:
            # llguidance tokenizes forced text: in a forced stretch its mask offers only the first token
            # of that text's tokenization
            if isinstance(data, str):
                data = data.encode("utf-8")
            return (memo_split(data) if len(data) <= FORCED_MEMO_BYTES else split(data)).tolist()

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens()))


class LLGuidanceGrammar:
    """A validated llguidance grammar and a template matcher; ``new_matcher`` deep-copies the template."""

    backend = "llguidance"

    def __init__(self, kind, spec, grammar: str, tokenizer, vocab, vocab_size: int, compile_seconds: float):
        import llguidance

        self.kind, self.spec, self.grammar = kind, spec, grammar
        self.regex = grammar  # diagnostics, as CompiledGrammar.regex
        self.vocab = vocab
        self.vocab_size = vocab_size
        self.num_mask_ids = min(vocab.num_ids, vocab_size)
        self.compile_seconds = compile_seconds
        self._template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._template.is_error():
            raise _error(kind, self._template.get_error())
        self._words = (tokenizer.vocab_size + 31) // 32  # int32 words of llguidance's bitmask
        self._lock = threading.Lock()  # deep_copy reads the template: one at a time
        # the allowed ids before any token (read-only), the same for every request: llguidance takes
        # 50-100 µs per request for this first mask, once is enough
        self.start_bits: np.ndarray | None = self._start_mask()

    def _start_mask(self) -> np.ndarray | None:
        """The start mask, computed here, where the grammar is loaded (the compile job's completion thread,
        not the scheduler's step): a grammar's very first mask builds llguidance's lexer states for the
        start, 0.1-0.6 ms of CPU that the first request's first decode step paid before. A copy of the
        template computes it: its lexer is the template's (shared by every copy), so the states stay built,
        and the template's own state is untouched. None if llguidance errs (each request then meets the
        error in its own matcher)."""
        m = self._template.deep_copy()
        words = np.empty(self._words, dtype=np.int32)
        m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if m.is_error():
            return None
        return self._unpack(words, m.is_accepting(), shared=True)

    def _unpack(self, words: np.ndarray, accepting: bool, shared: bool = False) -> np.ndarray:
        """llguidance's bitmask as bools [num_mask_ids], EOS set exactly when the matcher accepts;
        ``shared``: read-only (the start mask, handed to every request)."""
        bits = np.unpackbits(words.view(np.uint8), count=self.num_mask_ids, bitorder="little").view(np.bool_)
        eos = self.vocab.eos_token_id
        if eos < self.num_mask_ids:
            bits[eos] = accepting
        if shared:
            bits.flags.writeable = False
        return bits

    def memory_bytes(self) -> int:
        """Rough: the grammar text plus a template matcher's parser and lexer state (lexer states are
        1-2 kB each, built lazily and bounded by llguidance's max_lexer_states)."""
        return MATCHER_BASE_BYTES + 4 * len(self.grammar) + self.num_mask_ids  # + start_bits

    def new_matcher(self) -> LLGuidanceMatcher:
        with self._lock:
            return LLGuidanceMatcher(self, self._template.deep_copy())


def _utf8_pending(pending: int, data: bytes) -> int:
    from constrained.grammar import _advance_utf8

    return _advance_utf8(pending, data)


class LLGuidanceMatcher(TokenCursor):
    """Per-request cursor over an llguidance LLMatcher (the contract of constrained.grammar.GrammarMatcher).
    Not thread-safe."""

    __slots__ = ("grammar", "_m", "_eos", "_ids", "_pending", "_words")

    def __init__(self, grammar: LLGuidanceGrammar, matcher):
        self.grammar = grammar
        self._m = matcher
        self._eos = False
        self._ids: list[int] = []
        self._pending: list[int] = [0]  # UTF-8 continuation bytes owed after each prefix of _ids
        self._words = np.empty(grammar._words, dtype=np.int32)

    @property
    def accepted_ids(self) -> list[int]:
        return list(self._ids)

    def _bits(self) -> np.ndarray:
        """Allowed ids as bools [num_mask_ids], EOS set exactly when the matcher accepts; read-only at the
        start (the grammar's shared ``start_bits``)."""
        g = self.grammar
        if not self._ids and g.start_bits is not None:
            return g.start_bits
        words = self._words
        self._m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        bits = g._unpack(words, self._m.is_accepting(), shared=not self._ids)
        if not self._ids:
            g.start_bits = bits  # one array, assigned whole: a racing request computes the same
        return bits

    def fill_vocab_mask(self, mask_row) -> None:
        """Set ``mask_row[i] = True`` for each allowed id. ``mask_row``: [vocab_size] bool, pre-zeroed."""
        g = self.grammar
        if self._eos:
            if g.vocab.eos_token_id < g.num_mask_ids:
                mask_row[g.vocab.eos_token_id] = True
            return
        bits = self._bits()
        n = g.num_mask_ids
        if mask_row.device.type == "cpu":
            np.copyto(mask_row[:n].numpy(), bits)
        else:
            import torch

            mask_row[:n].copy_(torch.from_numpy(bits if bits.flags.writeable else bits.copy()))

    def allowed_token_ids(self) -> np.ndarray:
        if self._eos:
            return np.array([self.grammar.vocab.eos_token_id])
        return np.flatnonzero(self._bits())

    def is_allowed(self, token_id: int) -> bool:
        if self._eos:
            return False
        if token_id == self.grammar.vocab.eos_token_id:
            return self._m.is_accepting()
        if not 0 <= token_id < self.grammar.num_mask_ids:
            return False
        return self._m.validate_tokens([token_id]) == 1

    def accept_token(self, token_id: int) -> None:
        """Advance over ``token_id``; raises GrammarError (state unchanged) if the grammar forbids it."""
        if self._eos:
            raise GrammarError(f"token {token_id} after the grammar was terminated by EOS")
        vocab = self.grammar.vocab
        if token_id == vocab.eos_token_id:
            if not self._m.is_accepting():
                raise GrammarError("EOS before the grammar's output is complete")
            self._eos = True
        else:
            # checked first: a rejected token would leave the llguidance matcher in its error state for good
            if not self.is_allowed(token_id) or not self._m.consume_token(token_id):
                raise GrammarError(f"token {token_id} is not allowed by the grammar here")
        self._ids.append(token_id)
        data = vocab.token_bytes[token_id] if token_id < vocab.num_ids else None
        self._pending.append(_utf8_pending(self._pending[-1], data or b""))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens <= 0:
            return
        if num_tokens > len(self._ids):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._ids)} tokens")
        n = num_tokens
        if self._eos:
            self._eos = False
            n -= 1
        if n and not self._m.rollback(n):
            raise ValueError(f"llguidance could not roll back {n} tokens: {self._m.get_error()}")
        keep = len(self._ids) - num_tokens
        del self._ids[keep:], self._pending[keep + 1 :]

    def can_finish(self) -> bool:
        return self._eos or self._m.is_accepting()

    def is_terminated(self) -> bool:
        """EOS was accepted, or nothing but EOS can follow."""
        return self._eos or self._m.is_stopped()

    def jump_forward_string(self) -> str | None:
        """llguidance's forced bytes from here (whole UTF-8 characters, at most MAX_JUMP_BYTES), or None;
        None as well mid-character and after EOS."""
        if self._eos or self._pending[-1]:
            return None
        data = self._m.compute_ff_bytes()[:MAX_JUMP_BYTES]
        end = len(data)
        while end > 0:
            try:
                return data[:end].decode("utf-8") or None
            except UnicodeDecodeError as err:
                end = err.start if err.start < end else end - 1
        return None


BACKEND = LLGuidanceBackend()
