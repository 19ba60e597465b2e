"""`--quantization w4a8`: GGUF's Q4_1 / Q8_0 blocks times int8 activations, as llama.cpp computes them.

Why: a batch-1 decode step is bound by reading weights. w8a8 (fbgemm) reads one byte per weight, 134 MB a
token for SmolLM2-135M; the GGUF file's own Q4_1 layers and Q8_0 head read ~96 MB, and llama.cpp decodes
them with int8 activations quantized per block of 32. This module runs the same arithmetic in a small C++
kernel (csrc/w4a8_gemm.cpp: AVX512-VNNI, else AVX2, else a scalar loop; `kernel_isa()` says which) behind
two ops, `radixlm::q4_1_linear` and `radixlm::q8_0_linear`, opaque calls to inductor, so
`--enable-torch-compile` still gives one graph.

Weights: the linear layers are Q4_1 (w = q*d + m, q in 0..15, fp16 d and m per block of 32 inputs) and the LM
head is Q8_0 (w = q*d, q int8). With a GGUF model (`--model default`) the file's blocks are used byte for byte
where they are Q4_1 / Q8_0; otherwise the fp32 weights are quantized here the way llama.cpp's quantizer does.
Activations: per row and block of 32, a = qa * da with da = max|a| / 127, qa rounded half to even.

The kernel is built on first use (~10 s on 2 cores) and cached like radixlm's other C++ kernels
(runtime/models/native_kernels.py: `LIBRARY` below).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
from torch import nn

from runtime.models.native_kernels import KernelUnavailable as KernelUnavailable  # re-exported
from runtime.models.native_kernels import NativeLibrary
from runtime.models.parallel import TensorParallel

logger = logging.getLogger("radixlm.w4a8")

QK = 32  # elements per block
GROUP_ROWS = 16  # weight rows interleaved per group: one 512-bit register of outputs, or two 256-bit (AVX2)
SOURCE = Path(__file__).parent / "csrc" / "w4a8_gemm.cpp"
# Set one to 1 to build the scalar loop, or the AVX2 path on an AVX512 CPU (tests check all agree).
PORTABLE_ENV = "RADIXLM_W4A8_PORTABLE"
AVX2_ENV = "RADIXLM_W4A8_AVX2"

_LIB = torch.library.Library("radixlm", "FRAGMENT")
_LIB.define("q4_1_linear(Tensor x, Tensor qs, Tensor d, Tensor m, int out_features) -> Tensor")
_LIB.define("q8_0_linear(Tensor x, Tensor qs, Tensor d, int out_features) -> Tensor")


@torch.library.register_fake("radixlm::q4_1_linear", lib=_LIB)
def _q4_1_fake(x, qs, d, m, out_features):
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("radixlm::q8_0_linear", lib=_LIB)
def _q8_0_fake(x, qs, d, out_features):
    return x.new_empty(x.shape[0], out_features)


# ----------------------------------------------------------------------------------------------- the build
_isa = ""


def _read_isa(path: Path) -> None:
    """Ask the loaded library which path it was compiled for (a forced or cross-built library is never
    mistaken for what the CPU flags suggest), and warn when it is the scalar loop."""
    global _isa
    isa_fn = ctypes.CDLL(str(path)).radixlm_w4a8_isa
    isa_fn.restype = ctypes.c_char_p
    _isa = isa_fn().decode()
    logger.info("w4a8 kernels built for %s", _isa)
    if _isa == "scalar":
        logger.warning(
            "w4a8 runs its scalar loop here (built without AVX512-VNNI or AVX2): it is correct but "
            "several times slower than the vectorised kernel; --quantization w8a8 is faster here"
        )


LIBRARY = NativeLibrary(
    "w4a8_gemm",
    SOURCE,
    "the w4a8 kernel",
    "use --quantization w8a8",
    flag_envs={PORTABLE_ENV: "-DRADIXLM_PORTABLE", AVX2_ENV: "-DRADIXLM_FORCE_AVX2"},
    on_load=_read_isa,
)


def load_kernels() -> Path:
    """Build (once per cache key) and load the kernel library; returns its path. Raises KernelUnavailable."""
    return LIBRARY.load()


# The ops' overloads, resolved once: a call through `torch.ops.radixlm.q4_1_linear` looks the overload up
# every time, which at decode (120 GEMV calls a step) is measurable.
_Q4_1 = torch.ops.radixlm.q4_1_linear.default
_Q8_0 = torch.ops.radixlm.q8_0_linear.default


def kernel_isa() -> str:
    """The path the loaded kernel library was compiled for: "avx512_vnni", "avx2" or "scalar"."""
    load_kernels()
    return _isa


# ----------------------------------------------------------------------------------------------- quantizers
def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1 of w [N, K]: (q uint8 [N, K] in 0..15, d fp16 [N, K/32], m fp16 [N, K/32]);
    d = (max - min) / 15 and m = min per block, q = round((w - min) / d)."""
    n, k = _check_blocks(w)
    g = w.detach().float().reshape(n, k // QK, QK)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((g - lo[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), d.half(), lo.half()


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 of w [N, K]: (q int8 [N, K], d fp16 [N, K/32]); d = max|w| / 127 per block."""
    n, k = _check_blocks(w)
    g = w.detach().float().reshape(n, k // QK, QK)
    d = g.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k), d.half()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel does to x [M, K] fp32: (qa fp32 [M, K/32, 32] of integers, da fp32 [M, K/32])."""
    m, k = x.shape
    g = x.reshape(m, k // QK, QK)
    da = g.abs().amax(-1) / 127.0
    inv = torch.where(da != 0, 1.0 / da, torch.zeros_like(da))
    return torch.round(g * inv[..., None]), da


def _check_blocks(w: torch.Tensor) -> tuple[int, int]:
    n, k = w.shape
    if k % QK:
        raise ValueError(f"w4a8 needs in_features divisible by the block size {QK}, got {k}")
    return n, k


# ----------------------------------------------------------------------------------------------- layout
def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    extra = -t.shape[0] % GROUP_ROWS
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def _interleave(t: torch.Tensor, quads: int) -> torch.Tensor:
    """[N, K/32, quads, 4] bytes -> the kernel's [groups, K/32 * quads * 16 * 4]: per group and block,
    quad j of each of the group's 16 rows side by side."""
    t = _pad_rows(t)
    g = t.shape[0] // GROUP_ROWS
    t = t.reshape(g, GROUP_ROWS, t.shape[1], quads, 4).permute(0, 2, 3, 1, 4)
    return t.reshape(g, -1).contiguous()


def _uninterleave(t: torch.Tensor, n: int, nb: int, quads: int) -> torch.Tensor:
    g = t.shape[0]
    t = t.reshape(g, nb, quads, GROUP_ROWS, 4).permute(0, 3, 1, 2, 4)
    return t.reshape(g * GROUP_ROWS, nb, quads, 4)[:n]


def interleave_scales(d: torch.Tensor) -> torch.Tensor:
    """fp16 [N, K/32] -> [groups, K/32 * 16]: per group and block, the 16 rows' scales side by side."""
    d = _pad_rows(d)
    g = d.shape[0] // GROUP_ROWS
    return d.reshape(g, GROUP_ROWS, -1).permute(0, 2, 1).reshape(g, -1).contiguous()


def _uninterleave_scales(d: torch.Tensor, n: int) -> torch.Tensor:
    g = d.shape[0]
    return d.reshape(g, -1, GROUP_ROWS).permute(0, 2, 1).reshape(g * GROUP_ROWS, -1)[:n]


def pack_q4_1(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> interleaved GGUF nibble bytes (byte j of a block: element j | j+16 << 4)."""
    n, k = q.shape
    b = q.to(torch.uint8).reshape(n, k // QK, QK)
    return _interleave((b[..., :16] | (b[..., 16:] << 4)).reshape(n, k // QK, 4, 4), 4)


def pack_q8_0(q: torch.Tensor) -> torch.Tensor:
    """q int8 [N, K] -> interleaved q + 128 as uint8."""
    n, k = q.shape
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    return _interleave(u.reshape(n, k // QK, 8, 4), 8)


# ----------------------------------------------------------------------------------------------- the layer
class W4A8Linear(nn.Module):
    """Drop-in for `nn.Linear` (y = x W^T + b) over Q4_1 (kind "q4_1") or Q8_0 (kind "q8_0") weight blocks.

    Buffers: qs uint8 [groups, ...] (interleaved blocks), d / m fp16 [groups, K/32 * 16] (m: Q4_1 only).
    `reduce_tp` (set when replacing a `RowParallelLinear`) sums the ranks' partial outputs before the bias.
    """

    reduce_tp: TensorParallel | None = None

    def __init__(
        self,
        kind: str,
        q: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        if kind not in ("q4_1", "q8_0") or (m is None) != (kind == "q8_0"):
            raise ValueError(f"W4A8Linear takes kind q4_1 (with mins) or q8_0 (without), got {kind!r}")
        load_kernels()
        self.kind = kind
        self.out_features, self.in_features = _check_blocks(q)
        self.register_buffer("qs", pack_q4_1(q) if kind == "q4_1" else pack_q8_0(q))
        self.register_buffer("d", interleave_scales(d.to(torch.float16)))
        self.register_buffer("m", None if m is None else interleave_scales(m.to(torch.float16)))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_float(cls, kind: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> W4A8Linear:
        if kind == "q4_1":
            return cls("q4_1", *quantize_q4_1(weight), bias=bias)
        return cls("q8_0", *quantize_q8_0(weight), bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"W4A8Linear takes float32 activations, got {x.dtype}")
        flat = x.dim() != 2  # the model's [tokens, features] activations skip the reshapes (decode hot path)
        x2 = x.reshape(-1, self.in_features) if flat else x
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.kind == "q4_1":
            y = _Q4_1(x2, self.qs, self.d, self.m, self.out_features)
        else:
            y = _Q8_0(x2, self.qs, self.d, self.out_features)
        if self.reduce_tp is not None:
            y = self.reduce_tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features) if flat else y

    def decode_call(self) -> tuple:
        """(fn, args) with `fn(x, *args) == forward(x)` for x contiguous [tokens, in_features] float32 (the op
        checks that): the op with this layer's blocks bound, so the fused loop skips this module's Python
        (`LlamaForCausalLM._layer_plan`). Just `forward` when a bias or a TP reduce applies."""
        if self.reduce_tp is not None or self.bias is not None:
            return self.forward, ()
        if self.m is not None:
            return _Q4_1, (self.qs, self.d, self.m, self.out_features)
        return _Q8_0, (self.qs, self.d, self.out_features)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The stored blocks in row order: (q [N, K] uint8 0..15 or int8, d fp16 [N, K/32], m or None)."""
        n, nb = self.out_features, self.in_features // QK
        d = _uninterleave_scales(self.d, n)
        m = None if self.m is None else _uninterleave_scales(self.m, n)
        if self.kind == "q4_1":
            b = _uninterleave(self.qs, n, nb, 4).reshape(n, nb, 16)
            q = torch.cat([b & 0x0F, b >> 4], dim=-1).reshape(n, -1)
        else:
            q = (_uninterleave(self.qs, n, nb, 8).reshape(n, -1).to(torch.int16) - 128).to(torch.int8)
        return q, d, m

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K] weight the kernel multiplies by: q*d + m (Q4_1) or q*d (Q8_0)."""
        q, d, m = self.blocks()
        n, k = q.shape
        w = q.float().reshape(n, k // QK, QK) * d.float()[..., None]
        if m is not None:
            w = w + m.float()[..., None]
        return w.reshape(n, k)

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}"
