"""The native /generate request body, validated once for HTTP and the Engine alike.

`parse_generate_body` turns SGLang-style input (single or batch, text or input_ids, n) into a list of
`GenerateReq`s, raising ValueError with a message that names the offending field.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from runtime.errors import RequestError
from runtime.messages import GenerateReq, RequestOptions
from runtime.sampling_params import SamplingParams

ALLOWED_FIELDS = {
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "rid",
    "model",
    "timeout",
    "cache_salt",
    "session_id",
    "cache_ttl_s",
    "priority",
    "lora_path",
    "lora",
    "program_id",
}
# The per-request options' body fields, on every front end (`RequestOptions`; lang.backends.REQUEST_OPTIONS
# names the same ones for DSL programs)
OPTION_FIELDS = ("timeout", "cache_salt", "session_id", "cache_ttl_s", "priority", "program_id")
MAX_CACHE_SALT_CHARS = 1024
MAX_SESSION_ID_CHARS = 256
MAX_LORA_NAME_CHARS = 256
SESSION_HEADER = "x-session-id"  # names the session when the body does not (`session_id`)
PROGRAM_HEADER = "x-program-id"  # names the program when the body does not (`program_id`)
# A request's own deadline, in seconds: positive and finite (it can only shorten --request-timeout-s).
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_PRIORITY = 2**31 - 1  # |priority|: it travels as a msgpack integer
# Fields sglang-router (`--dp-size`) adds to every /generate body it forwards, with its defaults. Logging
# hints are accepted and change nothing; features radixlm does not have are accepted only when off.
ROUTER_LOG_HINTS = {"log_metrics", "no_logs"}
ROUTER_OFF_ONLY = {"return_hidden_states", "background", "return_bytes", "return_entropy"}


def parse_generate_body(body: Any, max_prompts: int | None = None) -> tuple[list[GenerateReq], bool]:
    """Returns (requests, is_batch).

    `max_prompts` (the server's --max-prompts-per-request) is checked before any per-prompt work; the
    tokenizer manager checks it again with n counted."""
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    check_unicode(body)
    unknown = sorted(set(body) - ALLOWED_FIELDS - ROUTER_LOG_HINTS - ROUTER_OFF_ONLY)
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}")
    for name in sorted(ROUTER_LOG_HINTS | ROUTER_OFF_ONLY):
        if _bool(body, name) and name in ROUTER_OFF_ONLY:
            raise ValueError(f"'{name}' is not supported by radixlm (only false is accepted)")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ValueError("exactly one of 'text' or 'input_ids' is required")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("'text' must be a string or a list of strings")
        prompts: list[tuple[str | None, list[int] | None]] = [(t, None) for t in texts]
    else:
        if not isinstance(ids, list) or not ids:
            raise ValueError("'input_ids' must be a non-empty list of token ids or a list of such lists")
        is_batch = isinstance(ids[0], list)
        seqs = ids if is_batch else [ids]
        for s in seqs:
            if not isinstance(s, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in s):
                raise ValueError("'input_ids' must contain only integers")
        prompts = [(None, s) for s in seqs]
    if is_batch and not prompts:
        raise ValueError("batch input must not be empty")
    if max_prompts is not None and len(prompts) > max_prompts:
        raise ValueError(
            f"the request has {len(prompts)} prompts, more than --max-prompts-per-request ({max_prompts})"
        )

    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != len(prompts):
            raise ValueError("'sampling_params' list must have one entry per prompt")
        params = [SamplingParams.from_dict(p) for p in sp]
    else:  # one object for every prompt: parsed once (requests never modify their params)
        params = [SamplingParams.from_dict(sp)] * len(prompts)

    stream = _bool(body, "stream")
    return_logprob = _bool(body, "return_logprob")
    text_in_lp = _bool(body, "return_text_in_logprobs")
    start = _int(body, "logprob_start_len", -1, low=-1)
    top_n = _int(body, "top_logprobs_num", 0, low=0, high=20)
    options = parse_options(body)
    loras = parse_lora_field(body, len(prompts))
    rid = body.get("rid")
    rids = rid if isinstance(rid, list) else [rid] * len(prompts)
    if len(rids) != len(prompts) or not all(r is None or isinstance(r, str) for r in rids):
        raise ValueError("'rid' must be a string (or a list of strings for batch input)")
    if stream and is_batch:
        raise ValueError("streaming is supported for a single prompt only")
    reqs = []
    auto = uuid.uuid4().hex  # one random id per body (uuid4 per prompt was most of a big batch's parse)
    for k, ((t, i), p, r) in enumerate(zip(prompts, params, rids)):
        req = GenerateReq(
            rid=r or (f"{auto}-{k}" if is_batch else auto),
            text=t,
            input_ids=i,
            params=p,
            stream=stream,
            return_logprob=return_logprob,
            logprob_start_len=start,
            top_logprobs_num=top_n,
            return_text_in_logprobs=text_in_lp,
            options=options if loras is None else msgspec.structs.replace(options, lora=loras[k]),
        )
        reqs.append(req)
    return reqs, is_batch


def parse_options(
    fields: dict[str, Any], session_header: str | None = None, program_header: str | None = None
) -> RequestOptions:
    """From a body's OPTION_FIELDS (`session_id` else the X-Session-Id header's value, `program_id` else the
    X-Program-Id header's); ValueError naming the field."""
    session_id = fields.get("session_id")
    if session_id is None:  # an empty one in the body is the body's (a 400), not a cue for the header
        session_id = session_header or None
    session_id, ttl = parse_session(session_id, fields.get("cache_ttl_s"))
    return RequestOptions(
        timeout_s=parse_timeout(fields.get("timeout")),
        cache_salt=parse_cache_salt(fields.get("cache_salt")),
        session_id=session_id,
        cache_ttl_s=ttl,
        priority=parse_priority(fields.get("priority")),
        program_id=parse_program_id(fields.get("program_id"), program_header),
    )


def body_options(body: Any, headers: Mapping[str, str]) -> RequestOptions:
    """`parse_options` for a pydantic body (chat, completions, Responses, Messages): its option fields, the
    X-Session-Id header, and where neither names a session, `prompt_cache_key` (OpenAI's key for requests
    that share a prefix: here their session). A RequestError 400 naming the field."""
    fields = {name: getattr(body, name, None) for name in OPTION_FIELDS}
    header = headers.get(SESSION_HEADER) or getattr(body, "prompt_cache_key", None)
    try:
        return parse_options(fields, header, headers.get(PROGRAM_HEADER))
    except ValueError as e:
        raise RequestError(str(e), 400) from None


def parse_lora(value: Any, field: str = "lora_path") -> str | None:
    """A LoRA adapter's name (SGLang's `lora_path`, also `lora`; OpenAI's `model` once the route has told it
    from the base model's): None for the base model."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LORA_NAME_CHARS or not value.isprintable():
        raise ValueError(
            f"'{field}' must be an adapter's name: a printable string of 1..{MAX_LORA_NAME_CHARS} chars"
        )
    return value


def parse_lora_field(body: dict[str, Any], prompts: int) -> list[str | None] | None:
    """A native body's adapter per prompt (`lora_path` or `lora`: one name, or a list with one per prompt)."""
    if body.get("lora_path") is not None and body.get("lora") is not None:
        raise ValueError("give either 'lora_path' or 'lora', not both")
    field = "lora" if body.get("lora") is not None else "lora_path"
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, list):
        if len(value) != prompts:
            raise ValueError(f"'{field}' list must have one entry per prompt ({prompts})")
        return [parse_lora(v, field) for v in value]
    return [parse_lora(value, field)] * prompts


def parse_priority(value: Any) -> int:
    """A request's `priority` (vLLM's field): waiting requests are admitted lowest value first."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_PRIORITY:
        raise ValueError(f"'priority' must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    return value


def parse_program_id(value: Any, header: str | None = None) -> str | None:
    """A request's `program_id` (else the X-Program-Id header's value): the agent program it is a call of,
    scheduled and retained with the program's other calls (`--schedule-policy program`, `--kv-retention`)."""
    if value is None:
        value = header or None
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_ID_CHARS):
        raise ValueError(f"'program_id' must be a non-empty string of at most {MAX_SESSION_ID_CHARS} chars")
    return value


def parse_timeout(value: Any) -> float | None:
    """A request's `timeout` field (seconds; None: the server's --request-timeout-s alone)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("'timeout' must be a number of seconds")
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"'timeout' must be in (0, {MAX_TIMEOUT_S:.0f}] seconds, got {value}")
    return float(value)


def parse_cache_salt(value: Any) -> str | None:
    """A request's `cache_salt` (vLLM's field): requests share cached KV only with the same salt."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} chars")
    if not value.isprintable():  # control characters separate a tenant from its salts (`tenants.scoped_salt`)
        raise ValueError("'cache_salt' must contain only printable characters (no control characters)")
    return value


def parse_session(session_id: Any, ttl: Any) -> tuple[str | None, float | None]:
    """`session_id` (the X-Session-Id header's value when the body has none) and `cache_ttl_s`: a session's
    finished request keeps its tokens pinned in the prefix cache for the TTL (the server's
    --session-ttl-s when None; --max-session-ttl-s bounds it, checked by the tokenizer manager)."""
    if session_id is not None and (
        not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_CHARS
    ):
        raise ValueError(f"'session_id' must be a non-empty string of at most {MAX_SESSION_ID_CHARS} chars")
    if ttl is not None:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl < float("inf"):
            raise ValueError("'cache_ttl_s' must be a non-negative number of seconds")
        if session_id is None:
            raise ValueError("'cache_ttl_s' needs a 'session_id' (or an X-Session-Id header)")
        ttl = float(ttl)
    return session_id, ttl


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ValueError(f"'{name}' must be a boolean")
    return v


def _int(body: dict, name: str, default: int, low: int, high: int | None = None) -> int:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"'{name}' must be an integer")
    if v < low or (high is not None and v > high):
        raise ValueError(f"'{name}' must be in [{low}, {high if high is not None else 'inf'}], got {v}")
    return v


def check_body_unicode(body: Any) -> None:
    """`check_unicode` over a pydantic body as the client sent it, as the 400 of every JSON route."""
    try:
        check_unicode(body.model_dump(exclude_unset=True))
    except ValueError as e:
        raise RequestError(str(e), 400) from None


def check_unicode(value: Any) -> None:
    """Raise ValueError naming the first string (or key) that holds a lone surrogate.

    JSON's escapes can spell one (``"\\ud800"``) and json.loads accepts it, but it is not text: UTF-8, and so
    the tokenizer, the IPC encoder and every JSON response, cannot carry it.
    """
    bad = _lone_surrogate_path(value, "")
    if bad is not None:
        where = bad.encode("utf-8", "backslashreplace").decode() or "body"
        raise ValueError(
            f"'{where}' is not valid Unicode: it contains a lone surrogate "
            "(an unpaired \\ud800-\\udfff escape)"
        )


def _lone_surrogate_path(value: Any, where: str) -> str | None:
    if isinstance(value, str):
        return where if not _is_utf8(value) else None
    if isinstance(value, dict):
        for key, v in value.items():
            name = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and not _is_utf8(key):
                return name
            found = _lone_surrogate_path(v, name)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (str, list, dict)):
                found = _lone_surrogate_path(v, f"{where}[{i}]")
                if found is not None:
                    return found
    return None


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
