"""The fused CPU MoE op (runtime/models/moe_fused.py, csrc/moe_fused.cpp) against the per-expert Python loop
(`grouped_moe_layers` / `grouped_moe`) over the same weights, for every weight format it serves: GGUF
blocks (Q4_K / Q5_K / Q6_K / Q8_0 and the 32-blocks, MXFP4 included, in the file's layout and the
interleaved one, gate / up / down of mixed types as in a Q4_K_M file), w4a8 Q4_1 / Q8_0, float32 and
bfloat16; and gpt-oss's expert (MXFP4 blocks with gate|up and down biases, its clamped SwiGLU) against a
per-expert loop over the same blocks and, loosely, over their float dequantization. Routings: random, every
expert hit, some experts hit by nobody, all tokens on one expert; batch 1, 4 and 64, on 2 threads. The scalar
and AVX2 builds are compared with the default one in a subprocess each. SparseMoeBlock serves GGUF / w4a8 /
float experts through the op on the CPU, and the loop under $RADIXLM_MOE_FUSED=0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime.models import moe_fused
from runtime.models.gguf_linear import INTERLEAVED, INTERLEAVED_TYPES, interleave, kernel_isa
from runtime.models.moe import Routing, SparseMoeBlock, grouped_moe, grouped_moe_layers
from runtime.models.parallel import TensorParallel
from runtime.models.w4a8 import W4A8Linear

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_gguf_kernels import random_blocks  # noqa: E402

E, K_TOP = 8, 2
Q4_0, Q4_1, Q8_0, Q2_K, Q4_K, Q5_K, Q6_K, MXFP4 = 2, 3, 8, 10, 12, 13, 14, 39
ROUTINGS = ("random", "every", "unhit", "one")


@pytest.fixture(autouse=True)
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def routing(t: int, mode: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [t, k] float32, ids [t, k] int64), k distinct experts per row. every: the rows cover all E
    experts (from t * k >= E); unhit: experts 3 and 6 are nobody's; one: every row's first choice is 5."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K_TOP] for _ in range(t)])
    if mode == "every":
        ids = torch.stack([torch.tensor([(K_TOP * r + j) % E for j in range(K_TOP)]) for r in range(t)])
    elif mode == "unhit":
        keep = torch.tensor([0, 1, 2, 4, 5, 7])
        ids = torch.stack([keep[torch.randperm(len(keep), generator=gen)[:K_TOP]] for _ in range(t)])
    elif mode == "one":
        ids[:, 0] = 5
        ids[:, 1] = torch.where(ids[:, 1] == 5, torch.tensor(6), ids[:, 1])
    w = torch.rand(t, K_TOP, generator=gen) + 0.1
    return w / w.sum(1, keepdim=True), ids


def routing_cases(hidden: int):
    """(x [t, hidden] float32, weights, ids) at batch 1, 4 and 64 under every ROUTINGS mode (`every` only
    where the rows can cover all experts)."""
    for t in (1, 4, 64):
        for mode in ROUTINGS:
            if mode == "every" and t * K_TOP < E:
                continue
            w, ids = routing(t, mode, seed=t)
            yield torch.randn(t, hidden, generator=torch.Generator().manual_seed(t)), w, ids


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to float32 summation error (the same int8 dots; the sums taken in another order)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(want).all()
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5 * scale + 1e-6)


def file_parts(types: tuple[int, int, int], hidden: int, inter: int) -> list[tuple[int, torch.Tensor]]:
    """Random (type, uint8 [E, rows, row bytes]) gate [E, inter, ·], up and down [E, hidden, ·]."""
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    return [
        (t, torch.stack([random_blocks(t, rows, cols, seed=100 * i + e) for e in range(E)]))
        for i, (t, (rows, cols)) in enumerate(zip(types, shapes, strict=True))
    ]


def gguf_experts(types: tuple[int, int, int], hidden: int, inter: int, interleaved) -> moe_fused.GGUFExperts:
    return moe_fused.GGUFExperts(file_parts(types, hidden, inter), interleaved=interleaved)


GGUF_CASES = {
    "Q4_K_M": ((Q4_K, Q4_K, Q6_K), 256, 256),
    "Q5_K": ((Q5_K, Q5_K, Q5_K), 256, 512),
    "Q6_K": ((Q6_K, Q6_K, Q6_K), 512, 256),
    "Q8_0": ((Q8_0, Q8_0, Q8_0), 128, 96),
    "Q8_0+Q4_K": ((Q8_0, Q4_K, Q8_0), 256, 256),  # gate and up quantize x per 32 and per 256
    "Q4_0+Q4_1+Q2_K": ((Q4_0, Q4_1, Q2_K), 256, 256),
    "MXFP4": ((MXFP4, MXFP4, MXFP4), 256, 96),
}


@pytest.mark.parametrize("layout", ["file", "interleaved"])
@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_matches_the_loop(case: str, layout: str) -> None:
    types, hidden, inter = GGUF_CASES[case]
    parts = file_parts(types, hidden, inter)
    ex = moe_fused.GGUFExperts(parts, interleaved=() if layout == "file" else INTERLEAVED_TYPES)
    if layout == "interleaved":
        if kernel_isa() != "avx512_vnni":
            pytest.skip("the interleaved layout is built on AVX512-VNNI only")
        assert [t >= 256 for t in ex.types] == [t in INTERLEAVED_TYPES for t in types]
        # the experts repacked in one go hold what each expert's rows repacked on their own hold
        for i, (t, raw) in enumerate(parts):
            if t in INTERLEAVED_TYPES:
                for e in range(E):
                    assert torch.equal(getattr(ex, f"w{i}")[e], interleave(t, raw[e])[1])
    calls = ex.expert_calls()
    for x, w, ids in routing_cases(hidden):
        check(ex(x, w, ids), grouped_moe_layers(x, calls, w, ids))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_w4a8_matches_the_loop(kind: str) -> None:
    hidden, inter = 256, 96  # 2I = 192 and H = 256 rows: whole groups of 16; I = 3 blocks of 32
    gen = torch.Generator().manual_seed(1)
    layers = [
        (
            W4A8Linear.from_float(kind, torch.randn(2 * inter, hidden, generator=gen) * 0.05),
            W4A8Linear.from_float(kind, torch.randn(hidden, inter, generator=gen) * 0.05),
        )
        for _ in range(E)
    ]
    want_w13 = [a.dequantized_weight() for a, _ in layers]
    ex = moe_fused.W4A8Experts(layers)
    # the layers now hold views of the stacks: the same blocks, one copy
    assert all(a.qs.data_ptr() == ex.qs13[e].data_ptr() for e, (a, _) in enumerate(layers))
    assert all(torch.equal(a.dequantized_weight(), w) for (a, _), w in zip(layers, want_w13, strict=True))
    calls = [(a.forward, b.forward) for a, b in layers]
    for x, w, ids in routing_cases(hidden):
        check(ex(x, w, ids), grouped_moe_layers(x, calls, w, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_float_matches_the_loop(dtype: torch.dtype) -> None:
    hidden, inter = 64, 48
    gen = torch.Generator().manual_seed(2)
    w13 = (torch.randn(E, 2 * inter, hidden, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(E, hidden, inter, generator=gen) * 0.1).to(dtype)
    for x, w, ids in routing_cases(hidden):
        x = x.to(dtype)
        got, want = moe_fused.fused_float_moe(x, w13, w2, w, ids), grouped_moe(x, w13, w2, w, ids)
        if dtype == torch.float32:
            check(got, want)
        else:  # the same bf16 matmuls; rounded to bf16 at the end
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_no_tokens_and_bad_input() -> None:
    ex = gguf_experts((Q4_K, Q4_K, Q6_K), 256, 256, ())
    none = ex(torch.zeros(0, 256), torch.zeros(0, K_TOP), torch.zeros(0, K_TOP, dtype=torch.long))
    assert none.shape == (0, 256)
    w, ids = routing(2, "random")
    with pytest.raises(RuntimeError, match="outside"):
        ex(torch.zeros(2, 256), w, ids + E)
    with pytest.raises(RuntimeError, match="topk_ids must be contiguous int64"):
        ex(torch.zeros(2, 256), w, ids.int())
    with pytest.raises(RuntimeError, match="x must be a contiguous"):
        ex(torch.zeros(2, 512)[:, ::2], w, ids)
    with pytest.raises(RuntimeError, match="gate has shape"):
        ex(torch.zeros(2, 512), w, ids)
    nan = mxfp4_parts(64, 32)
    nan[2][1][E - 1, 0, 0] = 255  # the last expert's down: its first block's exponent is E8M0's NaN
    with pytest.raises(ValueError, match="GGUFExperts down: 1 MXFP4 block"):
        moe_fused.GGUFExperts(nan)
    with pytest.raises(ValueError, match="down: expected uint8 rows"):
        moe_fused.GGUFExperts([(Q4_K, ex.w0), (Q4_K, ex.w1), (Q6_K, ex.w0)], interleaved=())


@pytest.mark.parametrize("fmt", ["gguf", "w4a8", "float"])
def test_sparse_moe_block_serves_the_op(fmt: str, monkeypatch) -> None:
    """SparseMoeBlock on the CPU: the op by default, the loop under $RADIXLM_MOE_FUSED=0, same output."""
    hidden, inter = 256, 256
    block = SparseMoeBlock(hidden, inter, E, Routing(K_TOP, True), TensorParallel())
    gen = torch.Generator().manual_seed(3)
    block.gate_weight.data = torch.randn(E, hidden, generator=gen)
    block.w13.data = torch.randn(E, 2 * inter, hidden, generator=gen) * 0.05
    block.w2.data = torch.randn(E, hidden, inter, generator=gen) * 0.05
    if fmt == "gguf":
        block.use_fused_experts(gguf_experts((Q4_K, Q4_K, Q6_K), hidden, inter, None))
    elif fmt == "w4a8":
        block.quantize_experts(lambda w: W4A8Linear.from_float("q4_1", w))
        assert isinstance(block.fused, moe_fused.W4A8Experts)
    calls = []
    for name in ("gguf", "w4a8", "float"):  # count the op's calls (it still runs)
        op = getattr(moe_fused, f"_{name.upper()}")
        monkeypatch.setattr(
            moe_fused, f"_{name.upper()}", lambda *a, op=op, n=name: calls.append(n) or op(*a)
        )
    x = torch.randn(4, hidden, generator=gen)
    fused = block(x)
    assert calls == [fmt]
    monkeypatch.setenv(moe_fused.ENABLE_ENV, "0")
    check(fused, block(x))
    assert calls == [fmt]  # the loop ran: no further call of the op


@pytest.mark.parametrize("env", [moe_fused.PORTABLE_ENV, moe_fused.AVX2_ENV])
def test_other_builds_agree(env: str, tmp_path) -> None:
    """The scalar and AVX2 builds give the default build's outputs (the GGUF cases in the file's layout)."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_moe_fused import gguf_experts, routing, GGUF_CASES\n"
        "from runtime.models.moe_fused import W4A8Experts\n"
        "from runtime.models.w4a8 import W4A8Linear\n"
        "torch.manual_seed(0)\n"
        "outs = []\n"
        "for case in sorted(GGUF_CASES):\n"
        "    types, h, i = GGUF_CASES[case]\n"
        "    ex = gguf_experts(types, h, i, ())\n"
        "    w, ids = routing(5, 'random')\n"
        "    outs.append(ex(torch.randn(5, h, generator=torch.Generator().manual_seed(1)), w, ids))\n"
        "g = torch.Generator().manual_seed(1)\n"
        "def q(n, k):\n"
        "    return W4A8Linear.from_float('q4_1', torch.randn(n, k, generator=g) * 0.05)\n"
        "layers = [(q(192, 256), q(256, 96)) for _ in range(8)]\n"
        "w, ids = routing(5, 'random')\n"
        "outs.append(W4A8Experts(layers)(torch.randn(5, 256, generator=g), w, ids))\n"
        "torch.save(outs, sys.argv[1])\n"
    )
    repo = Path(__file__).parents[2]
    outs = {}
    for name, extra in (("default", {}), ("other", {env: "1"})):
        path = tmp_path / f"{name}.pt"
        environ = {**os.environ, **extra, "PYTHONPATH": str(repo)}
        done = subprocess.run(
            [sys.executable, str(script), str(path)], env=environ, cwd=repo, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outs[name] = torch.load(path)
    for got, want in zip(outs["other"], outs["default"], strict=True):
        check(got, want)


def mxfp4_parts(hidden: int, inter: int, seed: int = 0) -> list[tuple[int, torch.Tensor]]:
    """Random MXFP4 gate, up [E, inter, ·] and down [E, hidden, ·] with weights of gpt-oss's size: exponents
    119..124, so |w| <= 6 * 2**-4."""
    parts = file_parts((MXFP4, MXFP4, MXFP4), hidden, inter)
    gen = torch.Generator().manual_seed(seed)
    for _, w in parts:
        blocks = w.view(E, w.shape[1], -1, 17)
        blocks[..., 0] = torch.randint(119, 125, blocks.shape[:-1], generator=gen, dtype=torch.uint8)
    return parts


def swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of h [n, 2I] (gate | up), as GptOssMoe.swiglu computes it."""
    inter = h.shape[1] // 2
    gate, up = h[:, :inter].clamp(max=limit), h[:, inter:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_loop(x, w, ids, gate_up, down, b13, b2, act) -> torch.Tensor:
    """sum over (token, choice) of weight * (down(act(gate_up(x) + b13[e])) + b2[e]), expert by expert."""
    from runtime.models.moe import _expert_groups

    out = torch.zeros(x.shape, dtype=torch.float32)
    for e, rows, weights in _expert_groups(w, ids, E):
        h = gate_up(e, x.index_select(0, rows)) + b13[e]
        out.index_add_(0, rows, (down(e, act(h)) + b2[e]) * weights)
    return out


@pytest.mark.parametrize("activation", ["silu", "clamped_swiglu"])
def test_gpt_oss_experts_match_the_loop(activation: str) -> None:
    """gpt-oss's expert over MXFP4 blocks: biases on gate|up and down, its clamped SwiGLU (or SiLU with the
    biases), against the loop of per-expert `gguf_linear` calls over the same blocks (the same int8 dots:
    float32 summation error), and against the float loop over gguf-py's dequantization (the activations'
    int8 rounding apart)."""
    from runtime.models.gguf_linear import _OP, reference_dequantize

    hidden, inter, alpha, limit = 256, 96, 1.702, 1.5  # a small limit: both clamps are hit
    parts = mxfp4_parts(hidden, inter)
    gen = torch.Generator().manual_seed(5)
    b13, b2 = torch.randn(E, 2 * inter, generator=gen), torch.randn(E, hidden, generator=gen)
    kind = moe_fused.ExpertActivation(activation, alpha, limit)
    ex = moe_fused.GGUFExperts(parts, b13=b13, b2=b2, activation=kind)
    assert [t & ~INTERLEAVED for t in ex.types] == [MXFP4] * 3  # interleaved by default on AVX512-VNNI
    (_, g), (_, u), (_, d) = parts
    if activation == "silu":
        act = lambda h: F.silu(h[:, :inter]) * h[:, inter:]  # noqa: E731
    else:
        act = lambda h: swiglu(h, alpha, limit)  # noqa: E731
    deq = [
        torch.stack([reference_dequantize(p[e], MXFP4, p.shape[1], cols) for e in range(E)])
        for p, cols in ((g, hidden), (u, hidden), (d, inter))
    ]
    w13, w2 = torch.cat(deq[:2], dim=1), deq[2]  # [E, 2I, H], [E, H, I]
    clamped = [0, 0]
    for x, w, ids in routing_cases(hidden):
        t = x.shape[0]
        got = ex(x, w, ids)
        want = expert_loop(
            x, w, ids, lambda e, xs: _OP(xs, [g[e], u[e]], [MXFP4] * 2),
            lambda e, a: _OP(a.contiguous(), [d[e]], [MXFP4]), b13, b2, act,
        )  # fmt: skip
        check(got, want)
        flt = expert_loop(x, w, ids, lambda e, xs: xs @ w13[e].T, lambda e, a: a @ w2[e].T, b13, b2, act)
        assert (got - flt).norm() / flt.norm() < 0.05
        h = x @ w13.reshape(-1, hidden).T
        clamped[0] += int((h.reshape(t, E, 2 * inter)[..., :inter] > limit).sum())
        clamped[1] += int((h.reshape(t, E, 2 * inter)[..., inter:] < -limit).sum())
    assert min(clamped) > 0


def test_gpt_oss_experts_without_biases_and_bad_input() -> None:
    """The activation alone (no biases) equals the loop without them; bad biases and activations are
    refused."""
    from runtime.models.gguf_linear import _OP

    hidden, inter = 128, 64
    parts = mxfp4_parts(hidden, inter, seed=1)
    kind = moe_fused.ExpertActivation("clamped_swiglu", 1.702, 7.0)
    ex = moe_fused.GGUFExperts(parts, activation=kind)
    (_, g), (_, u), (_, d) = parts
    w, ids = routing(6, "random", seed=2)
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(2))
    zero13, zero2 = torch.zeros(E, 2 * inter), torch.zeros(E, hidden)
    want = expert_loop(
        x, w, ids, lambda e, xs: _OP(xs, [g[e], u[e]], [MXFP4] * 2),
        lambda e, a: _OP(a.contiguous(), [d[e]], [MXFP4]), zero13, zero2, lambda h: swiglu(h, 1.702, 7.0),
    )  # fmt: skip
    check(ex(x, w, ids), want)
    with pytest.raises(ValueError, match="expert_calls"):
        ex.expert_calls()
    with pytest.raises(ValueError, match="b13: expected"):
        moe_fused.GGUFExperts(parts, b13=torch.zeros(E, inter), activation=kind)
    with pytest.raises(ValueError, match="silu or clamped_swiglu"):
        moe_fused.ExpertActivation("gelu")
    with pytest.raises(RuntimeError, match="activation is silu or clamped_swiglu"):
        torch.ops.radixlm.moe_gguf(x, w, ids, ex.w0, ex.w1, ex.w2, ex.types, None, None, "gelu")
    with pytest.raises(RuntimeError, match="b2 must be contiguous float32"):
        torch.ops.radixlm.moe_gguf(x, w, ids, ex.w0, ex.w1, ex.w2, ex.types, None, zero2.double())
