"""--quantization w4a8: the C++ kernel computes llama.cpp's Q4_1 / Q8_0 x int8-activation arithmetic.

The reference is written here in float64 from the quantizers' outputs (not from the kernel's packed layout):
activations quantized per block of 32 exactly as the kernel does (same fp32 operations), times the
dequantized weight. Kernel and reference then differ only in fp32 summation order (~1e-6 relative).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from runtime.models.gguf import q4_1_blocks, q8_0_blocks
from runtime.models.quantization import check_supported
from runtime.models.w4a8 import (
    AVX2_ENV,
    PORTABLE_ENV,
    KernelUnavailable,
    W4A8Linear,
    kernel_isa,
    quantize_activations,
    quantize_q4_1,
    quantize_q8_0,
)
from runtime.platform import cpu_flags
from tests.unit.test_quantization import _run, _runner

TOL = dict(atol=1e-4, rtol=1e-5)


def reference_weight(kind: str, w: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] weight from the quantizer's (q, d[, m]) in row order."""
    n, k = w.shape
    if kind == "q4_1":
        q, d, m = quantize_q4_1(w)
        out = q.float().reshape(n, k // 32, 32) * d.float()[..., None] + m.float()[..., None]
    else:
        q, d = quantize_q8_0(w)
        out = q.float().reshape(n, k // 32, 32) * d.float()[..., None]
    return out.reshape(n, k)


def reference_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 product of the kernel's quantized activations and the fp32 weight w [N, K]."""
    qa, da = quantize_activations(x.reshape(-1, x.shape[-1]).float())
    a = (qa.double() * da.double()[..., None]).reshape(qa.shape[0], -1)
    y = a @ w.double().T
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*x.shape[:-1], w.shape[0])


class FakeQuantA8(nn.Module):
    """Reference layer: int8 activations per block of 32 (in fp64) times a fixed fp32 weight."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.w, self.b = w, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference_linear(x, self.w, self.b).float()


# ----------------------------------------------------------------------------------------------- layers
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
# rows: each register-held decode width (AVX2: 1-4), AVX512's partial and full 4-row tiles, AVX2's 32-row
# tiles plus a tail
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 40])
def test_layer_matches_reference(kind, rows):
    torch.manual_seed(rows)
    w, b = torch.randn(100, 96) * 0.05, torch.randn(100)  # 100 outputs: a partial group of 16
    layer = W4A8Linear.from_float(kind, w, b)
    x = torch.randn(rows, 1, 96) * 3  # leading dims are kept
    got = layer(x)
    want = reference_linear(x, reference_weight(kind, w), b)
    torch.testing.assert_close(got.double(), want, **TOL)
    # activations really are 8-bit: the result is not the fp32-activation product
    fp32_act = nn.functional.linear(x, reference_weight(kind, w), b)
    assert not torch.allclose(got, fp32_act, atol=1e-4)
    assert layer(torch.zeros(0, 96)).shape == (0, 100)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_decode_call_is_forward_on_2d_float32_input(kind):
    """The fused decode loop calls `decode_call`'s op directly: the same numbers as `forward`, and forward
    itself wherever a bias has to be added; an input the op cannot take is refused, not misread."""
    torch.manual_seed(1)
    w = torch.randn(100, 96) * 0.05
    layer = W4A8Linear.from_float(kind, w)
    fn, args = layer.decode_call()
    for rows in (1, 3, 33):
        x = torch.randn(rows, 96)
        assert torch.equal(fn(x, *args), layer(x))
    with pytest.raises(RuntimeError):
        fn(torch.randn(96, 3).t(), *args)  # not contiguous
    with_bias = W4A8Linear.from_float(kind, w, torch.randn(100))
    assert with_bias.decode_call() == (with_bias.forward, ())


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_layout_round_trips_and_quantizer_error_is_half_a_step(kind):
    torch.manual_seed(0)
    w = torch.randn(40, 64) * 0.1
    layer = W4A8Linear.from_float(kind, w)
    q, d, m = layer.blocks()
    want = quantize_q4_1(w) if kind == "q4_1" else (*quantize_q8_0(w), None)
    assert torch.equal(q, want[0]) and torch.equal(d, want[1])
    assert (m is None) == (kind == "q8_0") and (m is None or torch.equal(m, want[2]))
    torch.testing.assert_close(layer.dequantized_weight(), reference_weight(kind, w), atol=0, rtol=0)
    step = d.float().repeat_interleave(32, dim=1)
    # half a step, plus fp16 rounding of d and m (relative 2^-11 of the block's range)
    slack = 2e-3 * (w.abs().reshape(40, 2, 32).amax(-1).repeat_interleave(32, dim=1) + step)
    assert ((layer.dequantized_weight() - w).abs() <= step / 2 + slack).all()


def test_bad_inputs_are_named():
    layer = W4A8Linear.from_float("q4_1", torch.randn(16, 32))
    with pytest.raises(TypeError, match="float32 activations"):
        layer(torch.randn(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="divisible by the block size 32"):
        W4A8Linear.from_float("q8_0", torch.randn(8, 48))
    with pytest.raises(ValueError, match="kind q4_1"):
        W4A8Linear("int4", torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 1))
    with pytest.raises(RuntimeError, match="in_features"):
        torch.ops.radixlm.q4_1_linear(torch.randn(1, 64), layer.qs, layer.d, layer.m, 16)
    with pytest.raises(ValueError, match="radixlm's Q4_1 / Q8_0 CPU kernel; device 'cuda'"):
        check_supported("w4a8", "cuda", "float32")
    with pytest.raises(ValueError, match="needs --dtype float32"):
        check_supported("w4a8", "cpu", "bfloat16")


def integer_case(kind: str) -> tuple[W4A8Linear, torch.Tensor, torch.Tensor]:
    """(layer, x, exact y) where every scale is 1 and each activation block's max |x| is 127, so da = 1, the
    kernel's result is its int32 block dots summed in fp32 (exact below 2^24) and must equal the integer
    product. Rows of +-127 against weights at the ends of their ranges (15; -128 and 127) make the largest
    partial sums: they would saturate an int16 lane if the AVX2 path summed them there."""
    torch.manual_seed(5)
    n, k = 100, 128
    if kind == "q4_1":
        q = torch.randint(0, 16, (n, k))
        q[:5] = 15
        layer = W4A8Linear("q4_1", q.to(torch.uint8), torch.ones(n, k // 32), torch.zeros(n, k // 32))
    else:
        q = torch.randint(-128, 128, (n, k))
        q[:5], q[5:10] = -128, 127
        q[10:15] = torch.where(torch.arange(k) % 2 == 0, -128, 127)
        layer = W4A8Linear("q8_0", q.to(torch.int8), torch.ones(n, k // 32))
    x = torch.randint(-127, 128, (9, k)).float()
    x[:, ::32] = 127
    x[0], x[1] = 127, -127
    x[2] = torch.where(torch.arange(k) % 2 == 0, 127.0, -127.0)
    return layer, x, x.double() @ q.double().T


def expected_isa(env: dict[str, str]) -> str:
    """The path a -march=native build of the kernel takes on this CPU under the build variables `env`."""
    flags = cpu_flags()
    if env.get(PORTABLE_ENV) == "1":
        return "scalar"
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags and env.get(AVX2_ENV) != "1":
        return "avx512_vnni"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar"


def test_native_kernel_takes_the_widest_path_and_its_block_dots_are_exact():
    assert kernel_isa() == expected_isa(dict(os.environ))
    for kind in ("q4_1", "q8_0"):
        layer, x, want = integer_case(kind)
        torch.testing.assert_close(layer(x).double(), want, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------- the build
def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )


@pytest.mark.model  # builds the C++ kernel three times
def test_every_build_gives_the_same_numbers(tmp_path):
    """The native build, the AVX2 one (forced past AVX512) and the scalar loop share one layout: same block
    dots (exactly, on integer_case) and the same results up to fp32 summation order."""
    code = """
        import torch
        from runtime.models.w4a8 import W4A8Linear, kernel_isa
        from tests.unit.test_w4a8 import integer_case
        torch.manual_seed(0)
        x = torch.randn(6, 128) * 2
        kinds = ("q4_1", "q8_0")
        layers = [W4A8Linear.from_float(k, torch.randn(50, 128) * 0.05, torch.randn(50)) for k in kinds]
        ys = [layer(x[:m]) for layer in layers for m in (1, 3, 6)]  # decode widths and a tile
        exact = [(layer(xi), want) for layer, xi, want in map(integer_case, kinds)]
        torch.save((kernel_isa(), ys, exact), "{out}")
    """
    builds = {
        "native": {PORTABLE_ENV: "0", AVX2_ENV: "0"},
        "avx2": {PORTABLE_ENV: "0", AVX2_ENV: "1"},
        "scalar": {PORTABLE_ENV: "1", AVX2_ENV: "0"},
    }
    outs = {}
    for name, env in builds.items():
        out = tmp_path / f"{name}.pt"
        done = _python(code.replace("{out}", str(out)), **env)
        assert done.returncode == 0, done.stderr[-2000:]
        isa, ys, exact = torch.load(out)
        assert isa == expected_isa(env), name
        for got, want in exact:
            torch.testing.assert_close(got.double(), want, atol=0, rtol=0)
        outs[name] = ys
    for name in ("avx2", "scalar"):
        for got, native in zip(outs[name], outs["native"], strict=True):
            torch.testing.assert_close(got, native, atol=1e-5, rtol=1e-5)


def test_missing_compiler_is_a_clear_error(tmp_path):
    done = _python(
        """
        import torch
        from runtime.models.w4a8 import KernelUnavailable, W4A8Linear
        try:
            W4A8Linear.from_float("q4_1", torch.randn(16, 32))
        except KernelUnavailable as e:
            print("ERROR:", e)
        """,
        CXX=str(tmp_path / "no-such-compiler"),
        RADIXLM_CACHE_DIR=str(tmp_path / "cache"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "could not run the C++ compiler" in done.stdout and "--quantization w8a8" in done.stdout
    assert issubclass(KernelUnavailable, RuntimeError)


# ----------------------------------------------------------------------------------------------- models
def test_model_matches_fake_quant_reference(tiny_model_dir):
    """A Hugging Face model (no GGUF file): layers are quantized here to Q4_1, the LM head to Q8_0."""
    quant, ref = _runner(tiny_model_dir, "w4a8"), _runner(tiny_model_dir)
    kinds = [m.kind for m in quant.model.modules() if isinstance(m, W4A8Linear)]
    assert kinds == ["q4_1"] * (4 * quant.config.num_layers) + ["q8_0"]
    for mod in list(ref.model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                kind = "q8_0" if child is ref.model.lm_head else "q4_1"
                setattr(mod, name, FakeQuantA8(reference_weight(kind, child.weight.data), child.bias))
    seqs = [list(range(5, 25)), [7, 100, 300, 2, 9]]
    got, want = _run(quant, seqs), _run(ref, seqs)
    torch.testing.assert_close(got, want, atol=5e-4, rtol=5e-4)
    plain = _run(_runner(tiny_model_dir), seqs)
    assert not torch.allclose(got, plain, atol=1e-5)  # quantization did change the numbers


def test_default_model_reads_the_files_own_blocks(default_model_dir):
    """With --model default the layers hold the GGUF file's Q4_1 bytes and the head its Q8_0 bytes."""
    import gguf

    from runtime.models.model_loader import default_gguf_path

    tensors = {t.name: t for t in gguf.GGUFReader(default_gguf_path()).tensors}
    runner = _runner(default_model_dir, "w4a8")
    layer = runner.model.layers[7]
    pairs = (
        (layer.self_attn.o_proj, "blk.7.attn_output.weight"),
        (layer.mlp.down_proj, "blk.7.ffn_down.weight"),
    )
    for mod, name in pairs:
        t = tensors[name]
        cols, rows = (int(v) for v in t.shape)
        q, d, m = (torch.from_numpy(a) for a in q4_1_blocks(t.data, rows, cols))
        got_q, got_d, got_m = mod.blocks()
        assert torch.equal(got_q, q) and torch.equal(got_d.float(), d) and torch.equal(got_m.float(), m)
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(rows, cols)
        assert np.array_equal(mod.dequantized_weight().numpy().view(np.uint32), want.view(np.uint32))
    head, t = runner.model.lm_head, tensors["token_embd.weight"]
    cols, rows = (int(v) for v in t.shape)
    q, d = (torch.from_numpy(a) for a in q8_0_blocks(t.data, rows, cols))
    got_q, got_d, _ = head.blocks()
    assert head.kind == "q8_0" and torch.equal(got_q, q) and torch.equal(got_d.float(), d)
    # the head over real embedding rows (large K = 576, 3072 row groups) matches the reference
    x = runner.model.embed_tokens.weight[:3]
    torch.testing.assert_close(head(x).double(), reference_linear(x, head.dequantized_weight()), **TOL)
