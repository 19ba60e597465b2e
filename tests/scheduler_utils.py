"""A real `Scheduler` in the test process, for tests that drive it step by step (no sockets)."""

from __future__ import annotations

from runtime.managers.scheduler.scheduler import Scheduler
from runtime.server_args import ServerArgs


def make_scheduler(model_dir: str, tokenizer, **kw) -> Scheduler:
    """float32 on the CPU with torch_native attention (token-exact comparisons), no status log lines, an
    8192-slot KV pool unless `max_total_tokens` says otherwise, no speculation (tests count steps and tokens
    per step; tests/unit/test_speculative.py turns it on); `kw` overrides any ServerArgs field."""
    pinned = {
        "dtype": "float32",
        "quantization": "none",
        "kv_cache_dtype": "float32",
        "device": "cpu",
        "log_interval": 0,
        "attention_backend": "torch_native",
        "max_total_tokens": 8192,
        "speculative_algorithm": "none",
    }
    args = ServerArgs(model=model_dir, **{**pinned, **kw})
    return Scheduler(args, model_dir, tokenizer=tokenizer)
