"""Every message that crosses a process boundary, and the one serializer for them.

Messages are tagged `msgspec.Struct`s encoded as MessagePack: typed on decode, fast, and unlike pickle they
cannot execute code. Flow (one way): TokenizerManager -> Scheduler -> Detokenizer -> TokenizerManager;
the scheduler also answers control requests (flush, server info) straight to the TokenizerManager.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from runtime.sampling_params import SamplingParams


class Message(msgspec.Struct, tag=True, kw_only=True):
    pass


# ---- TokenizerManager -> Scheduler -------------------------------------------------------------------
class RequestOptions(msgspec.Struct, frozen=True, kw_only=True):
    """A request's per-request options, one record from every front end to the scheduler's `Req`, which
    holds it as it came: a new option is one field here and one line in `generate_input.parse_options`
    (tests/e2e/test_request_options.py proves every front end carries each to the scheduler).

    The client's (`generate_input.OPTION_FIELDS`): timeout_s, cache_salt, session_id, cache_ttl_s,
    priority. The tokenizer manager fills in tenant, puts the tenant's scope into cache_salt and resolves
    cache_ttl_s; the Messages API sets pin_prefix_len."""

    timeout_s: float | None = None  # the request's own deadline in seconds (it can only shorten the server's)
    cache_salt: str | None = None  # the radix cache shares KV only between requests of the same salt
    session_id: str | None = None  # pin the finished request's tokens in the cache for cache_ttl_s
    cache_ttl_s: float | None = None  # None: --session-ttl-s (under --kv-retention auto: the server decides)
    priority: int = 0  # waiting requests are admitted lowest value first (the policy's order within one)
    tenant: str | None = None  # whose key sent it (--api-keys-file): sessions and pin quotas are per tenant
    pin_prefix_len: int = 0  # > 0: the session pins only this prefix (Anthropic's cache_control breakpoint)
    lora: str | None = None  # the LoRA adapter's name (None: the base model); its KV is its own
    # the agent program it is a call of (`managers/scheduler/programs.py`); None: its session, if any
    program_id: str | None = None


class GenerateReq(Message):
    """One sequence to generate: what a front end parses a body into, and, once the tokenizer manager has
    put its token ids in (`text` None), the message the scheduler receives."""

    rid: str
    params: SamplingParams
    text: str | None = None  # exactly one of text / input_ids is set (input_ids only, when sent)
    input_ids: list[int] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    options: RequestOptions = msgspec.field(default_factory=RequestOptions)
    client_rid: str | None = None  # the rid the client gave, when this is one of its n choices


class AbortReq(Message):
    rid: str = ""  # the request to abort; "" matches none (aborting everything takes abort_all)
    abort_all: bool = False  # every request, whatever `rid` says


class FlushCacheReq(Message):
    pass


class GetServerInfoReq(Message):
    pass


class DashboardStateReq(Message):
    """The live dashboard's state as one viewer may see it (`managers/scheduler/dashboard_state.py`)."""

    tenant: str | None = None  # the viewer's tenant: only its prefixes, requests and misses
    admin: bool = False  # sees every tenant's
    max_nodes: int = 160  # radix tree rows per tier, at most


class LoadLoraReq(Message):
    name: str
    path: str


class UnloadLoraReq(Message):
    name: str


class ReleaseSessionReq(Message):
    session_id: str
    cache_salt: str | None = None  # a session is its id within its tenant and salt
    tenant: str | None = None
    lora: str | None = None  # the adapter the session's requests ran under (its identity salts the key)


class ToolCallsMade(Message):
    """A finished request's answer called these tools (the front end parsed them from its text; the
    scheduler sees only token ids). Automatic retention times the program's pin by the tools' own pauses
    (`retention.py`). Sent before the answer goes to the client, so it reaches the scheduler before the
    program's next call. No reply."""

    rid: str  # the scheduler's rid of the finished request (one choice's)
    names: list[str]


# ---- Scheduler -> TokenizerManager (control replies) ------------------------------------------------------
class FlushCacheResp(Message):
    success: bool
    message: str = ""


class ServerInfoResp(Message):
    info: dict[str, Any]


class DashboardStateResp(Message):
    state: dict[str, Any]


class LoraResp(Message):
    """The adapters served after a load or unload, or the 400 that refused it (`error`)."""

    adapters: list[dict[str, Any]]  # name, path, rank, targets, digest
    error: str | None = None


class ReleaseSessionResp(Message):
    released_tokens: int  # 0: the session held no pin
    error: str | None = None  # the adapter named is not served (nothing was released)


# ---- Scheduler -> Detokenizer -> TokenizerManager --------------------------------------------------------
class ReqOutput(Message):
    """Incremental output of one request for one scheduler step."""

    rid: str
    new_token_ids: list[int]  # appended after dropping `replaced_tokens` from the tail (jump-forward)
    replaced_tokens: int = 0
    finished_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_host: int = 0  # of cached_tokens, those loaded back from the host tier
    cached_tokens_disk: int = 0  # of cached_tokens, those loaded from the disk tier
    cache_miss: dict[str, Any] | None = None  # first chunk: the session cache-miss explanation, if any
    # speculative decoding so far (None: the request never looked for a draft): verify steps, accepted tokens
    spec: list[int] | None = None
    # logprob entries are [logprob | None, token_id, top_logprobs | None]
    input_token_logprobs: list[list[Any]] | None = None
    output_token_logprobs: list[list[Any]] | None = None
    # detokenizer settings, sent with the first chunk
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_strings: list[str] | None = None
    no_stop_trim: bool = False
    stop_regex: list[str] | None = None  # trimmed like stop strings (SGLang's stop_regex)
    error: str | None = None  # set when the request failed (e.g. grammar compile error)
    error_status: int = 0  # HTTP status for `error` (400: client's fault)


class BatchTokenIDOut(Message):
    outputs: list[ReqOutput]


class ReqTextOutput(Message):
    rid: str
    text_delta: str  # new text since the previous chunk (stop strings trimmed)
    new_token_ids: list[int]
    replaced_tokens: int = 0
    finished_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_host: int = 0  # of cached_tokens, those loaded back from the host tier
    cached_tokens_disk: int = 0  # of cached_tokens, those loaded from the disk tier
    cache_miss: dict[str, Any] | None = None  # first chunk: the session cache-miss explanation, if any
    spec: list[int] | None = None  # as ReqOutput.spec
    input_token_logprobs: list[list[Any]] | None = None
    output_token_logprobs: list[list[Any]] | None = None
    error: str | None = None
    error_status: int = 0


class BatchStrOut(Message):
    outputs: list[ReqTextOutput]


AnyMessage = Union[  # noqa: UP007 - msgspec needs a typing.Union of tagged structs
    GenerateReq,
    AbortReq,
    FlushCacheReq,
    GetServerInfoReq,
    DashboardStateReq,
    ReleaseSessionReq,
    ToolCallsMade,
    LoadLoraReq,
    UnloadLoraReq,
    FlushCacheResp,
    ServerInfoResp,
    DashboardStateResp,
    ReleaseSessionResp,
    LoraResp,
    BatchTokenIDOut,
    BatchStrOut,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
