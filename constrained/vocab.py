"""Token id -> bytes for a HF tokenizer, and the outlines-core Vocabulary built from it.

Grammars run on bytes, so every token must be mapped to the exact bytes it appends to the output:

* byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): token strings spell bytes through GPT-2's printable
  byte->char table (``Ġ`` is a space), inverted here;
* SentencePiece (Llama 2, Mistral): ``▁`` is a space, ``<0x0A>`` is the raw byte 0x0A;
* anything else: the token string's UTF-8.

Special tokens (BOS, EOS, chat markers) get no bytes and are never allowed by a grammar.

The outlines-core vocabulary also holds one fake token past the real ids, the *end marker* (U+10F3CF, a
private-use character). Grammars compile ``(?:regex)<marker>`` and "EOS allowed" means "the marker token is
allowed": see ``constrained.grammar`` for why.
"""

from __future__ import annotations

import functools
import re
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import outlines_core

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
END_MARKER = "\U0010f3cf"  # plane-16 private use: absent from real text; UTF-8 F4 8F 8F 8F
END_MARKER_REGEX = r"\x{10F3CF}"
_END_MARKER_BYTES = END_MARKER.encode("utf-8")


@functools.cache
def _gpt2_char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to 256+n."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


@dataclass(frozen=True, eq=False)
class TokenVocabulary:
    """What grammars need to know about a tokenizer. Immutable; build once per tokenizer and share."""

    outlines: outlines_core.Vocabulary
    eos_token_id: int
    token_bytes: tuple[bytes | None, ...]  # [num_ids]; None for special or unused ids
    style: str  # "byte_level" | "sentencepiece" | "plain"
    special_ids: frozenset[int]
    first_byte: np.ndarray = field(repr=False)  # [num_ids] int16, -1 where the token has no bytes
    byte_token_ids: tuple[int, ...] = field(repr=False)  # [256] id of the single-byte token, -1 if none
    # [num_ids] bool: the token ends with a byte of the end marker, so it might walk into the marker
    marker_candidate: np.ndarray = field(repr=False)
    max_tokens_per_first_byte: int = 0  # a state with more allowed tokens cannot force one next byte

    @property
    def end_marker_id(self) -> int:
        """Id of the fake end-marker token in ``outlines`` (== num_ids: never a model logit)."""
        return len(self.token_bytes)

    @property
    def num_ids(self) -> int:
        return len(self.token_bytes)

    def decode_bytes(self, token_ids: list[int]) -> bytes:
        """Concatenated bytes of non-special tokens (special ones contribute nothing)."""
        tb = self.token_bytes
        return b"".join(tb[i] or b"" for i in token_ids if 0 <= i < len(tb))

    def encode_bytes_greedy(self, data: bytes) -> list[int]:
        """Longest-match tokenization of ``data``; exact bytes for every input when all 256 bytes have tokens.

        Not what the tokenizer would produce; jump-forward uses it only if re-tokenization does not
        round-trip.
        """
        index = self.bytes_to_id
        longest = self._longest_token
        ids, pos = [], 0
        while pos < len(data):
            for end in range(min(len(data), pos + longest), pos, -1):
                tid = index.get(data[pos:end])
                if tid is not None:
                    ids.append(tid)
                    pos = end
                    break
            else:
                raise ValueError(f"byte {data[pos]:#04x} has no token in this vocabulary")
        return ids

    @functools.cached_property
    def _longest_token(self) -> int:
        return max(map(len, self.bytes_to_id))

    @functools.cached_property
    def bytes_to_id(self) -> dict[bytes, int]:
        """Token bytes -> lowest id with those bytes (built on first use, ~20 ms)."""
        index: dict[bytes, int] = {}
        for tid, b in enumerate(self.token_bytes):
            if b and b not in index:
                index[b] = tid
        return index


def _tokenizer_style(tokenizer, vocab: dict[str, int]) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is not None:
        text = repr(decoder)  # e.g. "Sequence(decoders=[Replace(...), ByteFallback(), ...])"
        if "ByteLevel" in text:
            return "byte_level"
        if "ByteFallback" in text or "Metaspace" in text or "\u2581" in text:
            return "sentencepiece"
    # slow tokenizers or unusual decoders: look at the vocabulary itself
    sample = list(vocab)[:5000]
    if sum(t.startswith("\u2581") for t in sample) > len(sample) // 20:
        return "sentencepiece"
    if sum(t.startswith("Ġ") for t in sample) > len(sample) // 20:
        return "byte_level"
    return "plain"


def _token_to_bytes(token: str, style: str) -> bytes:
    if style == "byte_level":
        table = _gpt2_char_to_byte()
        try:
            return bytes(table[c] for c in token)
        except KeyError:  # not byte-level encoded (e.g. an added token): literal text
            return token.encode("utf-8")
    if style == "sentencepiece":
        m = _SP_BYTE.match(token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")
    return token.encode("utf-8")


def build_vocabulary(tokenizer) -> TokenVocabulary:
    """Build the grammar vocabulary of a HF tokenizer, offline. ~0.2 s for a 49k vocabulary."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer has no eos_token_id; grammars need one to end generation")
    vocab: dict[str, int] = tokenizer.get_vocab()
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    special_ids |= {i for i, tok in added.items() if getattr(tok, "special", False)}
    special_ids.add(eos)
    style = _tokenizer_style(tokenizer, vocab)
    num_ids = max(max(vocab.values()) + 1, len(tokenizer))

    token_bytes: list[bytes | None] = [None] * num_ids
    for token, tid in vocab.items():
        if tid in special_ids:
            continue
        if tid in added:  # added tokens are stored as plain text, not in the model's byte encoding
            data = added[tid].content.encode("utf-8")
        else:
            data = _token_to_bytes(token, style)
        token_bytes[tid] = data or None

    by_bytes: dict[bytes, list[int]] = {}
    for tid, data in enumerate(token_bytes):
        if data:
            by_bytes.setdefault(data, []).append(tid)
    first_byte = np.full(num_ids, -1, dtype=np.int16)
    byte_token_ids = [-1] * 256
    for tid, data in enumerate(token_bytes):
        if data:
            first_byte[tid] = data[0]
            if len(data) == 1 and byte_token_ids[data[0]] < 0:
                byte_token_ids[data[0]] = tid
    counts = np.bincount(first_byte[first_byte >= 0], minlength=256)
    marker_bytes = set(_END_MARKER_BYTES)
    marker_candidate = np.array([bool(b) and b[-1] in marker_bytes for b in token_bytes], dtype=np.bool_)
    by_bytes.setdefault(_END_MARKER_BYTES, []).append(num_ids)
    return TokenVocabulary(
        outlines=outlines_core.Vocabulary(eos, by_bytes),
        eos_token_id=eos,
        token_bytes=tuple(token_bytes),
        style=style,
        special_ids=frozenset(special_ids),
        first_byte=first_byte,
        byte_token_ids=tuple(byte_token_ids),
        marker_candidate=marker_candidate,
        max_tokens_per_first_byte=int(counts.max()) if counts.size else 0,
    )


_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_memo_lock = threading.Lock()


def vocabulary_for(tokenizer) -> TokenVocabulary:
    """``build_vocabulary`` memoized per tokenizer object (held weakly), for callers without a compiler."""
    with _memo_lock:
        vocab = _memo.get(tokenizer)
        if vocab is None:
            vocab = _memo[tokenizer] = build_vocabulary(tokenizer)
        return vocab
