"""The OpenAI request bodies radixlm accepts (pydantic): chat completions and completions, OpenAI's fields
plus radixlm's extras (grammars, top_k, stop_token_ids, ...). Unknown fields are a 400."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from runtime.entrypoints.generate_input import MAX_CACHE_SALT_CHARS, MAX_SESSION_ID_CHARS, MAX_TIMEOUT_S


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class CommonRequest(BaseModel):
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
    speculative_num_draft_tokens: int | None = None  # checked with the other sampling parameters
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_SESSION_ID_CHARS)
    cache_ttl_s: float | None = Field(default=None, ge=0)
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)  # seconds; shortens the server's
    # sglang-router (`--dp-size`) sends these with every request it forwards. separate_reasoning=False keeps
    # the thoughts in `content` (see --reasoning-parser); thoughts always stream as they come, so
    # stream_reasoning changes nothing; hidden states only off.
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


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    continue_final_message: StrictBool = False


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = None
