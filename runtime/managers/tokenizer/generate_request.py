"""`SingleRequest`: one prompt with its sampling parameters, the TokenizerManager's unit of work.

Every front end (native /generate, the OpenAI routes, the offline Engine) parses its own input into these;
it lives beside the manager that consumes it so that managers never import from entrypoints.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.sampling_params import SamplingParams


@dataclass
class SingleRequest:
    rid: str
    text: str | None  # exactly one of text / input_ids is set
    input_ids: list[int] | None
    params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    timeout_s: float | None = None  # the client's own deadline (the server's --request-timeout-s caps it)
    cache_salt: str | None = None  # shares cached KV only with requests of the same salt
    session_id: str | None = None  # when it finishes, its tokens stay pinned in the cache for cache_ttl_s
    cache_ttl_s: float | None = None  # None: the server's --session-ttl-s
    priority: int = 0  # waiting requests are admitted lowest value first
    pin_prefix_len: int = 0  # > 0: its session pins only this prefix (a `cache_control` breakpoint's)
    client_rid: str | None = (
        None  # the rid the client gave, when this is one of its n choices (or their prefill)
    )
