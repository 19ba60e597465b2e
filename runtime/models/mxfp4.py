"""MXFP4 (OCP Microscaling, FP4 E2M1 elements with one E8M0 scale per 32): repacked to ggml's blocks, or
dequantized at load.

gpt-oss checkpoints store each expert projection as `<name>_blocks` (uint8 [..., G, 16]: 32 FP4 values of a
block, two per byte, the element at the even index in the low nibble) and `<name>_scales` (uint8 [..., G]:
the block's power-of-two exponent, biased by 127). Element i of block g is fp4(nibble) * 2**(scale - 127).
A row of K inputs is G = K / 32 blocks, so the dequantized tensor is [..., G * 32], rows as stored (for
gpt-oss: [experts, out_features, in_features]).

Two ways to serve them (gpt-oss, `runtime.models.gpt_oss`):
- kept as blocks (`--quantization mxfp4`, what `auto` picks for an MXFP4 checkpoint on the CPU:
  `quantization.is_mxfp4_checkpoint`):
  `to_ggml_blocks` moves the same bits into ggml's MXFP4 block (type 39: the exponent byte, then 16 bytes
  whose low nibbles are elements 0..15 and high nibbles 16..31), which the GGUF block kernels
  (csrc/gguf_gemm.cpp) and the fused MoE op read with int8 activations per block of 32 (on AVX512-VNNI
  after one more move into their 16-row interleaved layout): 17 bytes per 32 weights, as in the checkpoint;
- dequantized (`dequantize_mxfp4`, `--quantization none`, and every device but the CPU): float weights, 4x
  the MXFP4 bytes in bfloat16, 8x in float32.
"""

from __future__ import annotations

import torch

BLOCK = 32  # elements per scale
GGML_MXFP4 = 39  # ggml's type id (GGMLQuantizationType.MXFP4): 1 exponent byte + 16 nibble bytes per 32
E8M0_NAN = 255  # the exponent byte that means NaN: refused wherever blocks are loaded
ROWS_PER_CHUNK = 1024  # rows dequantized at a time (gpt-oss-20b: 1024 x 2880 values, ~24 MB of int64 codes)


def e2m1_values() -> torch.Tensor:
    """The 16 FP4 E2M1 values by code, float32, from the format's bits: sign (bit 3), a 2-bit exponent with
    bias 1 (bits 2-1), a 1-bit mantissa (bit 0); exponent 0 is subnormal (0.5 * mantissa)."""
    values = []
    for code in range(16):
        sign = -1.0 if code & 0b1000 else 1.0
        exp, man = (code >> 1) & 0b11, code & 1
        magnitude = 0.5 * man if exp == 0 else 2.0 ** (exp - 1) * (1.0 + 0.5 * man)
        values.append(sign * magnitude)
    return torch.tensor(values, dtype=torch.float32)


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless blocks uint8 [..., G, 16] and scales uint8 [..., G] hold no NaN scale (255)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            f"(want blocks [..., G, {BLOCK // 2}] and scales [..., G])"
        )
    if bool((scales == E8M0_NAN).any()):
        raise ValueError("MXFP4 scale 255 (NaN) in a checkpoint")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype` (exact: every value is
    a 2-bit-mantissa float times a power of two). Scale 255 (E8M0's NaN) is refused."""
    _check(blocks, scales)
    lut = e2m1_values().to(blocks.device)
    lead = tuple(scales.shape[:-1])
    rows_b, rows_s = blocks.reshape(-1, *blocks.shape[-2:]), scales.reshape(-1, scales.shape[-1])
    out = torch.empty(rows_s.shape[0], rows_s.shape[1] * BLOCK, dtype=dtype, device=blocks.device)
    for a in range(0, rows_s.shape[0], ROWS_PER_CHUNK):  # bounded temporaries (int64 codes, float32 values)
        b = min(a + ROWS_PER_CHUNK, rows_s.shape[0])
        chunk = rows_b[a:b]
        codes = torch.stack((chunk & 0x0F, chunk >> 4), dim=-1).long()  # [n, G, 16, 2]: low nibble first
        values = lut[codes].flatten(-2)  # [n, G, 32] float32
        exps = (rows_s[a:b].to(torch.int32) - 127).unsqueeze(-1).float()
        out[a:b] = torch.ldexp(values, exps).flatten(-2).to(dtype)  # exact in float32 (|exp| <= 127)
    return out.reshape(*lead, -1)


def to_ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A checkpoint's MXFP4 blocks uint8 [..., G, 16] (element 2i in the low nibble of byte i, 2i + 1 in the
    high one) and scales uint8 [..., G] -> ggml's MXFP4 rows uint8 [..., G * 17] (per block the exponent,
    then element j < 16 in the low nibble of byte j and j + 16 in its high nibble): the same bits moved,
    so `gguf.quants.dequantize` of the result equals `dequantize_mxfp4` of the input. Scale 255 (NaN) is
    refused."""
    _check(blocks, scales)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1], BLOCK // 2 + 1, dtype=torch.uint8)
    rows_b, rows_s = blocks.reshape(-1, *blocks.shape[-2:]), scales.reshape(-1, scales.shape[-1])
    flat = out.view(-1, *out.shape[-2:])
    for a in range(0, rows_s.shape[0], ROWS_PER_CHUNK):  # bounded temporaries
        b = min(a + ROWS_PER_CHUNK, rows_s.shape[0])
        chunk = rows_b[a:b]
        codes = torch.stack((chunk & 0x0F, chunk >> 4), dim=-1).flatten(-2)  # [n, G, 32] in element order
        flat[a:b, :, 0] = rows_s[a:b]
        flat[a:b, :, 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.flatten(-2)
