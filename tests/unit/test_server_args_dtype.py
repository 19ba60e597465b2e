"""--dtype auto: bfloat16 on CUDA and on CPUs with native bf16 dot products, float32 on other CPUs."""

import pytest

from runtime import platform
from runtime.platform import cpu_flags, cpu_has_native_bf16
from runtime.server_args import ServerArgs


@pytest.mark.parametrize(
    "flags,want",
    [
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
        ({"avx2", "amx_bf16", "amx_tile"}, "bfloat16"),
        ({"avx2", "avx512f", "avx512_vnni"}, "float32"),
        (set(), "float32"),  # no /proc/cpuinfo: the safe choice
    ],
)
def test_auto_dtype_follows_cpu_flags(monkeypatch, flags, want):
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset(flags))
    args = ServerArgs(device="cpu", quantization="none").resolve()  # auto's picks: test_quantization_auto
    assert args.dtype == want
    assert args.quantization == "none"


def test_explicit_dtype_is_kept(monkeypatch):
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert ServerArgs(device="cpu", dtype="float32").resolve().dtype == "float32"


@pytest.mark.parametrize("quant", ["int8", "int4", "w8a8"])
def test_explicit_quantization_makes_auto_dtype_float32(monkeypatch, quant):
    """The quantized CPU kernels take float32 activations, so `auto` must not pick bf16 under them."""
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    args = ServerArgs(device="cpu", quantization=quant).resolve()
    assert (args.dtype, args.quantization) == ("float32", quant)


def test_this_machine_flags_are_read():
    flags = cpu_flags()
    assert isinstance(flags, frozenset)
    assert cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


AMX = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize(
    "flags,dtype,kv,want",
    [
        # CPU, float32 math: half-precision K/V (measured: quant_accuracy_kv.json); bfloat16 where the
        # attention kernel multiplies it on AMX tiles, else float16
        ({"avx2", "avx512f", "avx512_bf16"}, "float32", "auto", "float16"),
        (AMX, "float32", "auto", "bfloat16"),
        (set(), "float32", "auto", "float16"),
        (AMX, "bfloat16", "auto", "bfloat16"),
        (AMX, "float32", "float32", "float32"),
        (AMX, "float32", "float16", "float16"),
        (set(), "float32", "bfloat16", "bfloat16"),
    ],
)
def test_kv_cache_dtype_auto_on_the_cpu(monkeypatch, flags, dtype, kv, want):
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset(flags))
    args = ServerArgs(device="cpu", dtype=dtype, quantization="none", kv_cache_dtype=kv).resolve()
    assert args.kv_cache_dtype == want
    assert args.resolve().kv_cache_dtype == want  # idempotent: the scheduler resolves again


def test_kv_cache_dtype_is_a_choice():
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        ServerArgs(kv_cache_dtype="int3")
