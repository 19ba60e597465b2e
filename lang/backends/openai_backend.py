"""`OpenAI`: run programs against any OpenAI-compatible endpoint with the official `openai` client.

`gen` inside a fresh assistant block is a chat completion over the conversation's messages; anywhere else it
is a text completion of the rendered prompt. `select` needs prompt logprobs, i.e. `/v1/completions` with
`echo=True, logprobs=0, max_tokens=0`; endpoints without that (most hosted chat models) get a clear error.
Role text in `state.text()` is rendered with a neutral ChatML template: the endpoint applies its own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from lang.backends.base import Backend, GenResult, Prompt, SelectResult, pick, request_options
from lang.chat_template import CHATML_TEMPLATE, ChatTemplate
from lang.errors import BackendError

# SamplingParams fields that the OpenAI API has under its own name; every other field travels in
# `extra_body` under its SamplingParams name (radixlm and SGLang accept them there).
_OPENAI_NAMES = {
    "max_new_tokens": "max_tokens",
    "stop": "stop",
    "temperature": "temperature",
    "top_p": "top_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
}


class OpenAI(Backend):
    """`options`: radixlm's per-request options (`base.REQUEST_OPTIONS`), sent in `extra_body` of every
    request (for radixlm or SGLang behind its OpenAI API; a hosted OpenAI model refuses them)."""

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        options: dict[str, Any] | None = None,
        **client_kwargs: Any,
    ) -> None:
        import openai

        self.model = model
        self.options = request_options(options)
        self._openai = openai
        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"  # local servers accept any key
        self.client = openai.OpenAI(base_url=base_url, api_key=key, **client_kwargs)
        self._template = ChatTemplate(CHATML_TEMPLATE)

    def __repr__(self) -> str:
        return f"OpenAI({self.model!r}, base_url={str(self.client.base_url)!r})"

    def chat_template(self) -> ChatTemplate:
        return self._template

    # ------------------------------------------------------------------------------------------------- gen
    def _request_args(self, prompt: Prompt, sampling: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """(use_chat, create() kwargs)."""
        use_chat = prompt.open_role == "assistant" and prompt.open_content == ""
        args: dict[str, Any] = {"model": self.model}
        extra: dict[str, Any] = dict(self.options)
        if prompt.program_id and "program_id" not in extra:
            extra["program_id"] = prompt.program_id
        for name, value in sampling.items():
            if name == "json_schema":
                fmt = {"type": "json_schema", "json_schema": {"name": "output", "schema": json.loads(value)}}
                (args if use_chat else extra)["response_format"] = fmt
            elif name in _OPENAI_NAMES:
                args[_OPENAI_NAMES[name]] = value
            else:
                extra[name] = value
        if extra:
            args["extra_body"] = extra
        if use_chat:
            args["messages"] = list(prompt.messages)
        else:
            args["prompt"] = prompt.text
        return use_chat, args

    def generate(self, prompt: Prompt, sampling: dict[str, Any]) -> GenResult:
        use_chat, args = self._request_args(prompt, sampling)
        with self._errors():
            if use_chat:
                resp = self.client.chat.completions.create(**args)
                text = resp.choices[0].message.content or ""
            else:
                resp = self.client.completions.create(**args)
                text = resp.choices[0].text
        return GenResult(text, _meta(resp.id, resp.choices[0].finish_reason, resp.usage))

    def generate_stream(self, prompt: Prompt, sampling: dict[str, Any]) -> Iterator[GenResult]:
        use_chat, args = self._request_args(prompt, sampling)
        args.update(stream=True, stream_options={"include_usage": True})
        create = self.client.chat.completions.create if use_chat else self.client.completions.create
        text, rid, finish, usage = "", None, None, None
        with self._errors():
            for chunk in create(**args):
                rid, usage = chunk.id, chunk.usage or usage
                for choice in chunk.choices:
                    piece = (choice.delta.content if use_chat else choice.text) or ""
                    finish = choice.finish_reason or finish
                    if piece:
                        text += piece
                        yield GenResult(text, {"id": rid})
        yield GenResult(text, _meta(rid, finish, usage))

    # ---------------------------------------------------------------------------------------------- select
    def select(self, prompt: Prompt, choices: list[str]) -> SelectResult:
        """Same definition as the native backends: mean logprob of prompt+choice's tokens from the first one
        that differs from the prompt's tokens; one echo request scores the prompt and every choice."""
        if not choices:
            raise ValueError("select needs at least one choice")
        try:
            head, *outs = self._echo([prompt.text] + [prompt.text + c for c in choices])
        except BackendError as e:
            raise BackendError(
                "select with the OpenAI backend needs prompt logprobs "
                "(completions with echo=True, logprobs=0, "
                f"max_tokens=0), which this endpoint refused: {e.message}",
                e.status,
            ) from e
        normalized, counts = [], []
        for tokens in outs:
            d = 0
            while d < len(head) and d < len(tokens) and tokens[d][0] == head[d][0]:
                d += 1
            tail = [lp for _, lp in tokens[d:]]
            if any(lp is None for lp in tail):
                raise BackendError(
                    "the endpoint returned null logprobs for the choice tokens; select cannot score"
                )
            normalized.append(sum(tail) / len(tail) if tail else float("-inf"))
            counts.append(len(tail))
        meta = {"normalized_logprobs": normalized, "prompt_tokens": len(head), "choice_tokens": counts}
        return SelectResult(pick(normalized), normalized, meta)

    def _echo(self, texts: list[str]) -> list[list[tuple[str, float | None]]]:
        """Per text, (token, logprob) of each of its tokens (the first logprob is None),
        via completions echo.
        """
        with self._errors():
            resp = self.client.completions.create(
                model=self.model,
                prompt=texts,
                max_tokens=0,
                echo=True,
                logprobs=0,
                temperature=0,
                **({"extra_body": dict(self.options)} if self.options else {}),
            )
        out: list[list[tuple[str, float | None]]] = [[] for _ in texts]
        for choice in resp.choices:
            lp = choice.logprobs
            if lp is None or not lp.token_logprobs or len(lp.tokens) != len(lp.token_logprobs):
                raise BackendError(
                    "the endpoint returned no prompt logprobs (echo with logprobs unsupported)"
                )
            out[choice.index] = list(zip(lp.tokens, lp.token_logprobs, strict=True))
        return out

    # ---------------------------------------------------------------------------------------------- errors
    def _errors(self) -> Any:
        return _TranslateErrors(self._openai)

    def close(self) -> None:
        self.client.close()


class _TranslateErrors:
    """Context manager: openai exceptions -> BackendError carrying the server's own message."""

    def __init__(self, openai_module: Any) -> None:
        self._openai = openai_module

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc is None or not isinstance(exc, self._openai.OpenAIError):
            return False
        status = getattr(exc, "status_code", None)
        body = getattr(exc, "body", None)
        message = str(exc)
        if isinstance(body, dict):
            err = body.get("error", body)
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                message = err["message"]
        raise BackendError(message, status) from exc


def _meta(rid: Any, finish_reason: str | None, usage: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": rid, "finish_reason": {"type": finish_reason} if finish_reason else None}
    if usage is not None:
        meta["prompt_tokens"] = usage.prompt_tokens
        meta["completion_tokens"] = usage.completion_tokens
        details = getattr(usage, "prompt_tokens_details", None)
        meta["cached_tokens"] = getattr(details, "cached_tokens", None) if details is not None else None
    return meta
