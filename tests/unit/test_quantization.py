"""--quantization: each mode's logits match an fp32 model running the dequantized weights, and the `gguf`
mode's Q4_1 blocks reproduce the `gguf` package's dequantization bit for bit on the default model's file.

Tolerances: the quantized and reference forwards see identical weights and differ only in summation order
inside the matmuls, so logits agree to ~1e-5 relative; we allow atol/rtol 2e-4 (the fp32 parity bound).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.model_runner import ModelRunner
from runtime.models.gguf import q4_1_blocks, q8_0_blocks
from runtime.models.quantization import check_supported
from runtime.models.quantized_linear import (
    DynamicInt8Linear,
    QuantizedLinear,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
)
from runtime.server_args import ServerArgs

TOL = dict(atol=2e-4, rtol=2e-4)


def _runner(model_dir: str, quantization: str = "none") -> ModelRunner:
    return ModelRunner(
        model_dir, max_total_tokens=256, max_running_requests=4, attention_backend="torch_native",
        quantization=quantization,
    )  # fmt: skip


def _run(runner: ModelRunner, seqs: list[list[int]]) -> torch.Tensor:
    """All-token logits of one extend batch over `seqs` followed by one decode step of token 3 each."""
    rows = [runner.req_to_token_pool.alloc() for _ in seqs]
    n = sum(len(s) for s in seqs)
    slots = runner.allocator.alloc(n + len(seqs))
    off = 0
    for row, s in zip(rows, seqs, strict=True):
        runner.req_to_token_pool.write(row, 0, slots[off : off + len(s)])
        off += len(s)
    ext = runner.forward(
        ForwardBatch.build_extend(seqs, [0] * len(seqs), rows, slots[:n], logits_indices=list(range(n)))
    )
    for i, (row, s) in enumerate(zip(rows, seqs, strict=True)):
        runner.req_to_token_pool.write(row, len(s), slots[n + i : n + i + 1])
    dec = runner.forward(
        ForwardBatch.build_decode([3] * len(seqs), [len(s) + 1 for s in seqs], rows, slots[n:])
    )
    return torch.cat([ext, dec])


def _reference_weight(kind: str, w: torch.Tensor) -> torch.Tensor:
    """Dequantized weight computed in Python from the quantizer's output (independent of the kernels)."""
    if kind == "int8":
        q, s = quantize_int8(w)
        return q.float() * s[:, None]
    return dequantize_int4(*quantize_int4(w))


# ----------------------------------------------------------------------------------------------- layers
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_layer_matches_dequantized_reference(kind):
    torch.manual_seed(0)
    w, b = torch.randn(96, 128) * 0.05, torch.randn(96)
    ref_w = _reference_weight(kind, w)
    layer = QuantizedLinear.from_float(kind, w, b)
    x = torch.randn(2, 5, 128)  # leading dims are kept
    torch.testing.assert_close(layer(x), nn.functional.linear(x, ref_w, b), **TOL)
    torch.testing.assert_close(layer.dequantized_weight(), ref_w, atol=1e-6, rtol=0)
    # the quantizer itself: error at most half a step (int8: amax/254 per row; int4: range/30 per group)
    step = w.abs().amax(1, keepdim=True) / 127 if kind == "int8" else None
    if step is None:
        g = w.reshape(96, 4, 32)
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, dim=1)
    assert ((ref_w - w).abs() <= step / 2 + 1e-6).all()
    assert layer(torch.zeros(0, 128)).shape == (0, 96)


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="divisible by the group size 32"):
        QuantizedLinear.from_float("int4", torch.randn(8, 48))


# ----------------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_model_matches_dequantized_reference(tiny_model_dir, kind):
    quant, ref = _runner(tiny_model_dir, kind), _runner(tiny_model_dir)
    kinds = [m.kind for m in quant.model.modules() if isinstance(m, QuantizedLinear)]
    assert kinds == [kind] * (4 * quant.config.num_layers + 1)  # every linear layer and the LM head
    for mod in list(ref.model.modules()):
        if isinstance(mod, nn.Linear):
            mod.weight.data = _reference_weight(kind, mod.weight.data)
    seqs = [list(range(5, 25)), [7, 100, 300, 2, 9]]
    got, want = _run(quant, seqs), _run(ref, seqs)
    torch.testing.assert_close(got, want, **TOL)
    plain = _run(_runner(tiny_model_dir), seqs)
    assert not torch.allclose(got, plain, atol=1e-5)  # quantization did change the weights


# ----------------------------------------------------------------------------------------------- w8a8
class FakeQuantW8A8(nn.Module):
    """Reference for DynamicInt8Linear in plain fp32: each row of x divided by its max |x|, the result
    quantized per tensor the way torch's dynamic quantization chooses its parameters
    (`quantize_per_tensor_dynamic`), dequantized and scaled back, times the per-channel int8 weight
    dequantized in Python."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, reduce_range: bool):
        super().__init__()
        self.w, self.b, self.reduce_range = _reference_weight("int8", weight), bias, reduce_range

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        row = x.abs().amax(-1, keepdim=True)
        xn = (x / row).contiguous()
        xq = torch.quantize_per_tensor_dynamic(xn, torch.quint8, self.reduce_range).dequantize() * row
        return nn.functional.linear(xq, self.w, self.b)


# Both sides compute the same integer products; they differ only in fp32 rescaling and summation order.
W8A8_TOL = dict(atol=1e-4, rtol=1e-4)


def test_w8a8_layer_matches_fake_quant_reference():
    torch.manual_seed(0)
    w, b = torch.randn(96, 128) * 0.05, torch.randn(96)
    layer = DynamicInt8Linear(w, b)
    ref = FakeQuantW8A8(w, b, layer.reduce_range)
    x = torch.randn(2, 5, 128) * 3
    got = layer(x)
    torch.testing.assert_close(got, ref(x.reshape(10, 128)).reshape(2, 5, 96), **W8A8_TOL)
    torch.testing.assert_close(layer.dequantized_weight(), ref.w, atol=1e-6, rtol=0)
    # activation quantization is real: the result is not the fp32-activation product
    assert not torch.allclose(got, nn.functional.linear(x, ref.w, b), atol=1e-4)
    assert layer(torch.zeros(0, 128)).shape == (0, 96)
    # per-token scales: an outlier row (1000x) next to a normal one barely moves the normal row's result
    # (with one scale per tensor its activations would round to ~4 levels and miss by ~1e-1)
    x1 = torch.randn(1, 128)
    alone = layer(x1)
    beside = layer(torch.cat([x1, 1000 * torch.randn(1, 128)]))[:1]
    torch.testing.assert_close(beside, alone, atol=2e-2, rtol=0)
    assert (alone - nn.functional.linear(x1, ref.w, b)).abs().max() < 2e-2
    with pytest.raises(TypeError, match="float32 activations"):
        layer(x.to(torch.bfloat16))


def test_w8a8_model_matches_fake_quant_reference(tiny_model_dir):
    quant, ref = _runner(tiny_model_dir, "w8a8"), _runner(tiny_model_dir)
    layers = [m for m in quant.model.modules() if isinstance(m, DynamicInt8Linear)]
    assert len(layers) == 4 * quant.config.num_layers + 1  # every linear layer and the LM head
    rr = layers[0].reduce_range
    for mod in list(ref.model.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear):
                setattr(mod, name, FakeQuantW8A8(child.weight.data, child.bias, rr))
    if ref.model.lm_head is None:
        ref.model.lm_head = FakeQuantW8A8(ref.model.embed_tokens.weight.data, None, rr)
    seqs = [list(range(5, 25)), [7, 100, 300, 2, 9]]
    got, want = _run(quant, seqs), _run(ref, seqs)
    torch.testing.assert_close(got, want, atol=5e-4, rtol=5e-4)
    plain = _run(_runner(tiny_model_dir), seqs)
    assert not torch.allclose(got, plain, atol=1e-5)  # quantization did change the numbers


# ----------------------------------------------------------------------------------------------- gguf
@pytest.fixture(scope="module")
def gguf_tensors():
    import gguf

    from runtime.models.model_loader import default_gguf_path

    return {t.name: t for t in gguf.GGUFReader(default_gguf_path()).tensors}


def _rows(t, n: int):
    cols = int(t.shape[0])
    return np.asarray(t.data)[:n], n, cols


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_up.weight"])
def test_q4_1_blocks_bit_exact_with_gguf(gguf_tensors, name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    t = gguf_tensors[name]
    assert t.tensor_type == GGMLQuantizationType.Q4_1
    raw, rows, cols = _rows(t, 64)
    want = dequantize(raw, t.tensor_type).reshape(rows, cols)
    q, d, m = q4_1_blocks(raw, rows, cols)
    dd, mm = np.repeat(d, 32, axis=1), np.repeat(m, 32, axis=1)
    assert np.array_equal((dd * q.astype(np.float32) + mm).view(np.uint32), want.view(np.uint32))
    # the int4 kernel's own weight ((q - 8) * d + (m + 8d)) is the same bits
    layer = QuantizedLinear.from_int4(torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d),
                                      torch.from_numpy(m + 8 * d))  # fmt: skip
    got = layer.dequantized_weight().numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_q8_0_blocks_bit_exact_with_gguf(gguf_tensors):
    from gguf.quants import dequantize

    t = gguf_tensors["token_embd.weight"]
    raw, rows, cols = _rows(t, 64)
    want = dequantize(raw, t.tensor_type).reshape(rows, cols)
    q, d = q8_0_blocks(raw, rows, cols)
    got = q.astype(np.float32) * np.repeat(d, 32, axis=1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_gguf_mode_keeps_file_blocks(default_model_dir):
    quant, ref = _runner(default_model_dir, "gguf"), _runner(default_model_dir)
    layers = quant.model.layers
    assert all(
        isinstance(m, QuantizedLinear) and m.kind == "int4"
        for layer in layers
        for m in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    )
    assert quant.model.lm_head.kind == "int8"  # Q8_0 tied embedding: exact dequant, per-channel int8
    # fused q|k|v (q/k rows un-permuted) and gate|up: same bits as the fp32 conversion of the same file
    for i in (0, 15, 29):
        for qmod, fmod in (
            (layers[i].self_attn.qkv_proj, ref.model.layers[i].self_attn.qkv_proj),
            (layers[i].mlp.gate_up_proj, ref.model.layers[i].mlp.gate_up_proj),
            (layers[i].self_attn.o_proj, ref.model.layers[i].self_attn.o_proj),
        ):
            assert torch.equal(qmod.dequantized_weight(), fmod.weight.data)
    ref.model.lm_head = nn.Linear(576, quant.vocab_size, bias=False)
    ref.model.lm_head.weight.data = _reference_weight("int8", ref.model.embed_tokens.weight.data)
    seqs = [[1, 9690, 28, 905, 1351, 314], [1, 504, 3458]]
    torch.testing.assert_close(_run(quant, seqs), _run(ref, seqs), **TOL)


def test_gguf_mode_rejects_hf_folder(tiny_model_dir):
    with pytest.raises(ValueError, match="needs a GGUF model"):
        _runner(tiny_model_dir, "gguf")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        ServerArgs(model=tiny_model_dir, quantization="gguf").resolve()


# ----------------------------------------------------------------------------------------------- options
def test_auto_resolves_and_bad_combos_are_named(tmp_path):
    # auto on a model nobody measured (a folder; test_quantization_auto.py has every rule) is none
    assert ServerArgs(model=str(tmp_path), device="cpu").resolve().quantization == "none"
    assert ServerArgs(device="cpu", quantization="int4").resolve().quantization == "int4"
    with pytest.raises(ValueError, match="needs --dtype float32"):
        ServerArgs(device="cpu", dtype="bfloat16", quantization="int8").resolve()
    with pytest.raises(ValueError, match="device 'cuda' is not supported"):
        check_supported("int4", "cuda", "bfloat16")
    with pytest.raises(ValueError, match="fbgemm's dynamic int8 linear; device 'cuda'"):
        check_supported("w8a8", "cuda", "float32")
    with pytest.raises(ValueError, match="needs --dtype float32"):
        ServerArgs(device="cpu", dtype="bfloat16", quantization="w8a8").resolve()
    with pytest.raises(ValueError, match="must be one of"):
        ServerArgs(quantization="fp8")
    with pytest.raises(ValueError, match="must be one of"):
        check_supported("fp8", "cpu", "float32")


def test_auto_is_the_default_and_both_errors_name_the_methods(capsys):
    """`auto` (the measured pick) is the default and a choice; an unknown method is an error listing them,
    from ServerArgs and from the command line."""
    from runtime.launch_server import parse_args

    methods = "'auto', 'none', 'int8', 'int4', 'gguf', 'w8a8', 'w4a8', 'gguf_native', 'mxfp4'"
    with pytest.raises(ValueError, match=rf"must be one of \({methods}\)"):
        ServerArgs(quantization="fp4")
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "fp4"])
    err = capsys.readouterr().err
    assert "invalid choice: 'fp4'" in err and methods in err
    assert ServerArgs().quantization == "auto"
    assert parse_args(["--quantization", "auto"]).quantization == "auto"


def test_tied_head_shares_the_embedding_until_quantized(default_model_dir):
    """The default model ties its LM head to the embedding: one Parameter (loaded once, counted once); a
    quantized head is its own copy while the lookup keeps the fp32 rows."""
    model = _runner(default_model_dir).model
    assert model.cfg.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    names = [n for n, _ in model.named_parameters()]
    assert "embed_tokens.weight" in names and "lm_head.weight" not in names
    quant = _runner(default_model_dir, "int8").model
    assert isinstance(quant.lm_head, QuantizedLinear) and quant.lm_head.kind == "int8"
    assert quant.embed_tokens.weight.dtype == torch.float32
    torch.testing.assert_close(
        quant.lm_head.dequantized_weight(), _reference_weight("int8", quant.embed_tokens.weight.data), **TOL
    )


def test_int4_rows_not_a_multiple_of_16_are_padded():
    """The CPU int4 kernel takes row counts divisible by 16: a 261-row layer (a small vocabulary's head) is
    padded with zero rows and its output cut back, equal to its own dequantized weight."""
    w = torch.randn(261, 256)
    layer = QuantizedLinear.from_float("int4", w)
    x = torch.randn(3, 256)
    y = layer(x)
    assert y.shape == (3, 261) and layer.dequantized_weight().shape == (261, 256)
    torch.testing.assert_close(y, x @ layer.dequantized_weight().T, rtol=1e-4, atol=1e-4)
    assert (layer.dequantized_weight() - w).abs().max() < 0.5  # int4 of N(0, 1) weights, groups of 32
