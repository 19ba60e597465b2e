"""The GGUF block kernels (runtime/models/csrc/gguf_gemm.cpp) against gguf-py's reference dequantization.

Each block type is checked on random blocks (any bytes with finite fp16 scales are a valid block; MXFP4's E8M0
exponents are drawn from 110..135, finite and far from float32's range) at 1, 2, 3, 4 and 37 activation rows:
the kernel's output equals the activations as the kernel quantizes them (mirrored in Python,
`quantize_activations`) times gguf-py's dequantized weight, to float32 summation error. Q4_K,
Q5_K, Q6_K and Q8_0 are checked in the file's layout and in the interleaved one the AVX512-VNNI build serves
them in (whole groups of 16 rows and a remainder; odd block counts). The scalar and AVX2 builds are compared
with the default one in a subprocess each.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf_linear = pytest.importorskip("runtime.models.gguf_linear")
from runtime.models.gguf_linear import (  # noqa: E402
    GROUP_ROWS,
    INTERLEAVED,
    INTERLEAVED_TYPES,
    KERNEL_TYPES,
    GGUFLinear,
    kernel_isa,
    quantize_activations,
    reference_dequantize,
)

# byte offsets of each type's fp16 scale fields within a block
SCALE_FIELDS = {
    2: (0,),
    3: (0, 2),
    6: (0,),
    7: (0, 2),
    8: (0,),
    10: (80, 82),
    11: (108,),
    12: (0, 2),
    13: (0, 2),
    14: (208,),
}
MXFP4 = 39  # its scale is one E8M0 exponent byte at offset 0, not an fp16 field
MXFP4_EXPONENTS = (110, 136)  # drawn from [110, 136): 2**-17 .. 2**8 (255 is E8M0's NaN)


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row bytes] of random blocks whose fp16 scales are finite (0.001..0.1, either sign)."""
    _, block, size = KERNEL_TYPES[qtype]
    rng = np.random.default_rng(seed + qtype)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    if qtype == MXFP4:
        raw[..., 0] = rng.integers(*MXFP4_EXPONENTS, size=(rows, cols // block), dtype=np.uint8)
    for off in SCALE_FIELDS.get(qtype, ()):
        scales = rng.uniform(0.001, 0.1, size=(rows, cols // block)) * rng.choice(
            [-1, 1], (rows, cols // block)
        )
        raw[..., off : off + 2] = scales.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def expected(
    x: torch.Tensor, w: torch.Tensor, qtype: int, rows: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exact product in float64 of the kernel's quantized activations and gguf-py's weight, a bound on
    float32 rounding: 1e-5 of the sum of absolute products)."""
    _, block, _ = KERNEL_TYPES[qtype]
    xq = quantize_activations(x, 256 if block == 256 else 32).double()
    ref = reference_dequantize(w, qtype, rows, cols).double()
    assert torch.isfinite(ref).all()
    return xq @ ref.T, 1e-5 * (xq.abs() @ ref.abs().T) + 1e-6


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: KERNEL_TYPES[t][0])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 37])
@pytest.mark.parametrize("interleaved", [False, True], ids=["file", "interleaved"])
def test_kernel_matches_reference(qtype: int, m: int, interleaved: bool) -> None:
    if interleaved and qtype not in INTERLEAVED_TYPES:
        pytest.skip("no interleaved layout for this type")
    rows, cols = 45, 512  # rows not a multiple of any tile; two super-blocks / sixteen blocks per row
    w = random_blocks(qtype, rows, cols)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    layer = GGUFLinear(cols, [(qtype, w)], interleaved=INTERLEAVED_TYPES if interleaved else ())
    assert bool(layer.types[0] & INTERLEAVED) == (interleaved and kernel_isa() == "avx512_vnni")
    y = layer(x)
    want, tol = expected(x, w, qtype, rows, cols)
    assert y.shape == (m, rows)
    err = (y.double() - want).abs()
    assert (err <= tol).all(), f"max error {err.max():.3g} over bound {tol[err > tol].min():.3g}"
    # and against the float product: only the activations' rounding apart (a loose, independent check)
    flt = x.double() @ reference_dequantize(w, qtype, rows, cols).double().T
    rel = (y.double() - flt).norm() / flt.norm()
    assert rel < 0.02, rel


def test_fused_parts_of_mixed_types_and_bias() -> None:
    cols = 256
    parts = [
        (12, random_blocks(12, 20, cols, 1)),
        (14, random_blocks(14, 7, cols, 2)),
        (8, random_blocks(8, 9, cols, 3)),
    ]
    bias = torch.randn(36)
    layer = GGUFLinear(cols, parts, bias)
    x = torch.randn(5, cols)
    y = layer(x)
    cols_done = 0
    for qtype, w in parts:
        want, tol = expected(x, w, qtype, w.shape[0], cols)
        got = (
            y[:, cols_done : cols_done + w.shape[0]].double()
            - bias[cols_done : cols_done + w.shape[0]].double()
        )
        assert ((got - want).abs() <= tol + 1e-5).all()
        cols_done += w.shape[0]
    fn, args = layer.decode_call()
    assert torch.equal(fn(x, *args), y)
    assert torch.allclose(
        layer.dequantized_weight(),
        torch.cat([reference_dequantize(w, t, w.shape[0], cols) for t, w in parts]),
    )


def test_zero_activations_and_bad_shapes() -> None:
    w = random_blocks(12, 8, 256)
    layer = GGUFLinear(256, [(12, w)])
    assert torch.equal(layer(torch.zeros(3, 256)), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="whole blocks"):
        GGUFLinear(100, [(12, w)])
    with pytest.raises(ValueError, match="expected uint8"):
        GGUFLinear(512, [(12, w)])
    with pytest.raises(TypeError, match="float32"):
        layer(torch.zeros(1, 256, dtype=torch.bfloat16))
    nan = random_blocks(MXFP4, 4, 64)
    nan[2, 17] = 255  # row 2's second block: E8M0's NaN exponent
    with pytest.raises(ValueError, match="1 MXFP4 block.*exponent 255"):
        GGUFLinear(64, [(MXFP4, nan)])


@pytest.mark.slow
@pytest.mark.parametrize("env", [gguf_linear.PORTABLE_ENV, gguf_linear.AVX2_ENV])
def test_other_builds_agree(env: str) -> None:
    """The scalar and AVX2 builds give the default build's outputs (to float32 summation order)."""
    code = (
        "import torch, sys\n"
        "sys.path.insert(0, 'tests/unit')\n"
        "from test_gguf_kernels import random_blocks\n"
        "from runtime.models.gguf_linear import GGUFLinear, KERNEL_TYPES, kernel_isa\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(3, 512)\n"
        "out = {t: GGUFLinear(512, [(t, random_blocks(t, 19, 512))])(x) for t in KERNEL_TYPES}\n"
        "odd = (2, 3, 6, 7, 8, 39)\n"
        "out |= {-t: GGUFLinear(96, [(t, random_blocks(t, 7, 96))])(x[:, :96]) for t in odd}\n"
        "torch.save((kernel_isa(), out), sys.argv[1])\n"
    )
    outs = {}
    for name, extra in (("default", {}), ("other", {env: "1"})):
        path = f"/tmp/gguf_kernels_{os.getpid()}_{name}.pt"
        subprocess.run(
            [sys.executable, "-c", code, path], check=True, env={**os.environ, **extra}, timeout=600
        )
        outs[name] = torch.load(path)
        os.unlink(path)
    isa_default, default = outs["default"]
    isa_other, other = outs["other"]
    assert (
        isa_other == ("scalar" if env == gguf_linear.PORTABLE_ENV else "avx2") != isa_default
        or isa_default == "avx2"
    )
    for t in default:  # t < 0: the odd block count
        assert torch.allclose(default[t], other[t], rtol=1e-4, atol=1e-4), KERNEL_TYPES[abs(t)][0]


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: KERNEL_TYPES[t][0])
def test_rows_dequantize_like_ggufpy(qtype: int) -> None:
    """The C++ unpacker (the embedding's lookup, float copies at load) gives gguf-py's values."""
    from runtime.models.gguf_linear import GGUFEmbedding, dequantize_rows

    w = random_blocks(qtype, 13, 512)
    ref = reference_dequantize(w, qtype, 13, 512)
    torch.testing.assert_close(dequantize_rows(w, qtype, 512), ref, rtol=1e-6, atol=1e-7)
    ids = torch.tensor([[3, 0], [12, 3]])
    emb = GGUFEmbedding(qtype, w, 512)
    torch.testing.assert_close(emb(ids), ref[ids], rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="out of range"):
        emb(torch.tensor([13]))


@pytest.mark.parametrize(
    "qtype", [t for t, v in KERNEL_TYPES.items() if v[1] == 32], ids=lambda t: KERNEL_TYPES[t][0]
)
@pytest.mark.parametrize("m", [1, 3, 5])
def test_odd_block_counts(qtype: int, m: int) -> None:
    """Rows of an odd number of 32-blocks: the register paths take blocks in pairs, the last one alone."""
    w = random_blocks(qtype, 21, 96)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(7))
    want, tol = expected(x, w, qtype, 21, 96)
    assert ((GGUFLinear(96, [(qtype, w)])(x).double() - want).abs() <= tol).all()


@pytest.mark.parametrize("qtype", INTERLEAVED_TYPES, ids=lambda t: KERNEL_TYPES[t][0])
@pytest.mark.parametrize("rows", [16, 37, 64])
def test_interleaved_layout(qtype: int, rows: int) -> None:
    """The interleaved layout moves bits only: back to the file's layout it gives the same bytes, the rows
    past the last whole group of 16 stay in place, and each row reads back (the embedding's lookup) as
    gguf-py's."""
    from runtime.models.gguf_linear import _REPACK, GGUFEmbedding, dequantize_rows

    if kernel_isa() != "avx512_vnni":
        pytest.skip("the interleaved layout is served by the AVX512-VNNI build only")
    block = KERNEL_TYPES[qtype][1]
    cols = 3 * block  # an odd block count: Q6_K's / Q8_0's chunks alternate their 64-byte alignment
    w = random_blocks(qtype, rows, cols, seed=rows)
    packed = _REPACK(w, qtype, False)
    whole = rows // GROUP_ROWS * GROUP_ROWS
    assert packed.shape == w.shape and not torch.equal(packed[:whole], w[:whole])
    assert torch.equal(packed[whole:], w[whole:])
    assert torch.equal(_REPACK(packed, qtype, True), w)
    ref = reference_dequantize(w, qtype, rows, cols)
    torch.testing.assert_close(dequantize_rows(packed, qtype + INTERLEAVED, cols), ref, rtol=1e-6, atol=1e-7)
    ids = torch.tensor([rows - 1, 0, 17 % rows, whole - 1])
    emb = GGUFEmbedding(qtype + INTERLEAVED, packed, cols)
    torch.testing.assert_close(emb(ids), ref[ids], rtol=1e-6, atol=1e-7)
    layer = GGUFLinear(cols, [(qtype, w)], interleaved=INTERLEAVED_TYPES)
    assert layer.types == [qtype + INTERLEAVED]
    assert torch.equal(layer.file_parts()[0][1], w)
    torch.testing.assert_close(layer.dequantized_weight(), ref)
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        want, tol = expected(x, w, qtype, rows, cols)
        err = (layer(x).double() - want).abs()
        assert (err <= tol).all(), f"m={m}: max error {err.max():.3g}"


def test_interleaved_parts_fused_with_file_layout() -> None:
    """A fused projection mixes interleaved parts (Q4_K, Q6_K of >= 16 rows: interleaved by default) with
    parts that stay in the file's layout (fewer rows than a group, a type without the layout, Q8_0 by
    default)."""
    cols = 512
    parts = [
        (12, random_blocks(12, 40, cols, 4)),
        (14, random_blocks(14, 8, cols, 5)),
        (14, random_blocks(14, 33, cols, 6)),
        (11, random_blocks(11, 20, cols, 7)),
        (8, random_blocks(8, 16, cols, 8)),
    ]
    layer = GGUFLinear(cols, parts)
    if kernel_isa() == "avx512_vnni":
        assert layer.types == [12 + INTERLEAVED, 14, 14 + INTERLEAVED, 11, 8]
    x = torch.randn(4, cols)
    y = layer(x)
    done = 0
    for qtype, w in parts:
        want, tol = expected(x, w, qtype, w.shape[0], cols)
        assert ((y[:, done : done + w.shape[0]].double() - want).abs() <= tol).all()
        done += w.shape[0]


def test_mxfp4_unpacks_every_code_and_exponent_edge() -> None:
    """MXFP4's u = 2 * e2m1 + 12 and scale 0.5 * 2**(e - 127) for all 16 codes, at the subnormal-scale
    exponents 0 and 1 and up to 2**100, equal gguf-py's values (w = ls * u - 12 * ls is exact)."""
    from runtime.models.gguf_linear import dequantize_rows

    codes = np.arange(16, dtype=np.uint8)
    qs = (codes | (codes[::-1] << 4)).astype(np.uint8)  # low nibbles 0..15, high nibbles 15..0
    exponents = [0, 1, 2, 100, 127, 130, 227]
    raw = np.stack([np.concatenate([[e], qs]).astype(np.uint8) for e in exponents])  # [7, 17]
    w = torch.from_numpy(raw)
    ref = reference_dequantize(w, MXFP4, len(exponents), 32)
    assert torch.equal(dequantize_rows(w, MXFP4, 32), ref)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    assert torch.equal(ref[2, :16], e2m1 * 2.0 ** (2 - 127))
    assert torch.equal(ref[4, 16:], e2m1.flip(0))


@pytest.mark.parametrize("interleaved", [False, True], ids=["file", "interleaved"])
def test_mxfp4_kernel_scales_at_the_exponent_edges(interleaved: bool) -> None:
    """The kernels' own MXFP4 scales (the interleaved path builds 16 rows' scales from their exponent bytes in
    float bits) at the subnormal exponents 0 and 1 and up to 2**100: each row of x @ W^T within the int8
    activations' error of the reference dequantization's."""
    exponents = [0, 1, 2, 3, 60, 100, 126, 127, 128, 129, 130, 150, 200, 220, 226, 227]  # 16 rows
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(16, 2, 17), dtype=np.uint8)
    raw[:, :, 0] = np.asarray(exponents, dtype=np.uint8)[:, None]
    w = torch.from_numpy(raw.reshape(16, 34))
    layer = GGUFLinear(64, [(MXFP4, w)], interleaved=INTERLEAVED_TYPES if interleaved else ())
    assert bool(layer.types[0] & INTERLEAVED) == (interleaved and kernel_isa() == "avx512_vnni")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    ref = reference_dequantize(w, MXFP4, 16, 64).double()
    want, got = x.double() @ ref.T, layer(x).double()
    rel = (got - want).norm(dim=0) / want.norm(dim=0)
    # int8 activations per block of 32 over 64 inputs: up to ~2% of a row's norm (0.021 measured on one draw)
    assert float(rel.max()) < 0.04, rel
