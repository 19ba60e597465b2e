"""Turn a forced string into tokens: which generated tokens to keep and which to append.

Appending the forced text's own tokenization after the old tokens would leave a token boundary the
tokenizer never produces (``{"`` + ``name`` instead of ``{"name``), which the model has not seen and which
hurts quality. So the last few tokens are re-tokenized together with the forced text, and the caller
replaces them: it keeps ``output_ids[:keep]`` (their KV stays valid) and appends ``new_ids`` (to prefill).
"""

from __future__ import annotations

from constrained.vocab import TokenVocabulary, vocabulary_for

DEFAULT_LOOKBACK = 3  # tokens re-tokenized with the forced text; a BPE merge rarely spans more


def plan_jump_forward(
    tokenizer,
    output_ids: list[int],
    forced: str,
    *,
    vocab: TokenVocabulary | None = None,
    lookback: int = DEFAULT_LOOKBACK,
) -> tuple[int, list[int]]:
    """Return (keep, new_ids) with bytes(output_ids[:keep] + new_ids) == bytes(output_ids) + forced.

    ``vocab``: the tokenizer's TokenVocabulary (``GrammarCompiler.vocab``); when omitted, one is built on
    first use and memoized per tokenizer object (~0.5 s once).

    Tries re-tokenizing the last ``lookback`` tokens plus ``forced`` (starting at a token that begins a
    character and is not behind a special token), then fewer, then ``forced`` alone; the last resort is a
    greedy longest-match tokenization of ``forced``. Every candidate is verified byte-exact and free of
    special tokens, so the grammar accepts the result whenever it accepted ``output_ids`` + ``forced``: its
    automaton walks bytes, whatever the token boundaries. Re-tokenized ids that equal the old ones are not
    replaced (``keep`` moves past them): when the output so far is the tokenizer's own tokenization,
    ``new_ids`` is only the forced text's tokens.
    """
    n = len(output_ids)
    if not forced:
        return n, []
    if vocab is None:
        vocab = vocabulary_for(tokenizer)
    forced_bytes = forced.encode("utf-8")
    token_bytes = vocab.token_bytes
    first = max(0, n - lookback)
    for i in range(n - 1, first - 1, -1):  # never re-tokenize across a special (or unknown) token
        tid = output_ids[i]
        if not 0 <= tid < len(token_bytes) or token_bytes[tid] is None:
            first = i + 1
            break
    for start in range(first, n + 1):
        if start < n and 0x80 <= token_bytes[output_ids[start]][0] < 0xC0:
            continue  # starts mid-character: its text cannot be re-encoded alone
        tail = vocab.decode_bytes(output_ids[start:]) + forced_bytes
        try:
            text = tail.decode("utf-8")
        except UnicodeDecodeError:
            continue
        new_ids = _encode(tokenizer, text)
        if _is_exact(vocab, new_ids, tail):
            # tokens the re-tokenization leaves as they were stay (their KV too): when the model's own tokens
            # are the tokenizer's, only the forced text's tokens are appended
            same = 0
            while start + same < n and same < len(new_ids) and output_ids[start + same] == new_ids[same]:
                same += 1
            return start + same, new_ids[same:]
    return n, vocab.encode_bytes_greedy(forced_bytes)


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except Exception:  # a tokenizer that rejects odd text; the caller falls back
        return []


def _is_exact(vocab: TokenVocabulary, ids: list[int], expected: bytes) -> bool:
    parts = []
    for tid in ids:
        data = vocab.token_bytes[tid] if 0 <= tid < vocab.num_ids else None
        if data is None:  # special token (e.g. forced text spelling "<|im_end|>"): not a grammar token
            return False
        parts.append(data)
    return bool(ids) and b"".join(parts) == expected
