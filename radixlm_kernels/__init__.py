"""Attention backends behind one interface (`radixlm_kernels.base.AttentionBackend`), chosen by name.

`create_backend(name, ...)` resolves "auto" to the best backend available on this machine and raises a
clear error when an explicitly requested backend cannot run here. On the CPU "auto" is `cpu` (the C++
paged-attention op, which the runtime builds and loads first and which falls back to `torch_native` when it
cannot be built).
"""

from __future__ import annotations

import importlib.util

import torch

BACKENDS = ("torch_native", "cpu", "triton", "flashinfer")


def available_backends() -> list[str]:
    names = ["torch_native"]
    if importlib.util.find_spec("triton") is not None:
        from radixlm_kernels.triton_backend import triton_runs_here

        if triton_runs_here():
            names.append("triton")
    if torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None:
        names.append("flashinfer")
    return names


def resolve_backend_name(name: str, device: str) -> str:
    """'auto' -> flashinfer on NVIDIA, triton on a GPU where Triton runs, cpu on the CPU, torch_native
    otherwise."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    if name == "cpu" and device != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on the CPU only, not on device {device!r}")
    if name in ("torch_native", "cpu"):
        return name
    if name == "auto" and device == "cpu":
        return "cpu"
    if name == "auto" and device != "cuda":
        return "torch_native"
    avail = available_backends()
    if name == "auto":
        if device == "cuda":
            for cand in ("flashinfer", "triton"):
                if cand in avail:
                    return cand
        return "torch_native"
    if name not in avail:
        raise ValueError(
            f"attention backend {name!r} is not available on this machine (available: {', '.join(avail)})"
            + (
                "; flashinfer needs an NVIDIA GPU and `pip install radixlm[gpu]`"
                if name == "flashinfer"
                else ""
            )
            + (
                "; triton needs `pip install triton` and a GPU or TRITON_INTERPRET=1"
                if name == "triton"
                else ""
            )
        )
    return name


def create_backend(name: str, kv_pool, req_to_token_pool):
    if name == "torch_native":
        from radixlm_kernels.torch_native import TorchNativeBackend

        return TorchNativeBackend(kv_pool, req_to_token_pool)
    if name == "cpu":
        from radixlm_kernels.cpu_backend import CpuPagedBackend

        return CpuPagedBackend(kv_pool, req_to_token_pool)
    if name == "triton":
        from radixlm_kernels.triton_backend import TritonBackend

        return TritonBackend(kv_pool, req_to_token_pool)
    if name == "flashinfer":
        from radixlm_kernels.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(kv_pool, req_to_token_pool)
    raise ValueError(f"unknown attention backend {name!r}")
