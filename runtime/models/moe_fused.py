"""The fused CPU mixture-of-experts op (csrc/moe_fused.cpp): a whole MoE MLP in one C++ call.

For T tokens routed top-k, the op groups the (token, choice) rows by expert, quantizes each token's
activation to int8 once, runs every hit expert's gate|up, SiLU(gate) * up, its down projection and the
weighted sum into the output, parallel over (expert, 16 output rows) with OpenMP, reading only the routed
experts' weights and running no Python per expert. It computes what `runtime.models.moe.grouped_moe_layers`
computes over the same blocks (that loop stays the reference, and the path for other devices), with the block
kernels of csrc/w4a8_gemm.cpp and csrc/gguf_gemm.cpp, compiled into this library from their sources.

Three ops, one per weight format, each behind a module `SparseMoeBlock` calls:
- `GGUFExperts`: a GGUF file's stacked ffn_{gate,up,down}_exps blocks ([E, rows, row bytes], any type the GGUF
  kernels read; Q4_K / Q5_K / Q6_K (and Q8_0 on request) in the interleaved layout, each expert's rows as if
  repacked on their own, where the build serves it, as `GGUFLinear` does); optionally with gate|up and down
  biases and gpt-oss's clamped SwiGLU in place of SiLU (`ExpertActivation`): gpt-oss's MXFP4 experts;
- `W4A8Experts`: w4a8's Q4_1 / Q8_0 layers stacked [E, groups, bytes] (the per-expert `W4A8Linear`s then
  hold views of the stacks: one copy in memory);
- `fused_float_moe`: float32 / bfloat16 stacked w13 / w2 (ATen matmuls per hit expert, from C++).

$RADIXLM_MOE_FUSED=0 turns the op off (`enabled()`): SparseMoeBlock then runs the Python loop.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from runtime.models.native_kernels import CSRC, NativeLibrary

ENABLE_ENV = "RADIXLM_MOE_FUSED"  # "0": SparseMoeBlock runs the per-expert Python loop
PORTABLE_ENV = "RADIXLM_MOE_FUSED_PORTABLE"  # 1: build the scalar loops (tests compare them)
AVX2_ENV = "RADIXLM_MOE_FUSED_AVX2"  # 1: build the AVX2 paths on an AVX-512 CPU
INCLUDED = (CSRC / "w4a8_gemm.cpp", CSRC / "gguf_gemm.cpp")  # compiled into this library


_LIB = torch.library.Library("radixlm", "FRAGMENT")
_LIB.define(
    "moe_gguf(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor gate, Tensor up, Tensor down, "
    "int[] types, Tensor? b13=None, Tensor? b2=None, str activation='silu', float alpha=0., float limit=0.) "
    "-> Tensor"
)
_LIB.define(
    "moe_w4a8(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor qs13, Tensor d13, Tensor? m13, "
    "Tensor qs2, Tensor d2, Tensor? m2, int inter) -> Tensor"
)
_LIB.define("moe_float(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor w13, Tensor w2) -> Tensor")


@torch.library.register_fake("radixlm::moe_gguf", lib=_LIB)
def _moe_gguf_fake(
    x,
    topk_weights,
    topk_ids,
    gate,
    up,
    down,
    types,
    b13=None,
    b2=None,
    activation="silu",
    alpha=0.0,
    limit=0.0,
):
    return torch.empty_like(x)


@torch.library.register_fake("radixlm::moe_w4a8", lib=_LIB)
def _moe_w4a8_fake(x, topk_weights, topk_ids, qs13, d13, m13, qs2, d2, m2, inter):
    return torch.empty_like(x)


@torch.library.register_fake("radixlm::moe_float", lib=_LIB)
def _moe_float_fake(x, topk_weights, topk_ids, w13, w2):
    return torch.empty_like(x)


class _FusedLibrary(NativeLibrary):
    """The library's cache key also covers the kernel sources it includes (a -D of their digest)."""

    def compile_command(self) -> list[str]:
        command = super().compile_command()
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in INCLUDED)).hexdigest()[:16]
        return [command[0], f"-DRADIXLM_MOE_INCLUDED={digest}", *command[1:]]


LIBRARY = _FusedLibrary(
    "moe_fused",
    CSRC / "moe_fused.cpp",
    "the fused MoE kernel",
    f"set {ENABLE_ENV}=0 (the per-expert loop)",
    flag_envs={PORTABLE_ENV: "-DRADIXLM_PORTABLE", AVX2_ENV: "-DRADIXLM_FORCE_AVX2"},
)
_GGUF = torch.ops.radixlm.moe_gguf.default
_W4A8 = torch.ops.radixlm.moe_w4a8.default
_FLOAT = torch.ops.radixlm.moe_float.default


def load_kernels() -> Path:
    """Build (once per cache key) and load the library. Raises KernelUnavailable."""
    return LIBRARY.load()


def enabled() -> bool:
    """Whether SparseMoeBlock uses the fused op on the CPU (unless $RADIXLM_MOE_FUSED is "0")."""
    return os.environ.get(ENABLE_ENV, "1") != "0"


def fused_float_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """`grouped_moe` in one C++ call (float32 or bfloat16 x, w13 [E, 2I, H], w2 [E, H, I] of x's dtype)."""
    load_kernels()
    return _FLOAT(x.contiguous(), topk_weights.float().contiguous(), topk_ids.long().contiguous(), w13, w2)


@dataclass(frozen=True)
class ExpertActivation:
    """An expert's activation of (gate, up): "silu" (silu(gate) * up) or "clamped_swiglu" (gpt-oss's: gate
    clamped above at `limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate))."""

    kind: str = "silu"
    alpha: float = 0.0
    limit: float = 0.0

    def __post_init__(self):
        if self.kind not in ("silu", "clamped_swiglu"):
            raise ValueError(f"expert activation is silu or clamped_swiglu, got {self.kind!r}")


class GGUFExperts(nn.Module):
    """A GGUF file's experts: `parts` = [(GGML type, uint8 [E, rows, row bytes])] for gate [E, I, ·], up
    [E, I, ·] and down [E, H, ·] (views of the mapped file). Parts of the types `interleaved` (default:
    `gguf_linear.default_interleaved()`) are repacked into the kernel's interleaved layout where this build
    serves it (a copy of the same size, each expert's rows as if repacked on their own); the others stay as
    given. `b13` (float32 [E, 2I]: gate's biases then up's) and `b2` ([E, H]) are optional biases;
    `activation` the expert's activation."""

    def __init__(
        self,
        parts: Sequence[tuple[int, torch.Tensor]],
        interleaved: Sequence[int] | None = None,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        activation: ExpertActivation = ExpertActivation(),
    ):
        super().__init__()
        from runtime.models import gguf_linear
        from runtime.models.gguf_linear import (
            GROUP_ROWS,
            KERNEL_TYPES,
            default_interleaved,
            interleave,
            row_bytes,
        )

        load_kernels()
        gguf_linear.load_kernels()  # `expert_calls` (the loop) runs its op
        if len(parts) != 3:
            raise ValueError(f"GGUFExperts takes gate, up and down parts, got {len(parts)}")
        interleaved = default_interleaved() if interleaved is None else interleaved
        (_, g), (_, u), (_, d) = parts
        if (
            g.dim() != 3
            or u.dim() != 3
            or u.shape[:2] != g.shape[:2]
            or d.dim() != 3
            or d.shape[0] != g.shape[0]
        ):
            raise ValueError(
                f"GGUFExperts: gate {list(g.shape)}, up {list(u.shape)}, down {list(d.shape)} are not "
                "[experts, rows, row bytes] of one expert count, gate and up of one row count"
            )
        self.num_experts, self.inter, self.hidden = int(g.shape[0]), int(g.shape[1]), int(d.shape[1])
        self.types: list[int] = []
        for i, (name, (qtype, w), cols) in enumerate(
            zip(("gate", "up", "down"), parts, (self.hidden, self.hidden, self.inter), strict=True)
        ):
            if int(qtype) not in KERNEL_TYPES:
                raise ValueError(f"GGUFExperts {name}: GGML type {qtype} has no kernel")
            if w.dtype != torch.uint8 or w.shape[2] != row_bytes(int(qtype), cols):
                raise ValueError(
                    f"GGUFExperts {name}: expected uint8 rows of {row_bytes(int(qtype), cols)} bytes, got "
                    f"{w.dtype} {list(w.shape)}"
                )
            gguf_linear.check_blocks(int(qtype), w, f"GGUFExperts {name}")
            kernel_type = int(qtype)
            experts, rows, rb = w.shape
            # All experts in one repack: one copy, on transparent huge pages where allowed (a torch.stack of
            # per-expert copies read slower: one layer's 256-token prefill on one thread 192 -> 129 ms). It
            # equals repacking each expert on its own (what `expert_calls` and the op assume) when the
            # experts' groups of 16 rows stay apart and each expert starts at the same offset mod 64 bytes
            # (which picks a chunk's piece order): rows a multiple of 16, rows * row bytes of 64. Rows a
            # multiple of 32, as every block type's dimensions are, meet both; other parts stay as given.
            if kernel_type in interleaved and rows % GROUP_ROWS == 0 and rows * rb % 64 == 0:
                kernel_type, flat = interleave(kernel_type, w.reshape(experts * rows, rb))
                w = flat.reshape(experts, rows, rb)
            self.types.append(kernel_type)
            self.register_buffer(f"w{i}", w.contiguous(), persistent=False)
        names = sorted({KERNEL_TYPES[t & 255][0] for t in self.types})
        self.kind = "+".join(names)
        for name, bias, shape in (
            ("b13", b13, (self.num_experts, 2 * self.inter)),
            ("b2", b2, (self.num_experts, self.hidden)),
        ):
            if bias is not None and tuple(bias.shape) != shape:
                raise ValueError(f"GGUFExperts {name}: expected {list(shape)}, got {list(bias.shape)}")
            self.register_buffer(
                name, None if bias is None else bias.detach().float().contiguous(), persistent=False
            )
        self.activation = activation

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        a = self.activation
        if a.kind == "silu" and self.b13 is None and self.b2 is None:
            return _GGUF(x, topk_weights, topk_ids, self.w0, self.w1, self.w2, self.types)
        return _GGUF(
            x, topk_weights, topk_ids, self.w0, self.w1, self.w2, self.types, self.b13, self.b2, a.kind,
            a.alpha, a.limit,
        )  # fmt: skip

    def expert_calls(self) -> list[tuple[Callable, Callable]]:
        """Per expert (gate|up, down) callables over the same bytes through `radixlm::gguf_linear` (what
        `grouped_moe_layers` runs: the reference) of SiLU experts without biases; ValueError for others."""
        from runtime.models.gguf_linear import _OP

        if self.activation.kind != "silu" or self.b13 is not None or self.b2 is not None:
            raise ValueError("GGUFExperts.expert_calls: the per-expert loop runs SiLU experts without biases")

        t = self.types
        return [
            (
                lambda x, e=e: _OP(x, [self.w0[e], self.w1[e]], t[:2]),
                lambda x, e=e: _OP(x, [self.w2[e]], t[2:]),
            )
            for e in range(self.num_experts)
        ]

    def extra_repr(self) -> str:
        return (
            f"{self.kind}, experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, "
            f"activation={self.activation.kind}, biases={self.b13 is not None}/{self.b2 is not None}"
        )


class W4A8Experts(nn.Module):
    """w4a8 experts stacked for the fused op, from per-expert (gate|up, down) `W4A8Linear` layers of one kind
    and no bias: their blocks are copied into [E, ...] stacks once and each layer's buffers become views of
    them, so the layers (the loop's reference) and the op share one copy. ValueError when the layers do not
    fit (a bias, mixed kinds, shapes that differ)."""

    def __init__(self, layers: Sequence[tuple[nn.Module, nn.Module]]):
        super().__init__()
        from runtime.models.w4a8 import W4A8Linear

        load_kernels()
        for gate_up, down in layers:
            for layer in (gate_up, down):
                if not isinstance(layer, W4A8Linear) or layer.bias is not None or layer.reduce_tp is not None:
                    raise ValueError("W4A8Experts takes W4A8Linear layers without bias or TP reduce")
        self.num_experts = len(layers)
        self.inter = layers[0][0].out_features // 2
        for part, name in ((0, "13"), (1, "2")):
            mods = [pair[part] for pair in layers]
            if len({(m.kind, m.out_features, m.in_features) for m in mods}) != 1:
                raise ValueError(f"W4A8Experts: the experts' w{name} layers differ in kind or shape")
            for buf in ("qs", "d", "m"):
                if getattr(mods[0], buf) is None:
                    self.register_buffer(f"{buf}{name}", None, persistent=False)
                    continue
                stacked = torch.stack([getattr(m, buf) for m in mods])
                self.register_buffer(f"{buf}{name}", stacked, persistent=False)
                for e, m in enumerate(mods):
                    setattr(m, buf, stacked[e])
        self.kind = layers[0][0].kind

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return _W4A8(
            x, topk_weights, topk_ids, self.qs13, self.d13, self.m13, self.qs2, self.d2, self.m2, self.inter
        )

    def extra_repr(self) -> str:
        return f"{self.kind}, experts={self.num_experts}, inter={self.inter}"
