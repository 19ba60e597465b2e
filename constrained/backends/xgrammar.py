"""xgrammar: JSON Schema / regex -> a pushdown automaton with a per-grammar adaptive token-mask cache.

Compiles in milliseconds where outlines-core's DFA needs seconds (bounded strings, nested formats), and its
masks are computed per step in C++ (a few µs for most states). Three things make it fit this project:

* vocabulary: the TokenizerInfo is built from ``TokenVocabulary.token_bytes`` (RAW bytes), not from the HF
  tokenizer, so every backend sees the same bytes per token and special tokens (no bytes) are never allowed.
  Its width is the tokenizer's (``num_ids``); ids past it (the model's padded logits) stay False.
* no silent keyword drops: xgrammar compiles ``anyOf``/``oneOf``/``allOf``/``$ref`` and ``enum``/``const``
  alone, ignoring the keywords beside them (enums are narrowed to the values that satisfy those keywords;
  the combinators are refused), and it relaxes some keywords without an error, a few with a C++ log warning
  (``oneOf`` whose branches may overlap becomes ``anyOf``, ``allOf`` of several schemas, ``multipleOf`` on
  numbers or with bounds, ``pattern`` beside ``minLength``/``maxLength``, look-ahead and mid-pattern anchors),
  others silently (``uniqueItems``, ``contains``, ``dependentRequired``/``dependentSchemas``, ``if``/``then``,
  ``not``, the formats it does not know). ``check`` rejects all of them with a GrammarError naming the
  keyword: the warnings are read from stderr around the conversion, the silent ones from a schema walk.
  These are ``GrammarUnsupported``: under ``--grammar-backend auto`` the next backend tries the spec.
* ``oneOf`` reaches xgrammar already rewritten by ``constrained.one_of`` (an exact ``anyOf``, or a 400 as on
  every backend), whose ``"properties": {key: false}`` (key absent) is dropped from ``properties`` here:
  xgrammar rejects ``false``, and in strict mode emits only the listed keys.
* control characters: bounded strings (``minLength``/``maxLength``) admit raw bytes 0x00-0x1F, which JSON
  forbids; with the json.dumps or compact layout no JSON output contains one, so tokens holding such a byte
  are masked out of every JSON grammar.

The compile runs in the capped worker (``build``) and comes back as ``CompiledGrammar.serialize_json()`` (a
JSON string, ~50-250 KB, with its token-mask cache), deserialized against the scheduler's TokenizerInfo.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import weakref

from constrained.backends import GrammarBackend
from constrained.cursor import TokenCursor
from constrained.errors import GrammarError, GrammarUnsupported

# Standard formats (JSON Schema 2020-12, 7.3) that xgrammar 0.2.9 treats as unknown (any string): a 400,
# as on outlines. Custom format names stay annotations, ignored as the specification says.
IGNORED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})
# Keywords xgrammar 0.2.9 drops without a word (measured: random walks through the compiled grammar fail
# `jsonschema` for each; tests/unit/test_constrained_xgrammar.py keeps them rejected).
_SILENTLY_DROPPED = ("contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas", "not")
# xgrammar's own warning -> the keyword it relaxed, for the 400
_WARNINGS = (
    ("oneOf with overlapping", "`oneOf` whose branches may overlap (xgrammar would enforce it as anyOf)"),
    ("allOf with multiple", "`allOf` of more than one schema"),
    ("multipleOf is not supported for type:number", "`multipleOf` on a number"),
    ("range + multipleOf", "`multipleOf` together with minimum/maximum"),
    ("combined with minLength/maxLength", "`minLength`/`maxLength` together with `pattern`"),
    ("Ignoring the length constraints", "`minLength`/`maxLength` on this string"),
    ("Lookahead", "look-ahead in a pattern"),
    ("in the middle of regex", "an anchor (^ or $) in the middle of a pattern"),
    ("URI should either be", "`$ref` outside this schema (only local `#/...` references)"),
)
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(?:Warning:\s*)?")
_SEPARATORS = {"json.dumps": (", ", ": "), "": (",", ":")}  # whitespace pattern -> xgrammar separators
_JSON_KINDS = ("json_schema", "json_object")


def _clean(message: str) -> str:
    """xgrammar's message without its log prefix (time, C++ file and line)."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(message).splitlines()]
    return " ".join(line for line in lines if line)[:500]


# ------------------------------------------------------------------------------------- schema strictness
def _subschemas(node: dict):
    """The subschemas directly under one schema node (by keyword, never by property name)."""
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        value = node.get(key)
        if isinstance(value, dict):
            yield from value.values()
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        yield from (v for v in deps.values() if isinstance(v, dict))
    for key in ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if",
                "then", "else", "unevaluatedProperties", "unevaluatedItems"):  # fmt: skip
        value = node.get(key)
        if isinstance(value, dict):
            yield value
        elif isinstance(value, list):
            yield from value
    for key in ("prefixItems", "allOf", "anyOf", "oneOf"):
        value = node.get(key)
        if isinstance(value, list):
            yield from value


_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref")


def _old_draft(schema) -> bool:
    """Drafts 4 to 7: keywords beside ``$ref`` are ignored by the specification itself."""
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    return isinstance(uri, str) and any(f"draft-0{n}" in uri for n in (4, 6, 7))


def narrow_enums(schema) -> None:
    """In place: an ``enum``/``const`` beside other keywords becomes the ``enum`` of its values that satisfy
    them (xgrammar emits any listed value and ignores the rest of the node). Exact: checked with
    ``jsonschema`` on the node without its enum. A node whose other keywords hold a ``$ref`` is left alone
    (``unenforced_keyword`` then rejects it). GrammarError when no value is left."""
    import jsonschema

    from constrained.schema_keywords import KEYWORDS

    validator_cls = jsonschema.validators.validator_for(schema) if isinstance(schema, dict) else None
    todo = [schema]
    while todo:
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        todo.extend(_subschemas(node))
        if "enum" not in node and "const" not in node:
            continue
        rest = {k: v for k, v in node.items() if k in KEYWORDS and k not in ("enum", "const")}
        if not rest or "$ref" in json.dumps(rest):
            continue
        values = [node["const"]] if "const" in node else node["enum"]
        if not isinstance(values, list):
            continue  # xgrammar's own error names it
        if "const" in node and "enum" in node:
            values = [v for v in values if v in node["enum"]]
        check = validator_cls(rest)
        kept = [v for v in values if check.is_valid(v)]
        if not kept:
            raise GrammarError("json_schema: no `enum`/`const` value satisfies the keywords beside it")
        for key in (*rest, "const"):
            node.pop(key, None)
        node["enum"] = kept


def drop_false_properties(node):
    """``node`` with each property whose schema accepts nothing (``false``, ``{"not": {}}``) left out of
    ``properties``, which xgrammar rejects: in strict mode an unlisted key is never emitted, the same
    meaning. GrammarUnsupported where other keys may appear (``additionalProperties``,
    ``patternProperties``), since the key could come back as one of them."""
    from constrained.schema_keywords import accepts_nothing

    if isinstance(node, list):
        return [drop_false_properties(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {k: drop_false_properties(v) for k, v in value.items()}
        elif key in _SCHEMA_VALUED:
            value = drop_false_properties(value)
        out[key] = value
    props = out.get("properties")
    if isinstance(props, dict) and any(accepts_nothing(v) for v in props.values()):
        if out.get("additionalProperties", False) is not False or out.get("patternProperties"):
            raise GrammarUnsupported(
                "json_schema: a property that must be absent beside `additionalProperties`/"
                "`patternProperties` cannot be enforced by the xgrammar backend"
            )
        out["properties"] = {k: v for k, v in props.items() if not accepts_nothing(v)}
    return out


# where drop_false_properties looks for subschemas: maps of them, and keywords holding one or a list
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SCHEMA_VALUED = frozenset(
    {
        "items",
        "additionalProperties",
        "additionalItems",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
        "unevaluatedProperties",
        "unevaluatedItems",
        "prefixItems",
        "allOf",
        "anyOf",
        "oneOf",
    }  # fmt: skip
)


def unenforced_keyword(schema) -> str | None:
    """The first keyword of ``schema`` xgrammar would drop without a warning, described; None if none."""
    from constrained.schema_keywords import KEYWORDS

    ref_siblings_ignored = _old_draft(schema)
    todo = [schema]
    while todo:
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        constraining = set(node) & KEYWORDS
        for key in _COMBINATORS:
            if key not in node or (key == "$ref" and ref_siblings_ignored):
                continue
            others = sorted(constraining - {key})
            if others:  # xgrammar compiles the combinator alone
                return f"`{key}` beside other keywords ({', '.join(others)})"
        if ("enum" in node or "const" in node) and constraining - {"enum", "const"}:
            return "`enum`/`const` beside other keywords with a `$ref`"
        for key in _SILENTLY_DROPPED:
            if key in node:
                return f"`{key}`"
        if node.get("uniqueItems") is True:
            return "`uniqueItems`"
        if "if" in node and ("then" in node or "else" in node):
            return "`if`/`then`/`else`"
        deps = node.get("dependencies")
        if isinstance(deps, dict) and deps:
            return "`dependencies`"
        if node.get("format") in IGNORED_FORMATS:
            return f"format {node['format']!r}"
        for key in ("$dynamicRef", "$recursiveRef"):
            if key in node:
                return f"`{key}`"
        todo.extend(_subschemas(node))
    return None


_stderr_lock = threading.Lock()


def _with_warnings(fn, *args, **kwargs):
    """(fn's result, xgrammar's warnings). xgrammar logs its relaxations to fd 2 from C++, so fd 2 is
    redirected to a file for the call (serialized by a lock; other output in that window is passed on)."""
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            result = fn(*args, **kwargs)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode("utf-8", "replace")
    warnings, other = [], []
    for line in text.splitlines():
        (warnings if "Warning:" in line else other).append(line)
    if other:
        print("\n".join(other), file=sys.stderr)
    return result, warnings


def _reject_warnings(kind: str, warnings: list[str]) -> None:
    for line in warnings:
        for marker, what in _WARNINGS:
            if marker in line:
                raise GrammarUnsupported(f"{kind}: {what} cannot be enforced by the xgrammar backend")
        raise GrammarUnsupported(f"{kind}: the xgrammar backend would relax the grammar: {_clean(line)}")


# ------------------------------------------------------------------------------------- backend
class XGrammarBackend(GrammarBackend):
    name = "xgrammar"
    kinds = frozenset({"regex", "json_schema", "json_object"})  # not lark: llguidance's dialect
    package = "xgrammar"

    def prepare(self, vocab) -> None:
        """Worker start-up, before its memory cap: xgrammar's imports (torch, transformers: ~3 s, ~600 MB of
        address space) and the TokenizerInfo."""
        import xgrammar  # noqa: F401

        if vocab is not None:
            tokenizer_info(vocab)

    def check(self, kind: str, spec: str, whitespace_pattern: str) -> str:
        """The grammar xgrammar would compile, as EBNF text. Raises GrammarError (400) naming the problem."""
        return str(self._grammar(kind, spec, whitespace_pattern))

    def build(self, kind: str, spec: str, whitespace_pattern: str, vocab) -> tuple[str, object]:
        """(EBNF text, ``CompiledGrammar.serialize_json()``): a str, cheap to pickle across the pipe."""
        grammar = self._grammar(kind, spec, whitespace_pattern)
        try:
            compiled = _compiler(vocab).compile_grammar(grammar)
        except RuntimeError as err:
            raise GrammarError(f"cannot compile {kind} for this tokenizer: {_clean(err)}") from None
        return str(grammar), compiled.serialize_json()

    def load(self, kind, spec, text, payload, vocab, vocab_size, compile_seconds, nbytes):
        import xgrammar as xgr

        if not isinstance(payload, str):  # an in-process build may hand the object itself
            payload = payload.serialize_json()
        compiled = xgr.CompiledGrammar.deserialize_json(payload, tokenizer_info(vocab))
        return XGrammarCompiled(kind, spec, text, compiled, vocab, vocab_size, compile_seconds)

    def _grammar(self, kind: str, spec, whitespace_pattern: str):
        import xgrammar as xgr

        from constrained.json_schema import strip_anchors
        from constrained.one_of import resolve_one_of
        from constrained.spec import GRAMMAR_KINDS, check_size_limits

        if kind not in GRAMMAR_KINDS:
            raise GrammarUnsupported(f"the xgrammar backend cannot compile a {kind!r} grammar")
        if kind == "json_schema" and isinstance(spec, (dict, bool)):
            spec = json.dumps(spec)
        if kind != "json_object" and not isinstance(spec, str):
            raise GrammarError(f"{kind} spec must be a string, got {type(spec).__name__}")
        separators = _SEPARATORS.get(whitespace_pattern)
        if kind in _JSON_KINDS and separators is None:
            raise GrammarUnsupported(
                f"the xgrammar backend supports only the json.dumps and compact JSON layouts, not the "
                f"whitespace pattern {whitespace_pattern!r}"
            )
        if kind == "regex":
            check_size_limits(kind, spec)
            convert, args, kwargs = xgr.Grammar.from_regex, (strip_anchors(spec),), {}
        else:
            if kind == "json_object":
                schema = {"type": "object"}
            else:
                check_size_limits(kind, spec)
                try:
                    schema = json.loads(spec)
                except json.JSONDecodeError as err:
                    raise GrammarError(f"json_schema is not valid JSON: {err}") from None
                except RecursionError:
                    raise GrammarError("json_schema is nested too deeply") from None
                if not isinstance(schema, (dict, bool)):
                    got = type(schema).__name__
                    raise GrammarError(f"json_schema must be an object or a boolean, got {got}")
                schema = drop_false_properties(resolve_one_of(schema))
                narrow_enums(schema)
                dropped = unenforced_keyword(schema)
                if dropped:
                    what = f"json_schema: {dropped} cannot be enforced by the xgrammar backend"
                    raise GrammarUnsupported(what)
            convert = xgr.Grammar.from_json_schema
            args = (json.dumps(schema),)
            kwargs = dict(any_whitespace=False, separators=separators, strict_mode=True)
        try:
            grammar, warnings = _with_warnings(convert, *args, **kwargs)
        except (RuntimeError, ValueError) as err:  # xgrammar's InvalidJSONError is a RuntimeError too
            message = f"{kind} rejected by the xgrammar backend: {_clean(err)}"
            # "... is not supported (yet)": a construct another backend may express; else the spec is bad
            raise (GrammarUnsupported if "not supported" in message else GrammarError)(message) from None
        except RecursionError:
            raise GrammarError(f"{kind} is nested too deeply to compile") from None
        _reject_warnings(kind, warnings)
        return grammar


BACKEND = XGrammarBackend()


# ------------------------------------------------------------------------------------- vocabulary
_infos: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_control_words: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_vocab_lock = threading.Lock()


def tokenizer_info(vocab):
    """The xgrammar TokenizerInfo of a ``TokenVocabulary`` (memoized per vocabulary; ~20 ms once)."""
    with _vocab_lock:
        info = _infos.get(vocab)
        if info is None:
            import xgrammar as xgr

            encoded = [b or b"" for b in vocab.token_bytes]  # no bytes: special, never allowed
            info = xgr.TokenizerInfo(
                encoded, xgr.VocabType.RAW, vocab_size=vocab.num_ids, stop_token_ids=[vocab.eos_token_id]
            )
            _infos[vocab] = info
        return info


def _compiler(vocab):
    info = tokenizer_info(vocab)
    with _vocab_lock:
        compiler = _compilers.get(vocab)
        if compiler is None:
            import xgrammar as xgr

            # one thread: a worker process is one compile; its own cache would hold every grammar twice
            compiler = _compilers[vocab] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return compiler


def _json_token_words(vocab):
    """int32 words, bit i set unless token i holds a raw control byte (< 0x20): ANDed into JSON masks."""
    import numpy as np

    with _vocab_lock:
        words = _control_words.get(vocab)
        if words is None:
            ok = np.array([not b or min(b) >= 0x20 for b in vocab.token_bytes], dtype=np.bool_)
            packed = np.packbits(ok, bitorder="little")
            padded = np.zeros(((vocab.num_ids + 31) // 32) * 4, dtype=np.uint8)
            padded[: len(packed)] = packed
            words = _control_words[vocab] = padded.view("<i4").copy()
        return words


# ------------------------------------------------------------------------------------- grammar and cursor
class XGrammarCompiled:
    """A compiled xgrammar grammar (immutable, thread-safe to share) and its TokenizerInfo."""

    backend = "xgrammar"

    def __init__(self, kind, spec, text, compiled, vocab, vocab_size, compile_seconds=0.0):
        self.kind, self.spec, self.text = kind, spec, text
        self.compiled = compiled
        self.vocab = vocab
        self.vocab_size = vocab_size
        self.num_mask_ids = min(vocab.num_ids, vocab_size)
        self.num_words = (vocab.num_ids + 31) // 32
        self.compile_seconds = compile_seconds
        self.token_words = _json_token_words(vocab) if kind in _JSON_KINDS else None

    def memory_bytes(self) -> int:
        """xgrammar's own estimate of the grammar and its token-mask cache, plus the spec."""
        return int(self.compiled.memory_size_bytes) + len(self.spec) + len(self.text)

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self)


class XGrammarMatcher(TokenCursor):
    """Per-request cursor over an xgrammar GrammarMatcher. The bitmask of the current state is filled once
    per step and reused by ``fill_vocab_mask``, ``is_allowed``, ``accept_token``. Not thread-safe."""

    __slots__ = ("grammar", "_m", "_ids", "_bitmask", "_words", "_fresh")

    def __init__(self, grammar: XGrammarCompiled):
        import torch
        import xgrammar as xgr

        self.grammar = grammar
        self._m = xgr.GrammarMatcher(grammar.compiled)
        self._ids: list[int] = []
        self._bitmask = torch.zeros((1, grammar.num_words), dtype=torch.int32)  # xgrammar fills it
        self._words = self._bitmask.numpy()[0]  # a view: [num_words] int32, bit i of word j = id 32 j + i
        self._fresh = False

    @property
    def accepted_ids(self) -> list[int]:
        return list(self._ids)

    def _mask(self):
        if not self._fresh:
            if self._m.is_terminated():
                self._words[:] = 0
            else:
                self._m.fill_next_token_bitmask(self._bitmask)
                if self.grammar.token_words is not None:
                    self._words &= self.grammar.token_words
            self._fresh = True
        return self._words

    def _bits(self):
        import numpy as np

        n = self.grammar.num_mask_ids
        return np.unpackbits(self._mask().view(np.uint8), count=n, bitorder="little").view(np.bool_)

    def fill_vocab_mask(self, mask_row) -> None:
        """Set ``mask_row[i] = True`` for each allowed id. ``mask_row``: [vocab_size] bool, pre-zeroed."""
        import numpy as np
        import torch

        n = self.grammar.num_mask_ids
        if self._m.is_terminated():
            eos = self.grammar.vocab.eos_token_id
            if eos < n:
                mask_row[eos] = True
            return
        bits = self._bits()
        if mask_row.device.type == "cpu":
            np.copyto(mask_row[:n].numpy(), bits)
        else:
            mask_row[:n].copy_(torch.from_numpy(bits), non_blocking=False)

    def allowed_token_ids(self):
        import numpy as np

        if self._m.is_terminated():
            return np.array([self.grammar.vocab.eos_token_id])
        return np.flatnonzero(self._bits())

    def is_allowed(self, token_id: int) -> bool:
        if not 0 <= token_id < self.grammar.num_mask_ids or self._m.is_terminated():
            return False
        return bool((int(self._mask()[token_id >> 5]) >> (token_id & 31)) & 1)

    def accept_token(self, token_id: int) -> None:
        """Advance over ``token_id``; raises GrammarError (state unchanged) if the grammar forbids it."""
        if self._m.is_terminated():
            raise GrammarError(f"token {token_id} after the grammar was terminated by EOS")
        if not self.is_allowed(token_id):
            if token_id == self.grammar.vocab.eos_token_id:
                raise GrammarError("EOS before the grammar's output is complete")
            raise GrammarError(f"token {token_id} is not allowed by the grammar here")
        if not self._m.accept_token(token_id):  # the mask said yes: xgrammar disagreeing is a bug
            raise GrammarError(f"token {token_id} was rejected by the xgrammar matcher")
        self._ids.append(token_id)
        self._fresh = False

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (EOS included)."""
        if num_tokens <= 0:
            return
        if num_tokens > len(self._ids):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._ids)} tokens")
        self._m.rollback(num_tokens)
        del self._ids[len(self._ids) - num_tokens :]
        self._fresh = False

    def can_finish(self) -> bool:
        """EOS is allowed now (the output so far is a complete match), or was accepted."""
        return self._m.is_terminated() or self._m.is_completed()

    def is_terminated(self) -> bool:
        """EOS was accepted, or nothing but EOS can follow."""
        if self._m.is_terminated():
            return True
        if not self._m.is_completed():
            return False
        words = self._mask()
        eos = self.grammar.vocab.eos_token_id
        nonzero = words.nonzero()[0]
        return len(nonzero) == 1 and nonzero[0] == eos >> 5 and int(words[eos >> 5]) == _bit(eos & 31)

    def jump_forward_string(self) -> str | None:
        """Text the grammar forces next (whole UTF-8 characters), or None (also after EOS)."""
        if self._m.is_terminated():
            return None
        return self._m.find_jump_forward_string() or None


def _bit(i: int) -> int:
    """int32 value of a word with only bit ``i`` set (bit 31 is the sign)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)
