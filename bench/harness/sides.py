"""The sides a comparison runs, one after another in the same process: radixlm variants and the HF baseline.

A side name is a variant of radixlm (`radixlm`, `radixlm-noradix`, `radixlm-fcfs`, `radixlm-nojf`, the grammar
backends `radixlm-outlines`, `radixlm-llguidance`, `radixlm-xgrammar`, and the
numerics variants `radixlm-fp32`, `radixlm-bf16`, `radixlm-w8a8`, `radixlm-w4a8`, `radixlm-int8`) or `hf`.
Each opens as a DSL backend plus a way to read its counters: the radixlm sides start an in-process
`runtime.Engine` (or talk to a running server with `--url`), `hf` loads `bench.harness.hf_backend.HFBackend`
on the same converted weights and dtype. Sides never overlap: one is closed (its processes gone) before the
next opens, so they compete for the same cores only with the rest of the machine.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from lang.backends.base import Backend
from runtime.models.quantization import QUANTIZATION_METHODS

# radixlm variants: Engine/ServerArgs overrides on top of the base options of the invocation.
RADIXLM_VARIANTS: dict[str, dict[str, Any]] = {
    "radixlm": {},
    "radixlm-noradix": {"disable_radix_cache": True},
    "radixlm-fcfs": {"schedule_policy": "fcfs"},
    "radixlm-nojf": {"disable_jump_forward": True},
    # grammar backends (the default, auto: llguidance for JSON then outlines-core; regexes on outlines-core)
    "radixlm-outlines": {"grammar_backend": "outlines"},
    "radixlm-llguidance": {"grammar_backend": "llguidance"},
    "radixlm-xgrammar": {"grammar_backend": "xgrammar"},
    # numerics variants: accuracy of a dtype / quantization on the same items in one invocation
    "radixlm-fp32": {"dtype": "float32", "quantization": "none", "kv_cache_dtype": "float32"},
    "radixlm-bf16": {"dtype": "bfloat16", "quantization": "none"},
    "radixlm-w8a8": {"dtype": "float32", "quantization": "w8a8"},
    "radixlm-w4a8": {"dtype": "float32", "quantization": "w4a8"},
    "radixlm-int8": {"dtype": "float32", "quantization": "int8"},
}
HF = "hf"
# Server counters whose change over a run is reported (see Scheduler.server_info,
# runtime.managers.scheduler.scheduler).
COUNTERS = (
    "prompt_tokens",
    "cached_tokens",
    "generated_tokens",
    "jump_forward_tokens",
    "extend_steps",
    "decode_steps",
    "retractions",
    "requests_finished",
)


def side_names(spec: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The sides of `spec`, checked; `extra` names further sides the caller handles (e.g. the peers)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for n in names:
        if n != HF and n not in RADIXLM_VARIANTS and n not in extra:
            raise ValueError(f"unknown side {n!r} (known: {', '.join([*RADIXLM_VARIANTS, HF, *extra])})")
    if len(set(names)) != len(names):
        raise ValueError(f"side listed twice in {spec!r}")
    return names


def add_side_args(p: argparse.ArgumentParser, default_sides: str) -> None:
    g = p.add_argument_group("sides")
    g.add_argument(
        "--sides",
        default=default_sides,
        help=f"comma-separated, run in this order: {', '.join([*RADIXLM_VARIANTS, HF])}",
    )
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both sides")
    g.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATION_METHODS,
        help="radixlm sides only (HF runs the unquantized weights)",
    )
    g.add_argument(
        "--max-total-tokens", type=int, default=30000, help="radixlm KV pool size (fp32: 46 KB a token)"
    )
    g.add_argument("--max-running-requests", type=int, default=64, help="radixlm decode batch limit")
    g.add_argument("--attention-backend", default="auto", help="radixlm attention backend")
    g.add_argument("--disable-radix-cache", action="store_true", help="applies to every radixlm side")
    g.add_argument("--schedule-policy", default="lpm", help="radixlm queue policy (every radixlm side)")
    g.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads on every side (0: all cores). On a loaded machine 1 can be much faster: "
        "OpenMP regions stall while a sibling thread is descheduled",
    )
    g.add_argument("--url", default=None, help="use this running radixlm server for the `radixlm` side")
    g.add_argument("--hf-max-batch-size", type=int, default=32, help="rows of one HF static batch")
    g.add_argument(
        "--hf-max-batch-tokens", type=int, default=8192, help="padded tokens of one HF scoring batch"
    )


def engine_args(args: argparse.Namespace, side: str) -> dict[str, Any]:
    base = {
        "dtype": args.dtype,
        "quantization": getattr(args, "quantization", "none"),
        "max_total_tokens": args.max_total_tokens,
        "max_running_requests": args.max_running_requests,
        "attention_backend": args.attention_backend,
        "disable_radix_cache": args.disable_radix_cache,
        "schedule_policy": args.schedule_policy,
        "log_level": "warning",
        "num_threads": args.threads or None,
    }
    return {**base, **RADIXLM_VARIANTS[side]}


@dataclass
class OpenSide:
    """An opened side: `backend` for programs, `counters()` for server statistics, `flush()`, `close()`."""

    name: str
    backend: Any
    open_seconds: float
    config: dict[str, Any] = field(default_factory=dict)
    _engine: Any = None
    _url: str | None = None

    @property
    def is_hf(self) -> bool:
        return self.name == HF

    def server_info(self) -> dict[str, Any]:
        if self._engine is not None:
            return self._engine.server_info()
        if self._url is not None:
            import requests

            return requests.get(self._url + "/get_server_info", timeout=30).json()
        return {"hf_" + k: v for k, v in self.backend.stats.items()}

    def counters(self) -> dict[str, float]:
        info = self.server_info()
        if self.is_hf:
            return dict(info)
        return {k: float(info.get(k, 0) or 0) for k in COUNTERS}

    def flush(self) -> None:
        """Empty the prefix cache so a measured run starts cold (warm-up results are not reused)."""
        if self._engine is not None:
            self._engine.flush_cache()
        elif self._url is not None:
            import requests

            requests.post(self._url + "/flush_cache", timeout=60)

    def close(self) -> None:
        self.backend.close()
        if self._engine is not None:
            self._engine.shutdown()


def open_side(name: str, args: argparse.Namespace, model: str = "default") -> OpenSide:
    from runtime.models.model_loader import resolve_model_path

    t0 = time.perf_counter()
    if name == HF:
        import torch

        from bench.harness.common import usable_cores
        from bench.harness.hf_backend import HFBackend

        torch.set_num_threads(args.threads or usable_cores())
        backend = HFBackend(
            resolve_model_path(model),
            dtype=args.dtype,
            max_batch_size=args.hf_max_batch_size,
            max_batch_tokens=args.hf_max_batch_tokens,
        )
        cfg = {
            "dtype": args.dtype,
            "max_batch_size": args.hf_max_batch_size,
            "max_batch_tokens": args.hf_max_batch_tokens,
            "batch_wait_s": backend.batch_wait_s,
            "torch_threads": torch.get_num_threads(),
        }
        return OpenSide(name, backend, time.perf_counter() - t0, cfg)
    if args.url:
        if name != "radixlm":
            raise ValueError(f"side {name!r} needs its own engine; with --url only `radixlm` can run")
        from lang import RuntimeEndpoint

        url = args.url.rstrip("/")
        return OpenSide(name, RuntimeEndpoint(url), time.perf_counter() - t0, {"url": url}, _url=url)
    from lang import EngineBackend
    from runtime import Engine

    kw = engine_args(args, name)
    engine = Engine(model=model, **kw)
    return OpenSide(name, EngineBackend(engine), time.perf_counter() - t0, kw, _engine=engine)


class Metered(Backend):
    """Wraps a backend and counts what programs asked of it (thread-safe); everything else is delegated."""

    def __init__(self, inner: Any):
        self.inner = inner
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.calls = {"gen": 0, "select": 0, "fork_prefill": 0}
            self.tokens = {"prompt": 0, "completion": 0, "cached": 0}

    def _count(self, kind: str, meta: dict[str, Any], completion: bool = True) -> None:
        with self._lock:
            self.calls[kind] += 1
            self.tokens["prompt"] += int(meta.get("prompt_tokens") or 0)
            self.tokens["cached"] += int(meta.get("cached_tokens") or 0)
            if completion:
                self.tokens["completion"] += int(meta.get("completion_tokens") or 0)

    def chat_template(self):
        return self.inner.chat_template()

    def generate(self, prompt, sampling):
        res = self.inner.generate(prompt, sampling)
        self._count("gen", res.meta_info)
        return res

    def generate_stream(self, prompt, sampling):
        last = None
        for last in self.inner.generate_stream(prompt, sampling):
            yield last
        if last is not None:
            self._count("gen", last.meta_info)

    def select(self, prompt, choices):
        res = self.inner.select(prompt, choices)
        self._count("select", res.meta_info, completion=False)
        return res

    def cache_prefix(self, prompt):
        with self._lock:
            self.calls["fork_prefill"] += 1
        return self.inner.cache_prefix(prompt)

    def close(self) -> None:
        self.inner.close()
