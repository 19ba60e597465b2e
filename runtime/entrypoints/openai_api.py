"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Requests are translated into the native `SingleRequest` (one per choice, sharing the prompt's KV through
the radix cache) and answers back into OpenAI's objects, streaming included.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from runtime.entrypoints.generate_input import MAX_TIMEOUT_S, check_unicode
from runtime.entrypoints.http_common import (
    FastJSONResponse,
    run_unless_disconnected,
    sse,
)
from runtime.entrypoints.streaming import stream_response
from runtime.entrypoints.tool_calls import ToolPlan, ToolRequestError, plan_chat
from runtime.errors import RequestError
from runtime.managers.generate_request import SingleRequest
from runtime.managers.tokenizer_manager import TokenizerManager
from runtime.sampling_params import SamplingParams, check_token_budget
from runtime.server_args import ServerArgs

FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Common(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's plus radixlm's extras).

    Flags are StrictBool: lax mode would read "stream": "no" as True.
    """

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=64)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    # extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    regex: str | None = None
    json_schema: dict[str, Any] | str | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: StrictBool = False
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)  # seconds; shortens the server's
    # sglang-router (`--dp-size`) sends these with every request it forwards. Reasoning is never separated
    # (radixlm has no reasoning parser), so the two reasoning flags change nothing; hidden states only off.
    separate_reasoning: StrictBool = True
    stream_reasoning: StrictBool = True
    return_hidden_states: StrictBool = False

    @field_validator("return_hidden_states")
    @classmethod
    def _no_hidden_states(cls, v: bool) -> bool:
        if v:
            raise ValueError("return_hidden_states is not supported by radixlm (only false is accepted)")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    continue_final_message: StrictBool = False


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = None


def register_openai_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs) -> None:
    names = {args.model_name, args.model, "default"}

    def check_model(name: str) -> None:
        if name not in names:
            raise RequestError(
                f"the model '{name}' does not exist; this server serves '{args.model_name}'", 404
            )

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": args.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "radixlm",
                    "max_model_len": tm.context_length,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest):
        _check_unicode(body)
        check_model(body.model)
        if not body.messages:
            raise RequestError("'messages' must contain at least one message", 400)
        msgs = [
            {"role": m.role if m.role != "developer" else "system", "content": _content_text(m.content)}
            for m in body.messages
        ]
        # Bounds and admission before the template is rendered and the prompt tokenized.
        tm.check_prompt_chars(sum(len(m["content"]) for m in msgs))
        _check_bounds(tm, body, 1)
        # ---- tool calling (runtime/entrypoints/tool_calls): prompt, grammar, and later the message
        try:
            plan = await plan_chat(
                msgs,
                [m.model_extra or {} for m in body.messages],
                body,
                tm.tokenizer,
                args.tool_call_parser,
                tm.grammar_validator,
                args.grammar_backend,
            )
        except ToolRequestError as e:
            raise RequestError(str(e), 400) from None
        grammar = _grammar(body)
        if plan.grammar is not None:
            if grammar:
                raise RequestError("'tools' with a forced tool_choice cannot be combined with a grammar", 400)
            grammar = plan.grammar
        ids = (await tm.encode([plan.prompt], add_special_tokens=False))[0]
        # ---- end tool calling
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = _sampling_params(body, max_tokens, len(ids), tm.context_length, grammar)
        top = body.top_logprobs or 0
        req = _request(ids, params, body.logprobs or top > 0, top, body.stream, timeout_s=body.timeout)
        rid = "chatcmpl-" + req.rid
        if body.stream:
            return await stream_response(tm, [req], _ChatFormatter(rid, args.model_name, tm, body, plan))
        results = await run_unless_disconnected(request, tm.generate_all([req]))
        choices = []
        for i, r in enumerate(results):
            message = plan.message(r["text"])
            choice = {
                "index": i,
                "message": message,
                "finish_reason": _tool_finish(_finish(r), bool(message.get("tool_calls"))),
                "logprobs": None,
            }
            if body.logprobs:
                choice["logprobs"] = {"content": _chat_logprobs(tm, r["meta_info"])}
            choices.append(choice)
        return FastJSONResponse(
            {
                **_envelope(rid, "chat.completion", int(time.time()), args.model_name, choices),
                "usage": _usage(results),
            }
        )

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        _check_unicode(body)
        check_model(body.model)
        if body.suffix:
            raise RequestError("'suffix' is not supported", 400)
        if body.best_of not in (None, 1, body.n):
            raise RequestError("'best_of' other than n is not supported", 400)
        texts, id_lists = _completion_prompts(body.prompt)
        if body.stream and len(texts) + len(id_lists) > 1:
            raise RequestError("streaming supports a single prompt", 400)
        # Bounds and admission before tokenizing: a refused request costs no tokenizer time.
        tm.check_prompt_chars(sum(len(t) for t in texts))
        _check_bounds(tm, body, len(texts) + len(id_lists))
        prompts = await tm.encode(texts) if texts else id_lists
        top = body.logprobs
        rid = "cmpl-" + uuid.uuid4().hex
        # max_tokens is always set here (OpenAI's default is 16), so one SamplingParams serves every prompt.
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        params = _sampling_params(body, max_tokens, 0, tm.context_length, _grammar(body))
        # echo + logprobs scores the prompt too (the DSL's `select` over lang's OpenAI backend needs it)
        start = 0 if body.echo and top is not None else -1
        reqs = [
            _request(ids, params, top is not None, top or 0, body.stream, start, timeout_s=body.timeout)
            for ids in prompts
        ]
        echo_texts = [""] * len(prompts)
        if body.echo:
            echo_texts = await tm.run_in_tokenizer(lambda: [tm.tokenizer.decode(ids) for ids in prompts])
        if body.stream:
            fmt = _CompletionFormatter(rid, args.model_name, tm, body, echo_texts[0])
            return await stream_response(tm, reqs, fmt)
        every = await run_unless_disconnected(request, tm.generate_all(reqs))  # n per prompt, in order
        results_per_prompt = [every[p * body.n : (p + 1) * body.n] for p in range(len(reqs))]
        choices, flat = [], []
        for p, results in enumerate(results_per_prompt):
            for r in results:
                choice = {
                    "index": len(choices),
                    "text": echo_texts[p] + r["text"],
                    "finish_reason": _finish(r),
                    "logprobs": (
                        _completion_logprobs(tm, r["meta_info"], echo=body.echo) if top is not None else None
                    ),
                }
                choices.append(choice)
                flat.append(r)
        usage = _usage(flat)
        if len(results_per_prompt) > 1:  # several prompts: each prompt counts once
            usage["prompt_tokens"] = sum(rs[0]["meta_info"]["prompt_tokens"] for rs in results_per_prompt)
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return FastJSONResponse(
            {**_envelope(rid, "text_completion", int(time.time()), args.model_name, choices), "usage": usage}
        )


# ---- request translation ---------------------------------------------------------------------------------
def _check_unicode(body: BaseModel) -> None:
    try:
        check_unicode(body.model_dump(exclude_unset=True))
    except ValueError as e:
        raise RequestError(str(e), 400) from None


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError("only text content parts are supported", 400)
        parts.append(part["text"])
    return "".join(parts)


def _grammar(body: _Common) -> dict[str, Any]:
    fmt = getattr(body, "response_format", None)
    if body.regex is not None and (body.json_schema is not None or (fmt and fmt.type != "text")):
        raise RequestError("'regex' cannot be combined with a JSON schema or response_format", 400)
    if body.regex is not None:
        return {"regex": body.regex}
    schema = body.json_schema
    if fmt is not None and fmt.type == "json_object":
        schema = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema or {}
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON object", 400)
    if schema is None:
        return {}
    return {"json_schema": schema if isinstance(schema, str) else json.dumps(schema)}


def _sampling_params(
    body: _Common, max_tokens: int | None, prompt_len: int, context: int, grammar: dict[str, Any]
) -> SamplingParams:
    try:
        # Unset: the rest of the context. An explicit value is checked by the tokenizer manager, after the
        # range checks of SamplingParams (so an absurd max_tokens is named as such).
        if max_tokens is None:
            max_tokens = check_token_budget(prompt_len, None, context)
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            repetition_penalty=body.repetition_penalty,
            min_new_tokens=min(body.min_tokens, max_tokens),
            stop=body.stop or [],
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            skip_special_tokens=body.skip_special_tokens,
            no_stop_trim=body.no_stop_trim,
            seed=body.seed,
            n=body.n,
            **grammar,
        )
    except ValueError as e:
        raise RequestError(str(e), 400) from None


def _request(
    ids: list[int],
    params: SamplingParams,
    logprobs: bool,
    top: int,
    stream: bool,
    logprob_start_len: int = -1,
    timeout_s: float | None = None,
) -> SingleRequest:
    """One request for all n choices: the tokenizer manager expands it (`prepare_choices`)."""
    return SingleRequest(
        rid=uuid.uuid4().hex,
        text=None,
        input_ids=ids,
        params=params,
        stream=stream,
        return_logprob=logprobs,
        top_logprobs_num=top,
        return_text_in_logprobs=logprobs,
        logprob_start_len=logprob_start_len,
        timeout_s=timeout_s,
    )


def _completion_prompts(prompt) -> tuple[list[str], list[list[int]]]:
    """(texts to tokenize, token id lists): one of the two is empty."""
    if isinstance(prompt, str):
        return [prompt], []
    if not prompt:
        raise RequestError("'prompt' must not be empty", 400)
    if all(isinstance(p, str) for p in prompt):
        return list(prompt), []
    if all(isinstance(p, int) for p in prompt):
        return [], [list(prompt)]
    return [], [list(p) for p in prompt]


def _check_bounds(tm: TokenizerManager, body: _Common, num_prompts: int) -> None:
    """The request bounds the tokenizer manager checks again later, and admission, checked while the
    request is still cheap to refuse."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    tm.check_stop(stop)
    tm.check_prompt_count(num_prompts * body.n)
    tm.check_admission(num_prompts * body.n)


def _finish(result: dict[str, Any]) -> str:
    return FINISH.get((result["meta_info"].get("finish_reason") or {}).get("type"), "stop")


def _tool_finish(finish: str, has_calls: bool) -> str:
    """OpenAI reports a reply that ends in tool calls as "tool_calls" (a cut-off one stays "length")."""
    return "tool_calls" if has_calls and finish == "stop" else finish


def _usage(results: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = results[0]["meta_info"]["prompt_tokens"] if results else 0
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    cached = max((r["meta_info"]["cached_tokens"] for r in results), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_bytes(text: str | None) -> list[int] | None:
    return list(text.encode("utf-8")) if text is not None else None


def _chat_logprobs(tm: TokenizerManager, meta: dict[str, Any], start: int = 0) -> list[dict[str, Any]]:
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


def _completion_logprobs(
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


def _envelope(rid: str, object_name: str, created: int, model: str, choices: list) -> dict[str, Any]:
    """The fields every OpenAI completion body and stream chunk starts with."""
    return {"id": rid, "object": object_name, "created": created, "model": model, "choices": choices}


# ---- streaming (the loop is runtime.entrypoints.streaming; these say what each event looks like) ----------
class _OpenAIFormatter:
    """What chat and completion chunks share: the envelope, and usage as the last chunk when asked for."""

    object_name = ""

    def __init__(self, rid: str, model: str, tm: TokenizerManager, body: _Common):
        self.rid, self.model, self.tm = rid, model, tm
        self.created = int(time.time())
        self.usage = bool(body.stream_options and body.stream_options.include_usage)

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        c = _envelope(self.rid, self.object_name, self.created, self.model, choices)
        if self.usage:
            c["usage"] = usage
        return sse(c)

    def start(self, num_choices: int) -> list[bytes]:
        return []

    def end(self, finals: list[dict[str, Any]]) -> list[bytes]:
        return [self._chunk([], _usage(finals))] if self.usage else []


class _ChatFormatter(_OpenAIFormatter):
    object_name = "chat.completion.chunk"

    def __init__(
        self, rid: str, model: str, tm: TokenizerManager, body: ChatCompletionRequest, plan: ToolPlan
    ):
        super().__init__(rid, model, tm, body)
        self.logprobs = body.logprobs
        self.plan = plan
        self.tool_streams: dict[int, Any] = {}  # choice index -> the parser's stream state

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
            lp = {"content": _chat_logprobs(self.tm, out["meta_info"], logprob_start)}
        if self.plan.parses_calls:
            return self._tool_update(index, out, lp, finish)
        choice = {
            "index": index,
            "delta": {"content": text_delta} if text_delta else {},
            "logprobs": lp,
            "finish_reason": _finish(out) if finish else None,
        }
        return self._chunk([choice])

    def _tool_update(self, index: int, out: dict[str, Any], lp: Any, finish: Any) -> bytes | None:
        """Content and tool_calls deltas from the parser; several deltas go out as several SSE events."""
        ts = self.tool_streams.get(index)
        if ts is None:
            ts = self.tool_streams[index] = self.plan.stream()
        deltas = ts.feed(out["text"], bool(finish)) or ([{}] if finish else [])
        events = []
        for k, d in enumerate(deltas):
            last = finish and k == len(deltas) - 1
            choice = {
                "index": index,
                "delta": d,
                "logprobs": lp if k == 0 else None,
                "finish_reason": _tool_finish(_finish(out), ts.has_calls) if last else None,
            }
            events.append(self._chunk([choice]))
        return b"".join(events) or None


class _CompletionFormatter(_OpenAIFormatter):
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
            lp = _completion_logprobs(
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
            "finish_reason": _finish(out) if finish else None,
        }
        return self._chunk([choice])
