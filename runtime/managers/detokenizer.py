"""Detokenizer process: token ids -> incremental text, UTF-8 safe, stop strings and stop tokens trimmed.

Per request it keeps the ids and the text already sent. New text is what the decoded ids add beyond the sent
text, held back while it ends in an incomplete UTF-8 sequence (U+FFFD) or could be the start of a stop string,
so a stream never shows text that a later stop-string trim would take back.
"""

from __future__ import annotations

import logging
import signal
import traceback
from dataclasses import dataclass, field

import zmq

from runtime import ipc
from runtime.messages import BatchStrOut, BatchTokenIDOut, ReqOutput, ReqTextOutput, decode
from runtime.server_args import ServerArgs

# After a jump-forward rewrite, restart incremental decoding this many tokens back.
SURROUNDING_TOKENS = 6


@dataclass
class DecodeState:
    ids: list[int] = field(default_factory=list)
    text: str = ""  # full decoded text so far (committed part)
    sent: int = 0  # characters of `text` already sent
    surr: int = 0  # ids[surr:read] decode to text[-len(surr_text):]
    read: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    no_stop_trim: bool = False


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def _decode(self, st: DecodeState, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=st.skip_special_tokens,
            spaces_between_special_tokens=st.spaces_between_special_tokens,
        )

    def process(self, out: ReqOutput) -> ReqTextOutput:
        st = self.states.get(out.rid)
        if st is None:
            st = self.states[out.rid] = DecodeState(
                skip_special_tokens=out.skip_special_tokens,
                spaces_between_special_tokens=out.spaces_between_special_tokens,
                stop=list(out.stop_strings or []),
                no_stop_trim=out.no_stop_trim,
            )
        new_ids = out.new_token_ids
        if _ends_on_stop_token(out) and not st.no_stop_trim:
            new_ids = new_ids[:-1]  # like a stop string, the matched stop token is not part of the text
        if out.replaced_tokens:
            # Jump-forward rewrote the tail; the decoded text of the kept prefix is unchanged, so rebuild the
            # text from scratch and keep what was already sent.
            del st.ids[len(st.ids) - out.replaced_tokens :]
            st.ids.extend(new_ids)
            st.text = self._decode(st, st.ids)
            st.read = len(st.ids)
            st.surr = max(0, st.read - SURROUNDING_TOKENS)
        else:
            st.ids.extend(new_ids)
            if len(st.ids) > st.read:
                prefix_text = self._decode(st, st.ids[st.surr : st.read])
                new_text = self._decode(st, st.ids[st.surr :])
                complete = not new_text.endswith("\ufffd") or out.finished_reason is not None
                if len(new_text) > len(prefix_text) and complete:
                    st.text += new_text[len(prefix_text) :]
                    st.surr, st.read = st.read, len(st.ids)
        finished = out.finished_reason is not None
        visible = st.text
        if st.stop and not st.no_stop_trim:
            cut = _first_stop(visible, st.stop)
            if cut is not None:
                visible = visible[:cut]
            elif not finished:
                visible = visible[: len(visible) - _stop_prefix_overlap(visible, st.stop)]
        delta = visible[st.sent :] if len(visible) > st.sent else ""
        st.sent = max(st.sent, len(visible))
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
            input_token_logprobs=out.input_token_logprobs,
            output_token_logprobs=out.output_token_logprobs,
            error=out.error,
            error_status=out.error_status,
        )


def _ends_on_stop_token(out: ReqOutput) -> bool:
    reason = out.finished_reason
    matched = reason.get("matched") if isinstance(reason, dict) else None
    return (
        isinstance(matched, int)
        and not isinstance(matched, bool)
        and bool(out.new_token_ids)
        and out.new_token_ids[-1] == matched
    )


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _stop_prefix_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


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
