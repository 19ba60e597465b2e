"""`--quantization`: the methods there are, and where each can run (the layers: `quantized_linear`).

CPU decode is bound by reading weights (SmolLM2-135M: 540 MB of fp32 per step), so storing them as int8 or
int4 cuts the bytes read per step by 4x / ~7x; activations stay float32. Methods:

- none: the weights as loaded;
- int8 / int4: weight-only, torch's CPU kernels (int8 per output channel, int4 asymmetric groups of 32);
- w8a8: int8 per-channel weights and dynamic int8 activations, fbgemm's int8 GEMM;
- w4a8: llama.cpp's arithmetic, Q4_1 layers and Q8_0 LM head (the GGUF file's own blocks when there is one)
  times int8 activations per block of 32, in radixlm's C++ kernel (runtime/models/w4a8.py);
- gguf: the GGUF file's own Q4_1 blocks, run exactly by the int4 kernel (Q8_0 re-quantized per channel).

Measured cost (bench/quant_matmul.py, 2-core EPYC, torch 2.13): both weight-only kernels are slower than
fp32 `F.linear` (int8 2-18x, int4 5-23x at M=1..32, 1 thread), so they trade speed for memory here; w8a8's
int8 GEMM is 5.7-20x faster than fp32 over the model's shapes at M=1..32.

The default is `none`, for every model. There was an `auto` value, meant to pick the fastest mode within 1
MMLU point of fp32; the measurements (README "CPU numerics") settled it on `none` everywhere -- w8a8 and
w4a8 are within the point but change 5-13% of answers, and w8a8's depend on the batch -- so `auto` meant
`none` and was removed. This module imports only the standard library (torch lazily): `ServerArgs`
validates `--quantization` with it in processes that never load a model.
"""

from __future__ import annotations

import os

QUANTIZATION_METHODS = ("none", "int8", "int4", "gguf", "w8a8", "w4a8")


def check_supported(method: str, device: str, dtype: str) -> None:
    """Raise ValueError naming the problem when `method` cannot run on (device, dtype)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")
    if method == "none":
        return
    if device != "cpu":
        kernels = {
            "w8a8": "fbgemm's dynamic int8 linear",
            "w4a8": "radixlm's Q4_1 / Q8_0 CPU kernel",
        }.get(method, "torch's CPU weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu)")
        raise ValueError(
            f"--quantization {method} uses {kernels}; device {device!r} is not supported: "
            "use --quantization none"
        )
    if method == "w8a8":
        import torch

        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ValueError(
                "--quantization w8a8 needs torch's fbgemm quantized engine, which this torch build lacks "
                f"(engines: {torch.backends.quantized.supported_engines}): use --quantization none"
            )
    if dtype != "float32":
        raise ValueError(
            f"--quantization {method} needs --dtype float32 activations (got {dtype!r}): its CPU kernels "
            "take float32 activations, and only float32 is tested against the dequantized reference"
        )


def check_model(method: str, model: str) -> None:
    """Raise ValueError when `method` cannot use `--model` (gguf needs a GGUF file, not a folder)."""
    if method == "gguf" and model != "default" and os.path.isdir(model):
        raise ValueError(
            f"--quantization gguf needs a GGUF model, but {model!r} is a Hugging Face folder: "
            "use --quantization int8 or int4"
        )
