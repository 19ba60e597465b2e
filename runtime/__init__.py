"""radixlm serving runtime. `from runtime import Engine` for offline use; `radixlm serve` for HTTP."""

from __future__ import annotations

__all__ = ["Engine", "ServerArgs", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: importing `runtime` for a dataclass must not pull in torch and ZMQ.
    if name == "Engine":
        from runtime.engine import Engine

        return Engine
    if name == "ServerArgs":
        from runtime.server_args import ServerArgs

        return ServerArgs
    if name == "SamplingParams":
        from runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
