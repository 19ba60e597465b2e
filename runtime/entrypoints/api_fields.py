"""Field types the OpenAI-shaped bodies share (chat completions, completions, Responses): OpenAI's own
fields that radixlm accepts with a meaning of its own (docs/api_fields.md says which does what)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, StringConstraints

from runtime.entrypoints.generate_input import MAX_SESSION_ID_CHARS

# OpenAI's bounds of `metadata`: 16 pairs, keys of at most 64 characters, values of at most 512
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
Metadata = dict[MetadataKey, MetadataValue]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Verbosity = Literal["low", "medium", "high"]
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
# OpenAI's prompt_cache_key is the session here (`generate_input.body_options`): a session id's bounds
PromptCacheKey = Annotated[str, StringConstraints(min_length=1, max_length=MAX_SESSION_ID_CHARS)]


class RequestOptionFields(BaseModel):
    """radixlm's extras beside an API's own fields (`extra_body` with the official clients), for the bodies
    that leave their checks to `generate_input.body_options` (Responses, Messages): the per-request options
    (`generate_input.OPTION_FIELDS`) and the request's draft bound."""

    speculative_num_draft_tokens: int | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    cache_ttl_s: float | None = None
    timeout: float | None = None
    priority: int | None = None
    program_id: str | None = None


class PromptCacheOptions(BaseModel):
    """OpenAI's cache breakpoints and lifetime: radixlm caches every prefix (radix cache, LRU), so both are
    accepted and change nothing; a lifetime is what a session's `cache_ttl_s` gives."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None


def template_vars(effort: str | None, verbosity: str | None = None) -> dict[str, Any]:
    """The chat template's variables for a request's reasoning effort and verbosity (as reasoning models'
    templates read them: `reasoning_effort`, and `enable_thinking` false for effort "none"); {} when unset,
    so a prompt renders to the same bytes as before."""
    out: dict[str, Any] = {}
    if effort is not None:
        out["reasoning_effort"] = effort
        if effort == "none":
            out["enable_thinking"] = False
    if verbosity is not None:
        out["verbosity"] = verbosity
    return out
