"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Requests are translated into the native `SingleRequest` (one per choice, sharing the prompt's KV through
the radix cache) and answers back into OpenAI's objects, streaming included.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from runtime.entrypoints.generate_input import check_unicode
from runtime.entrypoints.http_common import (
    SSE_DONE,
    FastJSONResponse,
    run_unless_disconnected,
    sse,
    sse_stream,
)
from runtime.errors import RequestError
from runtime.managers.generate_request import SingleRequest
from runtime.managers.tokenizer_manager import TokenizerManager, gather_or_cancel
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
        if body.tools:
            raise RequestError(
                "tool calling is not supported; describe tools in the system prompt instead", 400
            )
        msgs = [
            {"role": m.role if m.role != "developer" else "system", "content": _content_text(m.content)}
            for m in body.messages
        ]
        try:
            prompt = tm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # template errors are the request's fault (e.g. role order)
            raise RequestError(f"cannot apply the chat template: {e}", 400) from None
        ids = tm.tokenizer.encode(prompt, add_special_tokens=False)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = _sampling_params(body, max_tokens, len(ids), tm.context_length, _grammar(body))
        top = body.top_logprobs or 0
        reqs = _requests(ids, params, body.logprobs or top > 0, top, body.stream)
        rid = "chatcmpl-" + reqs[0].rid
        if body.stream:
            return await _stream_response(tm, reqs, _chat_chunks(rid, args.model_name, reqs, tm, body))
        results = await run_unless_disconnected(request, _run_choices(tm, reqs))
        choices = []
        for i, r in enumerate(results):
            choice = {
                "index": i,
                "message": {"role": "assistant", "content": r["text"]},
                "finish_reason": _finish(r),
                "logprobs": None,
            }
            if body.logprobs:
                choice["logprobs"] = {"content": _chat_logprobs(tm, r["meta_info"])}
            choices.append(choice)
        return FastJSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": args.model_name,
                "choices": choices,
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
        prompts = _completion_prompts(tm, body.prompt)
        if body.stream and len(prompts) > 1:
            raise RequestError("streaming supports a single prompt", 400)
        top = body.logprobs
        rid = "cmpl-" + uuid.uuid4().hex
        all_reqs, echo_texts = [], []
        for ids in prompts:
            params = _sampling_params(
                body,
                body.max_tokens if body.max_tokens is not None else 16,
                len(ids),
                tm.context_length,
                _grammar(body),
            )
            all_reqs.append(_requests(ids, params, top is not None, top or 0, body.stream))
            echo_texts.append(tm.tokenizer.decode(ids) if body.echo else "")
        if body.stream:
            return await _stream_response(
                tm,
                all_reqs[0],
                _completion_chunks(rid, args.model_name, all_reqs[0], tm, body, echo_texts[0]),
            )
        results_per_prompt = await run_unless_disconnected(
            request, gather_or_cancel(*(_run_choices(tm, reqs) for reqs in all_reqs))
        )
        choices, flat = [], []
        for p, results in enumerate(results_per_prompt):
            for r in results:
                choice = {
                    "index": len(choices),
                    "text": echo_texts[p] + r["text"],
                    "finish_reason": _finish(r),
                    "logprobs": _completion_logprobs(tm, r["meta_info"]) if top is not None else None,
                }
                choices.append(choice)
                flat.append(r)
        usage = _usage(flat)
        if len(results_per_prompt) > 1:  # several prompts: each prompt counts once
            usage["prompt_tokens"] = sum(rs[0]["meta_info"]["prompt_tokens"] for rs in results_per_prompt)
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return FastJSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": args.model_name,
                "choices": choices,
                "usage": usage,
            }
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
            seed=body.seed,
            n=body.n,
            **grammar,
        )
    except ValueError as e:
        raise RequestError(str(e), 400) from None


def _requests(
    ids: list[int], params: SamplingParams, logprobs: bool, top: int, stream: bool
) -> list[SingleRequest]:
    base = SingleRequest(
        rid=uuid.uuid4().hex,
        text=None,
        input_ids=ids,
        params=params,
        stream=stream,
        return_logprob=logprobs,
        top_logprobs_num=top,
        return_text_in_logprobs=logprobs,
    )
    return TokenizerManager.expand_n([base])


def _completion_prompts(tm: TokenizerManager, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tm.tokenizer.encode(prompt)]
    if not prompt:
        raise RequestError("'prompt' must not be empty", 400)
    if all(isinstance(p, str) for p in prompt):
        return [tm.tokenizer.encode(p) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [list(p) for p in prompt]


async def _run_choices(tm: TokenizerManager, reqs: list[SingleRequest]) -> list[dict[str, Any]]:
    tm.check_admission(len(reqs))
    if len(reqs) > 1:  # prefill the shared prompt once so the n choices hit the radix cache
        await tm.final(tm.prefill_only(reqs[0]))
    return await gather_or_cancel(*(tm.final(r) for r in reqs))


def _finish(result: dict[str, Any]) -> str:
    return FINISH.get((result["meta_info"].get("finish_reason") or {}).get("type"), "stop")


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


def _completion_logprobs(tm: TokenizerManager, meta: dict[str, Any], start: int = 0) -> dict[str, Any]:
    entries = (meta.get("output_token_logprobs") or [])[start:]
    tops = (meta.get("output_top_logprobs") or [None] * (start + len(entries)))[start:]
    tokens = [t if t is not None else tm.tokenizer.decode([tid]) for _lp, tid, t in entries]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _, _ in entries],
        "top_logprobs": [{t: tlp for tlp, _tid, t in (top or [])} for top in tops],
        "text_offset": offsets,
    }


# ---- streaming -------------------------------------------------------------------------------------------
async def _merge(
    tm: TokenizerManager, reqs: list[SingleRequest]
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Interleave the cumulative outputs of several streams as (choice index, output)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, req: SingleRequest):
        try:
            async for out in tm.generate(req):
                await queue.put((i, out))
        except BaseException as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    if len(reqs) > 1:
        await tm.final(tm.prefill_only(reqs[0]))
    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    remaining = len(reqs)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _stream_response(tm: TokenizerManager, reqs: list[SingleRequest], chunks: AsyncIterator[bytes]):
    tm.check_admission(len(reqs))
    first = None
    try:
        first = await chunks.__anext__()  # surfaces validation errors as 4xx before the stream starts
    except StopAsyncIteration:
        pass

    async def body():
        try:
            if first is not None:
                yield first
                async for c in chunks:
                    yield c
        finally:
            await chunks.aclose()

    return StreamingResponse(sse_stream(body()), media_type="text/event-stream")


async def _chat_chunks(rid, model, reqs, tm, body: ChatCompletionRequest) -> AsyncIterator[bytes]:
    created = int(time.time())
    sent_text = [0] * len(reqs)
    sent_lp = [0] * len(reqs)
    finals: dict[int, dict[str, Any]] = {}

    def chunk(choices, usage=None):
        c = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if body.stream_options and body.stream_options.include_usage:
            c["usage"] = usage
        return sse(c)

    started = False
    async for i, out in _merge(tm, reqs):
        if not started:
            yield chunk(
                [
                    {
                        "index": k,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for k in range(len(reqs))
                ]
            )
            started = True
        delta = out["text"][sent_text[i] :]
        sent_text[i] = len(out["text"])
        finish = out["meta_info"]["finish_reason"]
        lp = None
        if body.logprobs:
            lp = {"content": _chat_logprobs(tm, out["meta_info"], sent_lp[i])}
            sent_lp[i] = len(out["meta_info"].get("output_token_logprobs") or [])
        if delta or finish:
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": lp,
                        "finish_reason": _finish(out) if finish else None,
                    }
                ]
            )
        if finish:
            finals[i] = out
    if body.stream_options and body.stream_options.include_usage:
        yield chunk([], _usage([finals[k] for k in sorted(finals)]))
    yield SSE_DONE


async def _completion_chunks(
    rid, model, reqs, tm, body: CompletionRequest, echo: str
) -> AsyncIterator[bytes]:
    created = int(time.time())
    sent_text = [0] * len(reqs)
    sent_lp = [0] * len(reqs)
    finals: dict[int, dict[str, Any]] = {}
    echoed = [not echo] * len(reqs)

    def chunk(choices, usage=None):
        c = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if body.stream_options and body.stream_options.include_usage:
            c["usage"] = usage
        return sse(c)

    async for i, out in _merge(tm, reqs):
        delta = out["text"][sent_text[i] :]
        sent_text[i] = len(out["text"])
        if not echoed[i]:
            delta, echoed[i] = echo + delta, True
        finish = out["meta_info"]["finish_reason"]
        lp = None
        if body.logprobs is not None:
            lp = _completion_logprobs(tm, out["meta_info"], sent_lp[i])
            sent_lp[i] = len(out["meta_info"].get("output_token_logprobs") or [])
        if delta or finish:
            yield chunk(
                [
                    {
                        "index": i,
                        "text": delta,
                        "logprobs": lp,
                        "finish_reason": _finish(out) if finish else None,
                    }
                ]
            )
        if finish:
            finals[i] = out
    if body.stream_options and body.stream_options.include_usage:
        yield chunk([], _usage([finals[k] for k in sorted(finals)]))
    yield SSE_DONE
