"""Native results -> OpenAI's objects: finish reasons, usage, logprobs, and the streamed chunks of chat and
completions (the streaming loop is `runtime.entrypoints.streaming`; these say what each event looks like)."""

from __future__ import annotations

import time
from typing import Any

from runtime.entrypoints.http_common import sse
from runtime.entrypoints.openai.protocol import ChatCompletionRequest, CommonRequest, CompletionRequest
from runtime.entrypoints.tool_calls import ToolPlan
from runtime.entrypoints.wire.reasoning import ReasoningParser
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager

FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


def finish_reason(result: dict[str, Any]) -> str:
    return FINISH.get((result["meta_info"].get("finish_reason") or {}).get("type"), "stop")


def tool_finish_reason(finish: str, has_calls: bool) -> str:
    """OpenAI reports a reply that ends in tool calls as "tool_calls" (a cut-off one stays "length")."""
    return "tool_calls" if has_calls and finish == "stop" else finish


def usage_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = results[0]["meta_info"]["prompt_tokens"] if results else 0
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    best = max(results, key=lambda r: r["meta_info"]["cached_tokens"], default=None)
    cached = best["meta_info"]["cached_tokens"] if best else 0
    by_tier = best["meta_info"].get("cached_tokens_by_tier") if best else None
    misses = [r["meta_info"]["cache_miss"] for r in results if r["meta_info"].get("cache_miss")]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # radixlm's extra: why a session's request found less cached than its previous request left
        "prompt_tokens_details": {
            "cached_tokens": cached,
            **({"cached_tokens_by_tier": by_tier} if by_tier else {}),
            **({"cache_miss": misses[0]} if misses else {}),
        },
    }


def _token_bytes(text: str | None) -> list[int] | None:
    return list(text.encode("utf-8")) if text is not None else None


def chat_logprobs(tm: TokenizerManager, meta: dict[str, Any], start: int = 0) -> list[dict[str, Any]]:
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [None] * len(entries)
    out = []
    for (lp, tid, text), top in list(zip(entries, tops))[start:]:
        text = text if text is not None else tm.tokenizer.decode([tid])
        out.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": _token_bytes(text),
                "top_logprobs": [
                    {"token": t, "logprob": tlp, "bytes": _token_bytes(t)} for tlp, _tid, t in (top or [])
                ],
            }
        )
    return out


def completion_logprobs(
    tm: TokenizerManager, meta: dict[str, Any], start: int = 0, echo: bool = False, offset: int = 0
) -> dict[str, Any]:
    """OpenAI's completion logprobs of the output from token `start`; with `echo`, of the prompt first (its
    first token's logprob is None, as OpenAI's). `text_offset` counts token texts from `offset` (a stream's
    later chunks continue where the previous ones ended)."""
    entries = (meta.get("output_token_logprobs") or [])[start:]
    tops = (meta.get("output_top_logprobs") or [None] * (start + len(entries)))[start:]
    if echo:
        prompt = meta.get("input_token_logprobs") or []
        entries = prompt + entries
        tops = (meta.get("input_top_logprobs") or [None] * len(prompt)) + tops
    tokens = [t if t is not None else tm.tokenizer.decode([tid]) for _lp, tid, t in entries]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _, _ in entries],
        "top_logprobs": [{t: tlp for tlp, _tid, t in (top or [])} for top in tops],
        "text_offset": offsets,
    }


def envelope(rid: str, object_name: str, created: int, model: str, choices: list) -> dict[str, Any]:
    """The fields every OpenAI completion body and stream chunk starts with."""
    return {"id": rid, "object": object_name, "created": created, "model": model, "choices": choices}


class OpenAIFormatter:
    """What chat and completion chunks share: the envelope, and usage as the last chunk when asked for."""

    object_name = ""

    def __init__(self, rid: str, model: str, tm: TokenizerManager, body: CommonRequest):
        self.rid, self.model, self.tm = rid, model, tm
        self.created = int(time.time())
        self.usage = bool(body.stream_options and body.stream_options.include_usage)

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        c = envelope(self.rid, self.object_name, self.created, self.model, choices)
        if self.usage:
            c["usage"] = usage
        return sse(c)

    def start(self, num_choices: int) -> list[bytes]:
        return []

    def end(self, finals: list[dict[str, Any]]) -> list[bytes]:
        return [self._chunk([], usage_of(finals))] if self.usage else []


class ChatFormatter(OpenAIFormatter):
    object_name = "chat.completion.chunk"

    def __init__(
        self,
        rid: str,
        model: str,
        tm: TokenizerManager,
        body: ChatCompletionRequest,
        plan: ToolPlan,
        reasoning: ReasoningParser | None = None,
    ):
        super().__init__(rid, model, tm, body)
        self.logprobs = body.logprobs
        self.plan = plan
        self.tool_streams: dict[int, Any] = {}  # choice index -> the parser's stream state
        self.reasoning = reasoning
        self.sent: dict[int, tuple[int, int]] = {}  # choice index -> (reasoning, answer) characters sent
        self.legacy = body.functions is not None  # the deprecated `functions`: answer in function_call too

    def start(self, num_choices: int) -> list[bytes]:
        role = {"role": "assistant", "content": ""}
        return [
            self._chunk(
                [
                    {"index": k, "delta": role, "logprobs": None, "finish_reason": None}
                    for k in range(num_choices)
                ]
            )
        ]

    def update(self, index: int, out: dict[str, Any], text_delta: str, logprob_start: int) -> bytes | None:
        finish = out["meta_info"]["finish_reason"]
        if not (text_delta or finish):
            return None
        lp = None
        if self.logprobs:
            lp = {"content": chat_logprobs(self.tm, out["meta_info"], logprob_start)}
        thoughts = b""
        if self.reasoning is not None:  # thoughts go out as reasoning_content; the rest reads the answer
            split = self.reasoning.split(out["text"], bool(finish))
            sent_r, sent_a = self.sent.get(index, (0, 0))
            if split.reasoning is not None and len(split.reasoning) > sent_r:
                delta = {"reasoning_content": split.reasoning[sent_r:]}
                thoughts = self._chunk(
                    [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}]
                )
                lp, sent_r = None, len(split.reasoning)
            out = {**out, "text": split.answer}
            text_delta = split.answer[sent_a:]
            self.sent[index] = (sent_r, len(split.answer))
            if not (text_delta or finish):
                return thoughts or None
        if self.plan.parses_calls:
            return thoughts + (self._tool_update(index, out, lp, finish) or b"") or None
            return self._tool_update(index, out, lp, finish)
        choice = {
            "index": index,
            "delta": {"content": text_delta} if text_delta else {},
            "logprobs": lp,
            "finish_reason": finish_reason(out) if finish else None,
        }
        return thoughts + self._chunk([choice])

    def _tool_update(self, index: int, out: dict[str, Any], lp: Any, finish: Any) -> bytes | None:
        """Content and tool_calls deltas from the parser; several deltas go out as several SSE events."""
        ts = self.tool_streams.get(index)
        if ts is None:
            ts = self.tool_streams[index] = self.plan.stream()
        deltas = ts.feed(out["text"], bool(finish)) or ([{}] if finish else [])
        if finish:
            self.tm.tool_calls_made(out["meta_info"], [name for name, _ in ts.sent])
        events = []
        for k, d in enumerate(deltas):
            last = finish and k == len(deltas) - 1
            reason = tool_finish_reason(finish_reason(out), ts.has_calls) if last else None
            if self.legacy and d.get("tool_calls"):  # one call at most (functions allow no parallel calls)
                fn = d["tool_calls"][0]["function"]
                d = {**d, "function_call": {f: v for f, v in fn.items() if f in ("name", "arguments")}}
            if self.legacy and reason == "tool_calls":
                reason = "function_call"
            choice = {"index": index, "delta": d, "logprobs": lp if k == 0 else None, "finish_reason": reason}
            events.append(self._chunk([choice]))
        return b"".join(events) or None


class CompletionFormatter(OpenAIFormatter):
    """With `echo`, a choice's first event carries the prompt text and, with `logprobs`, the prompt's
    logprobs, so the chunks concatenate to exactly the non-streamed choice (text, tokens, text_offset)."""

    object_name = "text_completion"

    def __init__(self, rid: str, model: str, tm: TokenizerManager, body: CompletionRequest, echo: str):
        super().__init__(rid, model, tm, body)
        self.logprobs = body.logprobs is not None
        self.echo = body.echo
        self.echo_text = echo  # prepended to each choice's first text
        self.started: set[int] = set()  # choices whose first event went out
        self.lp_chars: dict[int, int] = {}  # choice index -> characters of the token texts sent so far

    def update(self, index: int, out: dict[str, Any], text_delta: str, logprob_start: int) -> bytes | None:
        first = index not in self.started
        if first and self.echo:
            text_delta = self.echo_text + text_delta
        finish = out["meta_info"]["finish_reason"]
        if not (text_delta or finish or (first and self.echo)):
            return None
        lp = None
        if self.logprobs:
            lp = completion_logprobs(
                self.tm,
                out["meta_info"],
                logprob_start,
                echo=first and self.echo,
                offset=self.lp_chars.get(index, 0),
            )
            self.lp_chars[index] = self.lp_chars.get(index, 0) + sum(len(t) for t in lp["tokens"])
        self.started.add(index)
        choice = {
            "index": index,
            "text": text_delta,
            "logprobs": lp,
            "finish_reason": finish_reason(out) if finish else None,
        }
        return self._chunk([choice])
