"""Helpers shared by the Triton attention launchers."""

from __future__ import annotations

import torch
import triton

LOG2E = 1.4426950408889634  # kernels use exp2, so scores are pre-scaled by log2(e)


def block_d(head_dim: int) -> int:
    """Padded head dim: a power of two, and at least 16 because tl.dot needs every dim >= 16."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs would silently use TF32 tensor cores on NVIDIA; ask for IEEE so fp32 means fp32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def log2_scale(scaling: float) -> float:
    return scaling * LOG2E


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
