r"""A compiled grammar (shared) and the per-request cursor over it.

State is the outlines-core Index state: a state of the regex's byte-level DFA, reached by walking the bytes
of the accepted tokens. Masks and forced strings depend only on that state, so they are memoized on the
CompiledGrammar and shared by every request using it:

* mask: the allowed ids packed 8 per byte (6 KB per state at vocab 49152); a fill is one ``unpackbits`` and
  one copy into the caller's row. The first visit of a state pays ``Index.get_allowed_tokens`` (~1 ms for
  30k allowed tokens, ~µs for a handful).
* forced string (jump-forward): a state that cannot end and whose allowed tokens all start with the same
  byte ``b`` forces ``b``; its successor is the state after the single-byte token ``b``. Because the
  vocabulary has a token for (almost) every byte, "all allowed tokens start with b" is exactly "the DFA has
  one live next byte": SGLang's compressed-FSM rule, computed on the automaton that masks tokens, so no
  second regex engine can disagree with it.

End marker. outlines-core 0.2.14 builds its DFA with leftmost-first semantics and reports matches one byte
late, which loses transitions out of accepting states: in ``ab|abc`` nothing follows ``ab``, and in
``[0-9]+(\.[0-9]+)?`` no token starting with ``.`` follows ``12``. We compile ``(?:regex)<marker>`` instead
(``vocab.END_MARKER``, a private-use character held by a fake token) so that the only accepting states lie
after the marker; "EOS allowed" becomes "the marker token is allowed". Real tokens that would walk into the
marker (the few ending with its bytes) are filtered from masks and rejected by ``accept_token``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import outlines_core
import torch

from constrained.cursor import TokenCursor
from constrained.errors import GrammarError
from constrained.vocab import END_MARKER_REGEX, TokenVocabulary

MAX_JUMP_BYTES = 256  # longest forced string returned at once (a fixed-length pattern could force more)
MAX_CACHED_STATES = 8192  # per grammar: 8192 * 6 KB = 48 MB at vocab 49152; past it, masks are recomputed
INDEX_MEMORY_FACTOR = 3  # resident bytes of an Index per byte of its pickle (CompiledGrammar.memory_bytes)
_MARKER_LEN = 4  # bytes of the end marker: at most 3 states lie strictly inside it


def build_index(regex: str, vocab: TokenVocabulary) -> outlines_core.Index:
    """The outlines-core Index of ``regex`` followed by the end marker.
    Raises ValueError from outlines-core.
    """
    return outlines_core.Index(f"(?:{regex}){END_MARKER_REGEX}", vocab.outlines)


def _utf8_need(lead: int) -> int:
    """Continuation bytes that follow a UTF-8 lead byte (0 for ASCII; invalid leads count as 0)."""
    if lead >= 0xF0:
        return 3 if lead < 0xF8 else 0
    if lead >= 0xE0:
        return 2
    return 1 if lead >= 0xC0 else 0


def _advance_utf8(pending: int, data: bytes) -> int:
    """Continuation bytes still expected after ``data``, given ``pending`` before it."""
    for byte in data:
        if 0x80 <= byte < 0xC0:
            pending = max(pending - 1, 0)
        else:
            pending = _utf8_need(byte)
    return pending


class CompiledGrammar:
    """An outlines-core Index plus memoized per-state masks and forced strings. Thread-safe to share."""

    backend = "outlines"  # constrained.backends name

    def __init__(
        self,
        kind: str,
        spec: str,
        regex: str,
        index: outlines_core.Index,
        vocab: TokenVocabulary,
        vocab_size: int,
        compile_seconds: float = 0.0,
        index_bytes: int = 0,
    ):
        self.kind, self.spec, self.regex = kind, spec, regex
        self.index_bytes = index_bytes  # pickled size of the Index: its transition table, roughly
        self.index = index  # from build_index: regex + end marker
        self.vocab = vocab
        self.vocab_size = vocab_size  # model logits width; ids >= num_mask_ids are never allowed
        self.num_mask_ids = min(vocab.num_ids, vocab_size)
        self.compile_seconds = compile_seconds
        self.initial_state: int = index.get_initial_state()
        self._after_marker = frozenset(index.get_final_states())  # never reached by real tokens
        self._masks: dict[int, np.ndarray] = {}  # state -> packed bits [ceil(num_mask_ids / 8)] uint8
        self._counts: dict[int, int] = {}  # state -> allowed ids other than EOS
        self._forced: dict[int, str | None] = {}  # state -> forced string from that state
        self._inside_marker: dict[int, bool] = {}
        self._lock = threading.Lock()  # guards the memo dicts' size check, not the (idempotent) values

    def memory_bytes(self) -> int:
        """Estimated bytes held: the Index (``INDEX_MEMORY_FACTOR`` x its pickled size) plus memoized masks.

        The pickle is outlines-core's flat serialization of the transition table; its in-memory maps cost a
        few times more. Measured on the default model (vocab 49152, resident growth after compiling one):
        ``json_object`` 5.3 MB pickled, +24 MB; ``[a-z ]{0,300}`` 58 MB pickled, +165 MB.
        """
        mask_bytes = (self.num_mask_ids + 7) // 8
        return INDEX_MEMORY_FACTOR * self.index_bytes + len(self._masks) * mask_bytes + len(self.regex)

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self)

    def is_final(self, state: int) -> bool:
        """The text so far is a complete match: EOS may follow."""
        # the marker is also an ordinary character for broad classes (inside a JSON string, say): only a
        # marker that completes the match counts
        return self.index.get_next_state(state, self.vocab.end_marker_id) in self._after_marker

    def next_state(self, state: int, token_id: int) -> int | None:
        """State after a real token, or None if the grammar forbids it."""
        if not 0 <= token_id < self.vocab.num_ids:
            return None  # padding ids, the fake marker token, garbage
        nxt = self.index.get_next_state(state, token_id)
        if nxt is not None and self.vocab.marker_candidate[token_id] and self._leads_into_marker(nxt):
            return None
        return nxt

    def allowed_ids(self, state: int) -> np.ndarray:
        """Allowed token ids in ``state`` (EOS included in final states), ascending."""
        bits = np.unpackbits(self.packed_mask(state), count=self.num_mask_ids, bitorder="little")
        return np.flatnonzero(bits)

    def packed_mask(self, state: int) -> np.ndarray:
        """Allowed ids of ``state`` as bits, little-endian within each byte:
        [ceil(num_mask_ids / 8)] uint8.
        """
        packed = self._masks.get(state)
        if packed is None:
            packed, count = self._compute_mask(state)
            with self._lock:
                if len(self._masks) < MAX_CACHED_STATES:
                    self._masks[state] = packed
                    self._counts[state] = count
        return packed

    def num_allowed_non_eos(self, state: int) -> int:
        count = self._counts.get(state)
        if count is None:
            self.packed_mask(state)
            count = self._counts.get(state)
            if count is None:  # memo full
                count = self._compute_mask(state)[1]
        return count

    def _compute_mask(self, state: int) -> tuple[np.ndarray, int]:
        vocab = self.vocab
        ids = np.asarray(self.index.get_allowed_tokens(state) or [], dtype=np.int64)
        # drops the marker and outlines' own EOS (allowed only after the marker)
        ids = ids[(ids < self.num_mask_ids) & (ids != vocab.eos_token_id)]
        candidates = ids[vocab.marker_candidate[ids]]
        if len(candidates):
            into_marker = [t for t in candidates.tolist() if self.next_state(state, t) is None]
            ids = ids[~np.isin(ids, into_marker)]
        bits = np.zeros(self.num_mask_ids, dtype=np.uint8)
        bits[ids] = 1
        if self.is_final(state) and vocab.eos_token_id < self.num_mask_ids:
            bits[vocab.eos_token_id] = 1
        return np.packbits(bits, bitorder="little"), len(ids)

    def _leads_into_marker(self, state: int, depth: int = 0) -> bool:
        """Whether ``state`` is past or inside the end marker, with no way back into the regex."""
        if state in self._after_marker:
            return True
        if depth >= _MARKER_LEN or self.is_final(state):
            return False  # deeper than the marker, or a genuine end of the regex
        known = self._inside_marker.get(state)
        if known is not None:
            return known
        allowed = self.index.get_allowed_tokens(state) or []
        # inside the marker only tokens spelling a prefix of its remaining bytes are allowed: a handful
        result = len(allowed) <= 16
        for token_id in allowed if result else ():
            if token_id >= self.vocab.num_ids or token_id == self.vocab.eos_token_id:
                continue
            if not self._leads_into_marker(self.index.get_next_state(state, token_id), depth + 1):
                result = False
                break
        self._inside_marker[state] = result
        return result

    def forced_string(self, state: int) -> str | None:
        """The text every continuation from ``state`` starts with (whole UTF-8 characters), or None."""
        if state in self._forced:
            return self._forced[state]
        out = bytearray()
        cur: int | None = state
        seen = set()
        while cur is not None and len(out) < MAX_JUMP_BYTES and cur not in seen:
            seen.add(cur)
            step = self._forced_byte(cur)
            if step is None:
                break
            byte, cur = step
            out.append(byte)
        # keep whole characters only: a forced lead byte whose continuation is not forced is useless text
        end = len(out)
        while end > 0:
            try:
                text = out[:end].decode("utf-8")
                break
            except UnicodeDecodeError as err:
                end = err.start if err.start < end else end - 1
        else:
            text = ""
        result = text or None
        with self._lock:
            if len(self._forced) < MAX_CACHED_STATES:
                self._forced[state] = result
        return result

    def _forced_byte(self, state: int) -> tuple[int, int | None] | None:
        """(byte, next state) if ``state`` cannot end and every allowed token starts with one byte."""
        if self.is_final(state):
            return None
        if self.num_allowed_non_eos(state) > self.vocab.max_tokens_per_first_byte:
            return None
        ids = self.allowed_ids(state)
        if len(ids) == 0:
            return None
        first = self.vocab.first_byte[ids]
        byte = int(first[0])
        if byte < 0 or not (first == byte).all():
            return None
        single = self.vocab.byte_token_ids[byte]
        nxt = self.next_state(state, single) if single >= 0 else None
        return byte, nxt


class GrammarMatcher(TokenCursor):
    """Per-request cursor: the DFA state after the accepted tokens. Cheap to create, not thread-safe."""

    __slots__ = ("grammar", "_state", "_eos", "_pending", "_ids", "_history")

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self._state = grammar.initial_state
        self._eos = False  # EOS accepted: terminated
        self._pending = 0  # UTF-8 continuation bytes the output still owes (mid-character if > 0)
        self._ids: list[int] = []  # accepted token ids (EOS included)
        self._history: list[tuple[int, int]] = []  # (state, pending) before each accepted token

    @property
    def state(self) -> int:
        return self._state

    @property
    def accepted_ids(self) -> list[int]:
        return list(self._ids)

    def fill_vocab_mask(self, mask_row: torch.Tensor) -> None:
        """Set ``mask_row[i] = True`` for each allowed id. ``mask_row``: [vocab_size] bool, pre-zeroed."""
        g = self.grammar
        n = g.num_mask_ids
        if self._eos:
            if g.vocab.eos_token_id < n:
                mask_row[g.vocab.eos_token_id] = True
            return
        bits = np.unpackbits(g.packed_mask(self._state), count=n, bitorder="little").view(np.bool_)
        if mask_row.device.type == "cpu":
            np.copyto(mask_row[:n].numpy(), bits)  # numpy copy: no torch intra-op thread pool hop
        else:
            mask_row[:n].copy_(torch.from_numpy(bits), non_blocking=False)

    def allowed_token_ids(self) -> np.ndarray:
        if self._eos:
            return np.array([self.grammar.vocab.eos_token_id])
        return self.grammar.allowed_ids(self._state)

    def is_allowed(self, token_id: int) -> bool:
        if self._eos:
            return False
        if token_id == self.grammar.vocab.eos_token_id:
            return self.grammar.is_final(self._state)
        return self.grammar.next_state(self._state, token_id) is not None

    def accept_token(self, token_id: int) -> None:
        """Advance over ``token_id``; raises GrammarError (state unchanged) if the grammar forbids it."""
        g = self.grammar
        if self._eos:
            raise GrammarError(f"token {token_id} after the grammar was terminated by EOS")
        if token_id == g.vocab.eos_token_id:
            if not g.is_final(self._state):
                raise GrammarError("EOS before the grammar's output is complete")
            self._history.append((self._state, self._pending))
            self._ids.append(token_id)
            self._eos = True
            return
        nxt = g.next_state(self._state, token_id)
        if nxt is None:
            raise GrammarError(f"token {token_id} is not allowed by the grammar here")
        self._history.append((self._state, self._pending))
        self._ids.append(token_id)
        self._state = nxt
        self._pending = _advance_utf8(self._pending, g.vocab.token_bytes[token_id] or b"")

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens <= 0:
            return
        if num_tokens > len(self._ids):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._ids)} tokens")
        keep = len(self._ids) - num_tokens
        self._state, self._pending = self._history[keep]
        del self._ids[keep:], self._history[keep:]
        self._eos = False

    def can_finish(self) -> bool:
        """EOS is allowed now (the output so far is a complete match)."""
        return self._eos or self.grammar.is_final(self._state)

    def is_terminated(self) -> bool:
        """EOS was accepted, or nothing but EOS can follow (the caller may finish without sampling)."""
        return self._eos or self.grammar.num_allowed_non_eos(self._state) == 0

    def jump_forward_string(self) -> str | None:
        """Text the grammar forces next (no choice until its end), or None if nothing is forced.

        None as well mid-character (the last token ended inside a UTF-8 sequence) and after EOS.
        """
        if self._eos or self._pending:
            return None
        return self.grammar.forced_string(self._state)


def fill_vocab_masks(matchers: Sequence[GrammarMatcher | None], mask: torch.Tensor) -> None:
    """Fill a [batch, vocab_size] bool mask: grammar rows get their allowed ids, None rows allow
    everything.
    """
    for row, matcher in enumerate(matchers):
        if matcher is None:
            mask[row].fill_(True)
        else:
            mask[row].fill_(False)
            matcher.fill_vocab_mask(mask[row])


def apply_vocab_mask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """In place: ``logits[mask == False] = -inf``. logits [..., V], mask [..., V'] bool with V' <= V.

    Columns past the mask's width (padded logits) are disallowed too.
    """
    width = mask.shape[-1]
    mask = mask.to(logits.device, non_blocking=True)
    logits[..., :width].masked_fill_(~mask, float("-inf"))
    if logits.shape[-1] > width:
        logits[..., width:] = float("-inf")
