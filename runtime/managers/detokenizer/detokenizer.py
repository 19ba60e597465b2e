"""Detokenizer process: token ids -> incremental text, UTF-8 safe, stop strings, stop regexes and stop tokens
trimmed.

Per request it keeps the ids and the text already sent. New text is what the decoded ids add beyond the sent
text, held back while it ends in an incomplete UTF-8 sequence (U+FFFD) or could be the start of a stop string
or of a stop regex's match, so a stream never shows text that a later stop trim would take back. Decoding and
stop matching are incremental (runtime.managers.scheduler.stop_checker): a step's work does not grow with the
output.
"""

from __future__ import annotations

import logging
import signal
import traceback
from dataclasses import dataclass, field

import zmq

from runtime import ipc
from runtime.managers.scheduler.stop_checker import IncrementalText, RegexTail, StopMatcher, StopRegexTimeout
from runtime.messages import BatchStrOut, BatchTokenIDOut, ReqOutput, ReqTextOutput, decode
from runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class DecodeState:
    text: IncrementalText  # the committed text's decoding position
    ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # committed text, one piece per `text.marks` entry
    sent: int = 0  # characters already sent
    no_stop_trim: bool = False
    stops: list[str] = field(default_factory=list)  # trimmed stop strings (none with no_stop_trim)
    matcher: StopMatcher | None = None
    regexes: RegexTail | None = None  # trimmed stop regexes (none with no_stop_trim)
    cut: tuple[int, int] | None = None  # (start, end) of the first stop found: text ends there


class IncrementalDetokenizer:
    """Per step, work bounded by the new tokens and the stop strings' length: the new tokens are decoded
    with a few tokens of context, the stop matcher sees only the new characters, and only unsent text is
    sliced out of the committed pieces."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def _new_state(self, out: ReqOutput) -> DecodeState:
        skip, spaces = out.skip_special_tokens, out.spaces_between_special_tokens

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)

        stops = [] if out.no_stop_trim else list(out.stop_strings or [])
        regexes = None if out.no_stop_trim or not out.stop_regex else RegexTail(out.stop_regex)
        return DecodeState(
            text=IncrementalText(decode, track_marks=True),
            no_stop_trim=out.no_stop_trim,
            stops=stops,
            matcher=StopMatcher(stops) if stops else None,
            regexes=regexes,
        )

    def process(self, out: ReqOutput) -> ReqTextOutput:
        st = self.states.get(out.rid)
        if st is None:
            st = self.states[out.rid] = self._new_state(out)
        finished = out.finished_reason is not None
        new_ids = out.new_token_ids
        if _ends_on_stop_token(out) and not st.no_stop_trim:
            new_ids = new_ids[:-1]  # like a stop string, the matched stop token is not part of the text
        if out.replaced_tokens:
            self._rewind(st, len(st.ids) - out.replaced_tokens)
        st.ids.extend(new_ids)
        new = st.text.advance(st.ids, final=finished)
        if new:
            st.pieces.append(new)
            if st.matcher is not None and st.cut is None:
                hit = st.matcher.feed(new)
                if hit is not None:
                    st.cut = (hit[0], hit[0] + len(hit[1]))
            if st.regexes is not None and st.cut is None:
                self._feed_regexes(st, new)
        limit = st.text.chars
        if st.cut is not None:
            limit = st.cut[0]
        elif not finished:  # what could be the start of a stop string or a stop regex match: held back
            hold = st.matcher.overlap if st.matcher is not None else 0
            if st.regexes is not None:
                hold = max(hold, self._regex_overlap(st))
            limit -= hold
        delta = ""
        if limit > st.sent:
            delta = _text_from(st, st.sent)[: limit - st.sent]
            st.sent = limit
        if finished:
            del self.states[out.rid]
        return ReqTextOutput(
            rid=out.rid,
            text_delta=delta,
            new_token_ids=out.new_token_ids,
            replaced_tokens=out.replaced_tokens,
            finished_reason=out.finished_reason,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            cached_tokens_host=out.cached_tokens_host,
            cached_tokens_disk=out.cached_tokens_disk,
            cache_miss=out.cache_miss,
            spec=out.spec,
            input_token_logprobs=out.input_token_logprobs,
            output_token_logprobs=out.output_token_logprobs,
            error=out.error,
            error_status=out.error_status,
        )

    @staticmethod
    def _feed_regexes(st: DecodeState, new: str) -> None:
        try:
            hit = st.regexes.feed(new)
        except StopRegexTimeout as e:  # the scheduler ends such a request with a 400; text goes out as is
            logger.warning("%s; not trimming it", e)
            st.regexes = None
            return
        if hit is not None:
            st.cut = (hit[0], hit[1])

    @staticmethod
    def _regex_overlap(st: DecodeState) -> int:
        try:
            return st.regexes.overlap()
        except StopRegexTimeout as e:
            logger.warning("%s; not trimming it", e)
            st.regexes = None
            return 0

    @staticmethod
    def _rewind(st: DecodeState, kept_tokens: int) -> None:
        """Jump-forward rewrote the tokens from `kept_tokens` on. The text of the kept ones is unchanged, so
        decoding restarts at the last commit within them; text already sent stays sent."""
        del st.ids[kept_tokens:]
        kept = st.text.rewind(kept_tokens)
        del st.pieces[len(st.text.marks) :]
        if st.cut is not None and st.cut[1] <= kept:
            return
        st.cut = None
        if st.stops:  # the matcher restarts on the kept text's end, all a match could start in
            st.matcher = StopMatcher(st.stops)
            window = _text_from(st, max(0, kept - st.matcher.max_len + 1))
            st.matcher.fed = kept - len(window)
            st.matcher.feed(window)
        if st.regexes is not None:  # likewise, on the kept text's tail (a match in it was found before)
            regexes = st.regexes = RegexTail(st.regexes.patterns)
            regexes.fed, regexes.tail = kept, _text_from(st, max(0, kept - regexes.window))


def _text_from(st: DecodeState, pos: int) -> str:
    """Committed text from character `pos` on, joined from the last pieces only."""
    parts, start, i = [], st.text.chars, len(st.pieces) - 1
    while i >= 0 and start > pos:
        parts.append(st.pieces[i])
        start -= len(st.pieces[i])
        i -= 1
    return "".join(reversed(parts))[max(0, pos - start) :]


def _ends_on_stop_token(out: ReqOutput) -> bool:
    reason = out.finished_reason
    matched = reason.get("matched") if isinstance(reason, dict) else None
    return (
        isinstance(matched, int)
        and not isinstance(matched, bool)
        and bool(out.new_token_ids)
        and out.new_token_ids[-1] == matched
    )


def run_detokenizer_process(
    args: ServerArgs, model_dir: str, endpoints: ipc.IpcEndpoints, ready_conn
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s [detokenizer] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    try:
        from runtime.models.model_loader import load_tokenizer

        detok = IncrementalDetokenizer(load_tokenizer(model_dir))
        ctx = zmq.Context()
        recv_sock = ipc.socket(ctx, zmq.PULL, endpoints.detokenizer, bind=True)
        send_sock = ipc.socket(ctx, zmq.PUSH, endpoints.tokenizer, bind=False)
        ready_conn.send({"status": "ready"})
    except Exception as e:
        ready_conn.send(
            {"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        )
        return
    while True:
        msg = decode(recv_sock.recv())
        if isinstance(msg, BatchTokenIDOut):
            ipc.send(send_sock, BatchStrOut(outputs=[detok.process(o) for o in msg.outputs]))
