"""The OpenAI request bodies radixlm accepts (pydantic): chat completions and completions, every field of
OpenAI's (what each does here: docs/api_fields.md) plus radixlm's extras (grammars, top_k, stop_token_ids,
...). Unknown fields are a 400; so is a value radixlm cannot honour, naming the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from runtime.entrypoints.api_fields import (
    Metadata,
    PromptCacheKey,
    PromptCacheOptions,
    ReasoningEffort,
    ServiceTier,
    Verbosity,
    template_vars,
)
from runtime.entrypoints.generate_input import MAX_CACHE_SALT_CHARS, MAX_SESSION_ID_CHARS, MAX_TIMEOUT_S


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    # OpenAI pads chunks with random `obfuscation` text against length side channels; radixlm sends none,
    # which is what include_obfuscation=false asks (true is accepted: the padding carries no data)
    include_obfuscation: StrictBool = True


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
    logit_bias: dict[str, float] | None = None  # checked by SamplingParams (token ids, values in [-100, 100])
    # ---- OpenAI's fields: accepted, what each does is in docs/api_fields.md
    store: StrictBool | None = None  # nothing is stored: there is no stored-completions API here
    metadata: Metadata | None = Field(default=None, max_length=16)
    service_tier: ServiceTier | None = None  # one tier here: the answer says "default"
    safety_identifier: str | None = Field(default=None, max_length=128)
    prompt_cache_key: PromptCacheKey | None = None  # the session, where session_id / X-Session-Id are unset
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
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
    priority: int | None = None  # vLLM's: a lower value is admitted first (`generate_input.parse_priority`)
    program_id: str | None = None  # the agent program it is a call of (`generate_input.parse_program_id`)
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


class Prediction(BaseModel):
    """Predicted Outputs: a speed hint (OpenAI drafts from it); the answer is the same without it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: str | list[dict[str, Any]]


class LegacyFunction(BaseModel):
    """An entry of the deprecated `functions` (Chat Completions' tools before `tools`)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Any = None  # a string, text parts, or (a tool result) any JSON: routes.content_text


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
    # ---- OpenAI's fields: accepted, what each does is in docs/api_fields.md
    reasoning_effort: ReasoningEffort | None = None  # a chat template variable (`template_vars`)
    verbosity: Verbosity | None = None  # likewise
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: Prediction | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # deprecated spelling of tools / tool_choice: converted to them (`_legacy_functions`)
    functions: list[LegacyFunction] | None = None
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and "audio" in v:
            raise ValueError('audio output is not supported by radixlm (a text model): use ["text"]')
        return v

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            raise ValueError("audio output is not supported by radixlm (a text model); leave it unset")
        return v

    @field_validator("web_search_options")
    @classmethod
    def _no_web_search(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            raise ValueError("radixlm has no web search; leave it unset")
        return v

    @field_validator("moderation")
    @classmethod
    def _no_moderation(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            raise ValueError("radixlm has no moderation model; leave it unset")
        return v

    @model_validator(mode="after")
    def _legacy_functions(self) -> ChatCompletionRequest:
        """`functions` / `function_call` as `tools` / `tool_choice` (one call per answer, as they allowed)."""
        if self.function_call is not None and self.functions is None:
            raise ValueError("function_call needs functions")
        if self.functions is None:
            return self
        if self.tools is not None or self.tool_choice is not None:
            raise ValueError("functions (deprecated) cannot be combined with tools or tool_choice")
        self.tools = [
            {"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions
        ]
        choice = self.function_call
        if isinstance(choice, dict):
            if set(choice) != {"name"} or not isinstance(choice["name"], str):
                raise ValueError('function_call must be "none", "auto" or {"name": ...}')
            choice = {"type": "function", "function": {"name": choice["name"]}}
        self.tool_choice = choice
        self.parallel_tool_calls = False
        return self

    @property
    def template_vars(self) -> dict[str, Any]:
        return template_vars(self.reasoning_effort, self.verbosity)


class CompletionRequest(CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = None
