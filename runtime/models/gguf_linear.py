"""A linear layer over a GGUF file's own quantized blocks (`--quantization gguf_native`, the default for a
GGUF file).

`GGUFLinear` holds each part of a (possibly fused) projection as the file's bytes, a uint8 tensor [rows, row
bytes] that is a view of the memory-mapped file where the rows need no reordering, and computes y = x @ W^T in
one call of `radixlm::gguf_linear` (csrc/gguf_gemm.cpp): every part's blocks are unpacked row by row and
multiplied by int8 activations quantized per block of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4) or 256
(Q2_K..Q6_K), llama.cpp's arithmetic for the same file. Parts may differ in type (a Q4_K_M file's attn_v is
Q6_K beside Q4_K q and k). `reference_dequantize` is gguf-py's dequantization, the kernel's test oracle.

On the AVX512-VNNI build, Q4_K, Q5_K and Q6_K parts (and Q8_0 with $RADIXLM_GGUF_INTERLEAVE=all) are instead
repacked once at construction into the kernel's interleaved layout (`interleave`): the same bits moved so
that 16 rows' blocks lie side by side, a copy of the same size in anonymous memory (on transparent huge pages
where allowed). The mapped file's pages those parts were read from are then referenced by nothing of the
layer's (once the loader drops its reader the mapping goes), so resident memory stays about the file's size
after load; during the load a part's file pages and its copy are both resident. `file_parts` gives the bytes
back in the file's layout. Measured on a 2-core Zen 4 (bench/results/gguf_kernels_*.json): 2048 x 8192 at one
activation row, Q4_K 0.44 -> 0.21 ms, Q6_K 0.50 -> 0.33 ms, on a par with w4a8's Q4_1; 2-3x at 16-64 rows.

The kernel is built on first use (~20 s on 2 cores) and cached like radixlm's other C++ kernels
(runtime/models/native_kernels.py: `LIBRARY` below).
"""

from __future__ import annotations

import ctypes
import logging
import os
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from runtime.models.mxfp4 import E8M0_NAN, GGML_MXFP4
from runtime.models.native_kernels import KernelUnavailable, NativeLibrary
from runtime.models.parallel import TensorParallel

logger = logging.getLogger("radixlm.gguf_linear")

SOURCE = Path(__file__).parent / "csrc" / "gguf_gemm.cpp"
PORTABLE_ENV = "RADIXLM_GGUF_GEMM_PORTABLE"  # 1: build the scalar loop (tests compare it with the vector one)
AVX2_ENV = "RADIXLM_GGUF_GEMM_AVX2"  # 1: build the AVX2 path on an AVX-512 CPU

# GGML type id -> (name, elements per block, bytes per block): the types the kernel reads in place
KERNEL_TYPES = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    39: ("MXFP4", 32, 17),  # gpt-oss's experts (runtime/models/mxfp4.py repacks a checkpoint's blocks to it)
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}  # served as float32 tensors
# Added to a GGML type id: the part's bytes are in the kernel's interleaved layout (groups of GROUP_ROWS rows
# side by side, the same bits moved, same shape; csrc/gguf_gemm.cpp), which the AVX512-VNNI build multiplies
# 2-3x faster at 1-4 activation rows than the file's layout. Types with that layout:
INTERLEAVED = 256
INTERLEAVED_TYPES = (8, 12, 13, 14, 39)  # Q8_0, Q4_K, Q5_K, Q6_K, MXFP4
GROUP_ROWS = 16
# What GGUFLinear interleaves unless told: the K types and MXFP4 (2880 x 2880 on 2 threads from DRAM, one
# activation row: 0.146 ms interleaved against 0.201 in the file's layout; 4 rows 0.32 against 0.54:
# `python -m bench.gguf_kernels --rows 2880 --cols 2880 --batch 1 2 4 8 --copies 48 --types MXFP4`). Q8_0,
# as fast at one row either way, stays the mapped file's bytes (no copy) unless $RADIXLM_GGUF_INTERLEAVE is
# "all"; "0" keeps every type in the file's layout (A/B measurements).
DEFAULT_INTERLEAVED = (12, 13, 14, 39)
INTERLEAVE_ENV = "RADIXLM_GGUF_INTERLEAVE"


def default_interleaved() -> tuple[int, ...]:
    """The types GGUFLinear interleaves unless told (see DEFAULT_INTERLEAVED and INTERLEAVE_ENV)."""
    return {"0": (), "all": INTERLEAVED_TYPES}.get(os.environ.get(INTERLEAVE_ENV, ""), DEFAULT_INTERLEAVED)


_LIB = torch.library.Library("radixlm", "FRAGMENT")
_LIB.define("gguf_linear(Tensor x, Tensor[] ws, int[] types) -> Tensor")
_LIB.define("gguf_rows(Tensor w, int type, Tensor ids, int cols) -> Tensor")
_LIB.define("gguf_repack(Tensor w, int type, bool inverse) -> Tensor")


@torch.library.register_fake("radixlm::gguf_linear", lib=_LIB)
def _gguf_linear_fake(x, ws, types):
    return x.new_empty(x.shape[0], sum(w.shape[0] for w in ws))


@torch.library.register_fake("radixlm::gguf_rows", lib=_LIB)
def _gguf_rows_fake(w, type, ids, cols):
    return w.new_empty(ids.shape[0], cols, dtype=torch.float32)


@torch.library.register_fake("radixlm::gguf_repack", lib=_LIB)
def _gguf_repack_fake(w, type, inverse):
    return torch.empty_like(w)


_isa = ""


def _read_isa(path: Path) -> None:
    global _isa
    fn = ctypes.CDLL(str(path)).radixlm_gguf_gemm_isa
    fn.restype = ctypes.c_char_p
    _isa = fn().decode()
    logger.info("GGUF block kernels built for %s", _isa)
    if _isa == "scalar":
        logger.warning(
            "the GGUF block kernels run their scalar loop here (no AVX512-VNNI or AVX2): correct, but "
            "several times slower than the vector paths"
        )


LIBRARY = NativeLibrary(
    "gguf_gemm",
    SOURCE,
    "the GGUF block kernels",
    "use --quantization none (the file dequantized to float32 at load)",
    flag_envs={PORTABLE_ENV: "-DRADIXLM_PORTABLE", AVX2_ENV: "-DRADIXLM_FORCE_AVX2"},
    on_load=_read_isa,
)
_OP = torch.ops.radixlm.gguf_linear.default
_ROWS = torch.ops.radixlm.gguf_rows.default
_REPACK = torch.ops.radixlm.gguf_repack.default


def load_kernels() -> Path:
    """Build (once per cache key) and load the kernel library. Raises KernelUnavailable."""
    return LIBRARY.load()


def kernel_isa() -> str:
    """The path the loaded library was compiled for: "avx512_vnni", "avx2" or "scalar"."""
    load_kernels()
    return _isa


def interleave(qtype: int, w: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(kernel type, bytes) for the part `w` (uint8 [rows, row bytes] in the file's layout): the interleaved
    layout where this build has its kernels and the type has one (and there is at least one whole group of
    rows), else `w` as it is. The result is a copy of the same size: the caller drops `w`."""
    if qtype not in INTERLEAVED_TYPES or w.shape[0] < GROUP_ROWS or kernel_isa() != "avx512_vnni":
        return qtype, w
    return qtype + INTERLEAVED, _REPACK(w.contiguous(), qtype, False)


def file_layout(qtype: int, w: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(GGML type, bytes in the file's layout) of a part as `interleave` left it (a copy where it moved)."""
    if qtype & INTERLEAVED:
        return qtype - INTERLEAVED, _REPACK(w, qtype - INTERLEAVED, True)
    return qtype, w


def check_blocks(qtype: int, w: torch.Tensor, what: str) -> None:
    """Refuse blocks the kernels would turn into NaN: an MXFP4 block whose exponent byte is 255 (the kernels
    do not test it per block). One pass over the exponent bytes, at load."""
    if qtype == GGML_MXFP4 and w.numel():
        exponents = w.reshape(-1, KERNEL_TYPES[GGML_MXFP4][2])[:, 0]
        bad = int((exponents == E8M0_NAN).sum())
        if bad:
            raise ValueError(f"{what}: {bad} MXFP4 block(s) with exponent 255 (NaN)")


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes of one row of `cols` elements of kernel type `qtype`; ValueError when not whole blocks."""
    name, block, size = KERNEL_TYPES[qtype]
    if cols % block:
        raise ValueError(f"{name} rows must hold whole blocks of {block} elements, got {cols}")
    return cols // block * size


def tensor_rows(t: Any) -> torch.Tensor:
    """A GGUF reader tensor's bytes as uint8 [rows, row bytes], every dim but the innermost counted as rows:
    a view of the memory-mapped file."""
    rows = int(t.n_elements) // int(t.shape[0])  # GGUF lists dims innermost first
    data = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
    with warnings.catch_warnings():  # the mapping is read-only; nothing here writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def dequantize_tensor(t: Any) -> torch.Tensor:
    """A GGUF reader tensor as float32 in Hugging Face's shape ([out, in] for matrices): by the C++ row op
    where it has the type (gguf-py's values, bit for bit; gguf-py's numpy takes ~7 s per 1e9 weights), else,
    or where the kernels cannot be built, by gguf-py."""
    shape = [int(d) for d in reversed(t.shape)]
    qtype = int(t.tensor_type)
    if qtype in KERNEL_TYPES:
        try:
            return dequantize_rows(tensor_rows(t), qtype, shape[-1]).reshape(shape)
        except KernelUnavailable:
            pass
    rows = int(t.n_elements) // shape[-1]
    return reference_dequantize(np.asarray(t.data).view(np.uint8), qtype, rows, shape[-1]).reshape(shape)


def reference_dequantize(raw: np.ndarray | torch.Tensor, qtype: int, rows: int, cols: int) -> torch.Tensor:
    """gguf-py's float32 dequantization of a tensor's bytes, [rows, cols] (the kernel's oracle)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = raw.numpy() if isinstance(raw, torch.Tensor) else raw
    w = dequantize(np.ascontiguousarray(data).reshape(-1), GGMLQuantizationType(qtype))
    return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(rows, cols).copy())


class GGUFLinear(nn.Module):
    """Drop-in for `nn.Linear` (y = x W^T + b) over GGUF blocks: `parts` is a list of (GGML type id, uint8
    [rows, row bytes]) fused along the output dim; `bias` float32 [sum of rows] or None. Parts of the types
    `interleaved` (default: `default_interleaved()`) are repacked into the kernel's interleaved layout where
    this build serves it (`interleave`: a copy of the same size, so the file's pages they were read from are
    no longer referenced); the others stay as given (views of the mapped file).

    `reduce_tp` is never set: a GGUF layer is loaded whole (tensor parallelism is refused at load)."""

    reduce_tp: TensorParallel | None = None

    def __init__(
        self,
        in_features: int,
        parts: list[tuple[int, torch.Tensor]],
        bias: torch.Tensor | None = None,
        interleaved: Collection[int] | None = None,
    ):
        super().__init__()
        load_kernels()
        self.in_features = in_features
        if interleaved is None:
            interleaved = default_interleaved()
        self.types = []  # the kernel's type per part: the GGML id (+ INTERLEAVED where repacked)
        for i, (qtype, w) in enumerate(parts):
            if qtype not in KERNEL_TYPES:
                raise ValueError(f"GGUFLinear: GGML type {qtype} has no kernel")
            if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[1] != row_bytes(qtype, in_features):
                raise ValueError(
                    f"GGUFLinear part {i}: expected uint8 [rows, {row_bytes(qtype, in_features)}], got "
                    f"{w.dtype} {list(w.shape)}"
                )
            check_blocks(int(qtype), w, f"GGUFLinear part {i}")
            kernel_type, w = interleave(int(qtype), w) if int(qtype) in interleaved else (int(qtype), w)
            self.types.append(kernel_type)
            # buffers (not a list) so .to(), state_dict and the memory count see them
            self.register_buffer(f"w{i}", w.contiguous(), persistent=False)
        self.n_parts = len(parts)
        self.out_features = sum(int(w.shape[0]) for _, w in parts)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.kind = "+".join(sorted({KERNEL_TYPES[t & ~INTERLEAVED][0] for t in self.types}))

    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"w{i}") for i in range(self.n_parts)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"GGUFLinear takes float32 activations, got {x.dtype}")
        flat = x.dim() != 2
        x2 = x.reshape(-1, self.in_features) if flat else x
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = _OP(x2, self.weights(), self.types)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features) if flat else y

    def decode_call(self) -> tuple:
        """(fn, args) with `fn(x, *args) == forward(x)` for contiguous 2-D float32 x: the op with the blocks
        bound, so the fused loop skips this module's Python (`LlamaForCausalLM._layer_plan`)."""
        if self.bias is not None:
            return self.forward, ()
        return _OP, (self.weights(), self.types)

    def file_parts(self) -> list[tuple[int, torch.Tensor]]:
        """The parts as given: (GGML type, uint8 [rows, row bytes] in the file's layout)."""
        return [file_layout(t, w) for t, w in zip(self.types, self.weights(), strict=True)]

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in]: gguf-py's dequantization of the blocks (what the kernel multiplies by)."""
        return torch.cat(
            [reference_dequantize(w, t, w.shape[0], self.in_features) for t, w in self.file_parts()]
        )

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}"


def dequantize_rows(w: torch.Tensor, qtype: int, cols: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (all when None) of the blocks `w` (uint8 [rows, row bytes]) as float32 [n, cols], in C++
    (gguf-py's values to float32 rounding; ~50x faster than gguf-py's numpy)."""
    load_kernels()
    if ids is None:
        ids = torch.arange(w.shape[0])
    return _ROWS(w, qtype, ids, cols)


class GGUFEmbedding(nn.Module):
    """A token embedding kept as the file's blocks (uint8 [vocab, row bytes]): each lookup dequantizes the
    rows it reads, so the table costs its file size, not 4 bytes a weight. `qtype` may name the interleaved
    layout (a tied head's part, shared: `GGUFLinear.types[0]`, `w0`)."""

    def __init__(self, qtype: int, w: torch.Tensor, dim: int):
        super().__init__()
        load_kernels()
        row_bytes(qtype & ~INTERLEAVED, dim)  # whole blocks
        self.qtype, self.embedding_dim, self.num_embeddings = int(qtype), dim, int(w.shape[0])
        self.register_buffer("w", w.contiguous(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = _ROWS(
            self.w, self.qtype, flat if flat.dtype == torch.int64 else flat.long(), self.embedding_dim
        )
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{KERNEL_TYPES[self.qtype & ~INTERLEAVED][0]}, {self.num_embeddings}, {self.embedding_dim}"


def quantize_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """The kernel's activations for x [M, K] float32, dequantized: per row and block, qa * da with da =
    max|x| / 127 and qa = round(x / da) (half to even), the same float32 operations as the C++ code."""
    m, k = x.shape
    g = x.float().reshape(m, k // block, block)
    da = g.abs().amax(-1) / 127.0
    inv = torch.where(da != 0, 1.0 / da, torch.zeros_like(da))
    qa = torch.round(g * inv[..., None]).clamp_(-127, 127)
    return (qa * da[..., None]).reshape(m, k)
