"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Requests are translated into the native `GenerateReq` (one per choice, sharing the prompt's KV through
the radix cache) and answers back into OpenAI's objects (`formatters`), streaming included.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import msgspec
from fastapi import FastAPI, Request

from runtime.entrypoints.generate_input import body_options, check_body_unicode
from runtime.entrypoints.http_common import FastJSONResponse, run_unless_disconnected
from runtime.entrypoints.openai.formatters import (
    ChatFormatter,
    CompletionFormatter,
    chat_logprobs,
    completion_logprobs,
    envelope,
    finish_reason,
    tool_finish_reason,
    usage_of,
)
from runtime.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CommonRequest,
    CompletionRequest,
)
from runtime.entrypoints.streaming import stream_response
from runtime.entrypoints.tool_calls import ToolRequestError
from runtime.entrypoints.wire import register_messages_routes, register_responses_routes
from runtime.entrypoints.wire.conversation import plan_tools
from runtime.entrypoints.wire.reasoning import grammar_after_thoughts, history_text, keeps_special_tokens
from runtime.entrypoints.wire.reasoning import resolve as resolve_reasoning
from runtime.errors import RequestError
from runtime.managers.tokenizer.tokenizer_manager import TokenizerManager
from runtime.messages import GenerateReq, RequestOptions
from runtime.sampling_params import SamplingParams, check_token_budget
from runtime.server_args import ServerArgs


def register_openai_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs) -> None:
    def model_options(model: str, options: RequestOptions) -> RequestOptions:
        """`options` for what a body's `model` names: the base model, or a LoRA adapter served under that
        name (`lora_routes.ServedAdapters`); 404 naming what is served for neither. Every front end that
        takes a `model` (chat, completions, Responses, Messages) reads it here."""
        adapter = app.state.loras.adapter_of(model)
        return options if adapter is None else msgspec.structs.replace(options, lora=adapter)

    register_responses_routes(app, tm, args, model_options)
    register_messages_routes(app, tm, args, model_options)

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
                },
                *app.state.loras.models(args.model_name, int(time.time()), tm.context_length),
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest):
        check_body_unicode(body)
        options = body_options(body, request.headers)
        options = model_options(body.model, options)
        if not body.messages:
            raise RequestError("'messages' must contain at least one message", 400)
        msgs = [
            {
                "role": m.role if m.role != "developer" else "system",
                "content": content_text(m.content, f"messages[{i}].content", m.role),
            }
            for i, m in enumerate(body.messages)
        ]
        extras = [history_extras(m, i) for i, m in enumerate(body.messages)]
        if args.reasoning_in_history:  # thoughts the client sent back stay in the rendered history
            for msg, extra in zip(msgs, extras, strict=True):
                thoughts = extra.pop("reasoning_content", None)
                if msg["role"] == "assistant" and thoughts is not None:
                    msg["content"] = history_text(thoughts, msg["content"], None)
        # Bounds and admission before the template is rendered and the prompt tokenized.
        tm.check_prompt_chars(sum(len(m["content"]) for m in msgs))
        check_bounds(tm, body, 1)
        # ---- tool calling (runtime/entrypoints/tool_calls): prompt, grammar, and later the message
        try:
            plan = await plan_tools(msgs, extras, body, tm, args)
        except ToolRequestError as e:
            raise RequestError(str(e), 400) from None
        grammar = grammar_of(body)
        if plan.grammar is not None:
            if grammar:
                raise RequestError("'tools' with a forced tool_choice cannot be combined with a grammar", 400)
            grammar = plan.grammar
        reasoning = resolve_reasoning(args.reasoning_parser, tm.tokenizer.chat_template, tm.tokenizer)
        reasoning = reasoning if body.separate_reasoning else None
        grammar = await grammar_after_thoughts(reasoning, grammar)
        ids = (await tm.encode([plan.prompt], add_special_tokens=False))[0]
        # ---- end tool calling
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        keep = keeps_special_tokens(plan, reasoning)
        params = sampling_params(body, max_tokens, len(ids), tm.context_length, grammar, keep)
        top = body.top_logprobs or 0
        req = single_request(body, options, ids, params, body.logprobs or top > 0, top)
        rid = "chatcmpl-" + req.rid
        if body.stream:
            fmt = ChatFormatter(rid, args.model_name, tm, body, plan, reasoning)
            return await stream_response(tm, [req], fmt)
        results = await run_unless_disconnected(request, tm.generate_all([req]))
        choices = []
        for i, r in enumerate(results):
            split = reasoning.split(r["text"]) if reasoning else None
            message = plan.message(split.answer if split else r["text"])
            tm.tool_calls_made(r["meta_info"], [c["function"]["name"] for c in message.get("tool_calls", [])])
            if split is not None and split.reasoning is not None:
                message["reasoning_content"] = split.reasoning
            finish = tool_finish_reason(finish_reason(r), bool(message.get("tool_calls")))
            if body.functions is not None and message.get("tool_calls"):  # the deprecated spelling's answer
                message["function_call"] = message["tool_calls"][0]["function"]
                finish = "function_call"
            choice = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
            if body.logprobs:
                choice["logprobs"] = {"content": chat_logprobs(tm, r["meta_info"])}
            choices.append(choice)
        return FastJSONResponse(
            {
                **envelope(rid, "chat.completion", int(time.time()), args.model_name, choices),
                "usage": usage_of(results),
                **served_tier(body),
            }
        )

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        check_body_unicode(body)
        options = body_options(body, request.headers)
        options = model_options(body.model, options)
        if body.suffix:
            raise RequestError("'suffix' is not supported", 400)
        if body.best_of not in (None, 1, body.n):
            raise RequestError("'best_of' other than n is not supported", 400)
        texts, id_lists = completion_prompts(body.prompt)
        if body.stream and len(texts) + len(id_lists) > 1:
            raise RequestError("streaming supports a single prompt", 400)
        # Bounds and admission before tokenizing: a refused request costs no tokenizer time.
        tm.check_prompt_chars(sum(len(t) for t in texts))
        check_bounds(tm, body, len(texts) + len(id_lists))
        prompts = await tm.encode(texts) if texts else id_lists
        top = body.logprobs
        rid = "cmpl-" + uuid.uuid4().hex
        # max_tokens is always set here (OpenAI's default is 16), so one SamplingParams serves every prompt.
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        params = sampling_params(body, max_tokens, 0, tm.context_length, grammar_of(body))
        # echo + logprobs scores the prompt too (the DSL's `select` over lang's OpenAI backend needs it)
        start = 0 if body.echo and top is not None else -1
        reqs = [
            single_request(body, options, ids, params, top is not None, top or 0, start) for ids in prompts
        ]
        echo_texts = [""] * len(prompts)
        if body.echo:
            echo_texts = await tm.run_in_tokenizer(lambda: [tm.tokenizer.decode(ids) for ids in prompts])
        if body.stream:
            fmt = CompletionFormatter(rid, args.model_name, tm, body, echo_texts[0])
            return await stream_response(tm, reqs, fmt)
        every = await run_unless_disconnected(request, tm.generate_all(reqs))  # n per prompt, in order
        results_per_prompt = [every[p * body.n : (p + 1) * body.n] for p in range(len(reqs))]
        choices, flat = [], []
        for p, results in enumerate(results_per_prompt):
            for r in results:
                choice = {
                    "index": len(choices),
                    "text": echo_texts[p] + r["text"],
                    "finish_reason": finish_reason(r),
                    "logprobs": (
                        completion_logprobs(tm, r["meta_info"], echo=body.echo) if top is not None else None
                    ),
                }
                choices.append(choice)
                flat.append(r)
        usage = usage_of(flat)
        if len(results_per_prompt) > 1:  # several prompts: each prompt counts once
            usage["prompt_tokens"] = sum(rs[0]["meta_info"]["prompt_tokens"] for rs in results_per_prompt)
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return FastJSONResponse(
            {
                **envelope(rid, "text_completion", int(time.time()), args.model_name, choices),
                "usage": usage,
                **served_tier(body),
            }
        )


# ---- request translation ---------------------------------------------------------------------------------
def content_text(content: Any, where: str = "content", role: str = "user") -> str:
    """A message's content as text: a string, a list of text parts, nothing (""); a tool result of any other
    JSON type is its JSON text (the result as the tool gave it)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        texts = [p.get("text") for p in content]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    if role == "tool":
        return json.dumps(content, ensure_ascii=False)
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"'{where}[{j}]': only text content parts are supported, got {kind!r}", 400
                )
    raise RequestError(f"'{where}' must be a string or a list of text parts", 400)


def history_extras(m: ChatMessage, index: int) -> dict[str, Any]:
    """A message's fields besides role and content, for the template: tool_calls, tool_call_id, name, and an
    assistant turn's thoughts as `reasoning_content` (also read from `reasoning`, another client's name for
    it), as the client sent them back."""
    extra = dict(m.model_extra or {})
    thoughts = extra.get("reasoning_content")
    if thoughts is None:
        thoughts = extra.pop("reasoning", None)
    if thoughts is not None and not isinstance(thoughts, str):
        raise RequestError(f"'messages[{index}].reasoning_content' must be a string", 400)
    if thoughts is None or m.role != "assistant":
        extra.pop("reasoning_content", None)
    else:
        extra["reasoning_content"] = thoughts
    return extra


def grammar_of(body: CommonRequest) -> dict[str, Any]:
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


def sampling_params(
    body: CommonRequest,
    max_tokens: int | None,
    prompt_len: int,
    context: int,
    grammar: dict[str, Any],
    keep_special_tokens: bool = False,
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
            skip_special_tokens=body.skip_special_tokens and not keep_special_tokens,
            no_stop_trim=body.no_stop_trim,
            seed=body.seed,
            logit_bias=body.logit_bias,
            n=body.n,
            speculative_num_draft_tokens=body.speculative_num_draft_tokens,
            **grammar,
        )
    except ValueError as e:
        raise RequestError(str(e), 400) from None


def single_request(
    body: CommonRequest,
    options: RequestOptions,
    ids: list[int],
    params: SamplingParams,
    logprobs: bool,
    top: int,
    logprob_start_len: int = -1,
) -> GenerateReq:
    """One request for all n choices: the tokenizer manager expands it (`prepare_choices`). The body and
    its options give what every prompt of it shares: streaming, the deadline, the cache salt, the session."""
    return GenerateReq(
        rid=uuid.uuid4().hex,
        input_ids=ids,
        params=params,
        stream=body.stream,
        return_logprob=logprobs,
        top_logprobs_num=top,
        return_text_in_logprobs=logprobs,
        logprob_start_len=logprob_start_len,
        options=options,
    )


def served_tier(body: CommonRequest) -> dict[str, str]:
    """The `service_tier` field of an answer whose request named one: radixlm has one tier, "default"."""
    return {"service_tier": "default"} if body.service_tier is not None else {}


def completion_prompts(prompt) -> tuple[list[str], list[list[int]]]:
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


def check_bounds(tm: TokenizerManager, body: CommonRequest, num_prompts: int) -> None:
    """The request bounds the tokenizer manager checks again later, and admission, checked while the
    request is still cheap to refuse."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    tm.check_stop(stop)
    tm.check_prompt_count(num_prompts * body.n)
    tm.check_admission(num_prompts * body.n)
