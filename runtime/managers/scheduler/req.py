"""Per-request state inside the scheduler process."""

from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.managers.scheduler.output_stream import SendState
from runtime.mem_cache.radix_cache import TreeNode
from runtime.messages import GenerateReq, RequestOptions
from runtime.sampling_params import SamplingParams, TokenBudgetError, check_token_budget


@functools.lru_cache(maxsize=4096)
def _salt_offset(salt: str) -> int:
    """A key offset per salt: (64-bit hash + 1) << 32, so salted elements never equal a token id (< 2**32)
    nor, but for a 2**-64 chance, another salt's."""
    digest = hashlib.blake2b(salt.encode(), digest_size=8, person=b"radixlm-salt").digest()
    return (int.from_bytes(digest, "little") + 1) << 32


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    arrival: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() past which the request is aborted (504)
    options: RequestOptions = field(default_factory=RequestOptions)  # as the request came (properties below)
    cache_miss: dict[str, Any] | None = None  # why it found less cached than its session left (`sessions`)

    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    error: str | None = None
    error_status: int = 0

    # ---- KV memory (owned jointly with CacheManager) ----
    req_pool_idx: int | None = None
    kv_len: int = 0  # tokens of `all_ids` whose KV is in req_to_token[req_pool_idx, :kv_len]
    locked_node: TreeNode | None = None  # radix node locked for the cached prefix we use
    cache_owned_len: int = 0  # leading tokens of kv whose slots the radix cache owns (not this request)
    prefix_hit_len: int = 0  # prompt tokens found cached at first admission (the client's cached_tokens)
    prefix_hit_host: int = 0  # of those, the tokens loaded from the host tier
    host_loaded_len: int = 0  # tokens the latest admission loaded from the host tier (`CacheManager.start`)
    prefix_hit_disk: int = 0  # of prefix_hit_len, the tokens loaded from the disk tier
    disk_loaded_len: int = 0  # tokens the latest admission loaded from the disk tier
    # tokens past the device match that the host or disk tier held at the latest admission but that did not
    # fit in the device pool then (the prefill adder makes the request wait for room rather than recompute)
    tier_unloaded_len: int = 0
    # set by `CacheManager.match(req, tiers=True)` (lpm's ordering): tokens past match_len that the host or
    # disk tier holds; lpm ranks by match_len + this, the tokens the request will not compute
    tier_match_len: int = 0
    disk_names: tuple[tuple[int, ...], list[str]] | None = None  # (key, its disk block names): hashed once
    tier_waiting: bool = False  # waited for room to load a tier prefix: offered first until it starts
    # set by the prefill adder: prefix length matched at scheduling time and the node it ends in
    match_len: int = 0
    match_node: TreeNode | None = None
    match_indices: torch.Tensor | None = None

    sent: SendState = field(default_factory=SendState)  # what the client has been sent (output_stream)

    grammar: Any = None  # constrained.GrammarMatcher
    closing: Any = None  # grammar_manager.ClosingState: steering the grammar to close within max_new_tokens
    grammar_future: Any = None
    generator: torch.Generator | None = None
    retractions: int = 0
    stop_scan: Any = None  # stop_checker.StopScan: the incremental stop-string scan, owned by StopChecker
    spec: Any = None  # drafting.SpecState: speculative decoding's index and counters (None: never drafted)
    lora_adapter: Any = None  # models.lora.Adapter bound at arrival (`lora_manager`); None: the base model
    lora_slot: int = -1  # its adapter's pool slot while admitted
    lineage: int | None = None  # the program inferred from its prompt when it names none (`programs.Lineage`)
    # its program's service accounting (`ProgramTable.charge`): prompt positions already charged, and the
    # prompt's prefix hashes (computed once, dropped as it leaves)
    charged_to: int = 0
    prompt_hashes: Any = None

    @classmethod
    def from_message(cls, msg: GenerateReq, timeout_s: float | None = None) -> Req:
        """`timeout_s`: the server's --request-timeout-s; the message's `timeout_s` can only shorten it."""
        limits = [t for t in (timeout_s, msg.options.timeout_s) if t is not None]
        arrival = time.monotonic()
        return cls(
            arrival=arrival,
            deadline=arrival + min(limits) if limits else None,
            rid=msg.rid,
            prompt_ids=list(msg.input_ids),
            params=msg.params,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            options=msg.options,
        )

    # ---- the request's options (`messages.RequestOptions`) ----
    @property
    def cache_salt(self) -> str | None:
        """Shares cached KV only with requests of the same salt (`cache_key`)."""
        return self.options.cache_salt

    @property
    def session_id(self) -> str | None:
        """When it finishes, its tokens stay pinned for cache_ttl_s (`sessions`)."""
        return self.options.session_id

    @property
    def cache_ttl_s(self) -> float:
        return self.options.cache_ttl_s or 0.0

    @property
    def tenant(self) -> str | None:
        """Whose key sent it: a session is (tenant, salt, id); pin quotas are per tenant."""
        return self.options.tenant

    @property
    def priority(self) -> int:
        """Waiting requests are admitted lowest value first (`schedule_policy.order_waiting`)."""
        return self.options.priority

    @property
    def pin_prefix_len(self) -> int:
        """> 0: its session pins only this prefix (a cache_control breakpoint's)."""
        return self.options.pin_prefix_len

    @property
    def session_key(self) -> tuple[str | None, str | None, str]:
        """(tenant, cache salt, session id): what `sessions.SessionPins` keys a session by."""
        assert self.session_id is not None
        return self.tenant, self.cache_salt, self.session_id

    def input_problem(self, vocab_size: int, context_length: int, max_total_tokens: int) -> str | None:
        """Why the model cannot run this request as sent (the request's 400), or None."""
        n = len(self.prompt_ids)
        try:
            check_token_budget(n, self.params.max_new_tokens, context_length, max_total_tokens)
        except TokenBudgetError as e:
            return str(e)
        if max(self.prompt_ids) >= vocab_size or min(self.prompt_ids) < 0:
            return f"input token ids must be in [0, {vocab_size})"
        if self.logprob_start_len >= n:
            return f"logprob_start_len ({self.logprob_start_len}) must be < the prompt length ({n})"
        bad_stops = [t for t in self.params.stop_token_ids if t >= vocab_size]
        if bad_stops:
            return f"stop_token_ids must be in [0, {vocab_size}) (the vocabulary), got {bad_stops[:5]}"
        return self.params.logit_bias_problem(vocab_size)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        """The newest token (what a decode step feeds), without building `all_ids`."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_slice(self, start: int, end: int) -> list[int]:
        """`all_ids[start:end]` without concatenating the prompt and the output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def cache_key(self, n: int) -> list[int]:
        """The radix cache's key for the first `n` tokens. With a salt every id is shifted by an offset
        drawn from the salt's hash (ids stay below 2**32), so two salts never share a key element and
        unsalted keys stay the plain token ids: salted requests share KV with their own salt only."""
        key = self.token_slice(0, n)
        if self.cache_salt is None:
            return key
        offset = _salt_offset(self.cache_salt)
        return [t + offset for t in key]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return (
            self.return_logprob
            and self.logprob_start_len >= 0
            and not self.sent.input_logprobs_done
            and not self.output_ids
        )

    def prefix_limit(self) -> int:
        """Longest prefix we may take from the cache: positions whose logits we must compute are excluded,
        and at least one token is always recomputed so the last logits exist."""
        limit = self.seq_len - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(0, self.logprob_start_len - 1))
        return max(0, limit)

    def finish(self, reason: dict[str, Any]) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason
