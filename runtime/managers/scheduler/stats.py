"""The scheduler's counters (reported by /get_server_info and the bench harness) and its periodic log line."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("radixlm.scheduler")

COUNTERS = (
    "prompt_tokens",
    "cached_tokens",
    "generated_tokens",
    "extend_steps",
    "decode_steps",
    "mixed_decode_tokens",  # tokens running requests decoded inside a prefill pass (see Scheduler._riders)
    "retractions",
    "jump_forward_tokens",
    "requests_finished",
    "requests_aborted",
    "requests_timed_out",
    "requests_failed_internal",
    "requests_prioritized",  # requests that named a `priority` other than 0
    "priority_preemptions",  # running requests retracted for a waiting one of a lower `priority` value
    # host / disk tier: admissions put off because the pool had no room to load what a tier held past the
    # device match, and tokens a tier held that were recomputed anyway (no room would come: nothing else ran)
    "tier_load_waits",
    "tier_tokens_recomputed",
    # speculative decoding (runtime.managers.scheduler.speculative)
    "spec_draft_steps",  # decode steps in which drafts were looked for
    "spec_draft_seconds",  # time spent drafting and indexing finished sequences
    "spec_verify_steps",  # forwards that verified at least one draft
    "spec_verified_drafts",  # (request, draft) pairs verified
    "spec_draft_tokens",  # draft tokens verified
    "spec_accepted_tokens",  # draft tokens accepted
)


def new_counters() -> dict[str, float]:
    return dict.fromkeys(COUNTERS, 0)


class ThroughputLog:
    """Every `interval` seconds (0: never) one line: queue sizes, KV usage, cache hit rate, tokens/s."""

    def __init__(self, interval: float):
        self.interval = interval
        self._last = time.monotonic()
        self._tokens_at_last = 0

    def maybe_log(self, generated_tokens: float, busy: bool, info: Callable[[], dict[str, Any]]) -> None:
        now = time.monotonic()
        if self.interval <= 0 or now - self._last < self.interval:
            return
        tput = (generated_tokens - self._tokens_at_last) / (now - self._last)
        self._last, self._tokens_at_last = now, generated_tokens
        if not busy and tput == 0:
            return
        i = info()
        logger.info(
            "running %d, queued %d, token usage %.2f, cache hit rate %.1f%%, gen throughput %.1f tok/s",
            i["num_running_reqs"],
            i["num_queued_reqs"],
            i["token_usage"],
            100 * i["cache_hit_rate"],
            tput,
        )
