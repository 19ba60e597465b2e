"""Prometheus metrics of the HTTP front end (a private registry, so several servers in one test process
do not collide)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "radixlm_requests_total", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.prompt_tokens = Counter("radixlm_prompt_tokens_total", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("radixlm_generation_tokens_total", "Tokens generated", registry=r)
        self.cached_tokens = Counter(
            "radixlm_cached_tokens_total", "Prompt tokens served from the radix cache", registry=r
        )
        self.cached_tokens_host = Counter(
            "radixlm_cached_tokens_host_total", "Prompt tokens loaded back from the host KV tier", registry=r
        )
        self.host_tier_used = Gauge(
            "radixlm_host_tier_used_tokens", "Tokens of KV held in the host tier", registry=r
        )
        self.host_tier_size = Gauge("radixlm_host_tier_tokens", "Host tier capacity in tokens", registry=r)
        self.cached_tokens_disk = Counter(
            "radixlm_cached_tokens_disk_total", "Prompt tokens loaded from the disk KV tier", registry=r
        )
        self.disk_tier_used = Gauge(
            "radixlm_disk_tier_used_bytes", "Bytes of KV files in --kv-disk-dir", registry=r
        )
        self.ttft = Histogram(
            "radixlm_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "radixlm_e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "radixlm_requests_in_flight", "Requests between arrival and response", registry=r
        )
        self.running = Gauge("radixlm_num_running_reqs", "Requests holding KV in the scheduler", registry=r)
        self.queued = Gauge("radixlm_num_queued_reqs", "Requests waiting in the scheduler", registry=r)
        self.token_usage = Gauge("radixlm_token_usage", "Share of the KV pool in use", registry=r)
        self.cache_hit_rate = Gauge("radixlm_cache_hit_rate", "Cached share of prompt tokens", registry=r)
        self.sessions_pinned = Gauge(
            "radixlm_sessions_pinned", "Sessions whose tokens are pinned in the prefix cache", registry=r
        )
        self.session_pinned_tokens = Gauge(
            "radixlm_session_pinned_tokens", "Tokens held by session pins (an upper bound)", registry=r
        )

        self.spec_accept_length = Gauge(
            "radixlm_spec_accept_length",
            "Speculative decoding: mean tokens per verified draft (accepted draft tokens + the sampled one)",
            registry=r,
        )
        self.spec_draft_seconds_per_step = Gauge(
            "radixlm_spec_draft_seconds_per_step",
            "Speculative decoding: drafting time per decode step",
            registry=r,
        )
        self.spec_verify_steps = Gauge(
            "radixlm_spec_verify_steps", "Speculative decoding: forwards that verified drafts", registry=r
        )
        self.spec_accepted_tokens = Gauge(
            "radixlm_spec_accepted_tokens", "Speculative decoding: draft tokens accepted", registry=r
        )

        self.scheduler_rss = Gauge(
            "radixlm_scheduler_rss_bytes", "Resident memory of the scheduler process", registry=r
        )
        self.scheduler_heap_free = Gauge(
            "radixlm_scheduler_heap_free_bytes",
            "Free memory the scheduler's C heap holds and has not returned to the system",
            registry=r,
        )
        self.memory_entries = Gauge(
            "radixlm_scheduler_memory_entries",
            "Entries of each scheduler structure that holds per-request or shared state",
            ["structure"],
            registry=r,
        )
        self.memory_bytes = Gauge(
            "radixlm_scheduler_memory_bytes",
            "Estimated bytes of each scheduler structure that holds per-request or shared state",
            ["structure"],
            registry=r,
        )
        self.memory_guard_sheds = Gauge(
            "radixlm_memory_guard_sheds",
            "Times the scheduler was over --memory-budget-mb and shed evictable structures",
            registry=r,
        )

    def on_request_start(self) -> None:
        self.in_flight.inc()

    def on_request_end(self, st: Any) -> None:
        self.in_flight.dec()
        outcome = st.finish_type if st.finished and st.finish_type != "abort" else "aborted"
        self.requests.labels(outcome="finished" if outcome != "aborted" else "aborted").inc()
        self.prompt_tokens.inc(st.prompt_tokens)
        self.generation_tokens.inc(len(st.output_ids))
        self.cached_tokens.inc(getattr(st, "cached_tokens", 0))
        self.cached_tokens_host.inc(getattr(st, "cached_tokens_host", 0))
        self.cached_tokens_disk.inc(getattr(st, "cached_tokens_disk", 0))
        if st.first_token_time is not None:
            self.ttft.observe(st.first_token_time - st.created)
        self.e2e.observe(time.perf_counter() - st.created)

    def render(self, scheduler_info: dict[str, Any] | None) -> bytes:
        if scheduler_info:
            self.running.set(scheduler_info.get("num_running_reqs", 0))
            self.queued.set(scheduler_info.get("num_queued_reqs", 0))
            self.token_usage.set(scheduler_info.get("token_usage", 0.0))
            self.cache_hit_rate.set(scheduler_info.get("cache_hit_rate", 0.0))
            self.sessions_pinned.set(scheduler_info.get("sessions_pinned", 0))
            self.session_pinned_tokens.set(scheduler_info.get("session_pinned_tokens", 0))
            self.host_tier_used.set(scheduler_info.get("host_tier_used_tokens", 0))
            self.host_tier_size.set(scheduler_info.get("host_tier_tokens", 0))
            self.disk_tier_used.set(scheduler_info.get("disk_tier_used_bytes", 0))
            self.spec_accept_length.set(scheduler_info.get("spec_accept_length", 0.0))
            self.spec_draft_seconds_per_step.set(scheduler_info.get("spec_draft_seconds_per_step", 0.0))
            self.spec_verify_steps.set(scheduler_info.get("spec_verify_steps", 0))
            self.spec_accepted_tokens.set(scheduler_info.get("spec_accepted_tokens", 0))
            self._set_memory(scheduler_info.get("memory") or {})
        return generate_latest(self.registry)

    def _set_memory(self, memory: dict[str, Any]) -> None:
        self.scheduler_rss.set(memory.get("rss_bytes", 0))
        self.scheduler_heap_free.set((memory.get("heap") or {}).get("heap_free_bytes", 0))
        self.memory_guard_sheds.set(memory.get("guard_sheds", 0))
        for name, entry in (memory.get("structures") or {}).items():
            self.memory_entries.labels(structure=name).set(entry.get("entries", 0))
            self.memory_bytes.labels(structure=name).set(entry.get("bytes", 0))
