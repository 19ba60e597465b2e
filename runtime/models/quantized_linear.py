"""The quantized linear layers behind `--quantization` and `quantize_model`, which puts them into a loaded
model (what each method means, and where it may run: `runtime.models.quantization`).

- int8: symmetric per output channel, `torch._weight_int8pack_mm` (y = (x @ q^T) * scale[n]);
- int4: asymmetric groups of 32 along the input dim, `torch._weight_int4pack_mm_for_cpu`
  (w = (q - 8) * scale + zero, q in 0..15);
- w8a8: int8 per-channel weights and per-call dynamic uint8 activations, fbgemm's int8 GEMM
  (`DynamicInt8Linear`);
- w4a8: `W4A8Linear` (runtime/models/w4a8.py), over the GGUF file's own blocks when there is one;
- gguf: Q4_1 (w = q*d + m, blocks of 32) is int4 group 32 with scale d and zero m + 8d (bit-identical
  dequantized weights, see tests/unit/test_quantization.py). Q8_0 (w = q*d per block of 32) has no exact
  kernel: `_weight_int8pack_mm` takes one scale per output channel, so Q8_0 weights (the default file's tied
  embedding / LM head) are dequantized exactly and re-quantized per channel like `int8`. Other GGUF types
  stay fp32 (dequantized as for `none`).

A mixture-of-experts layer's experts (`runtime.models.moe`) become two such layers each, quantized from
their float weights (not under gguf: they stay float); its router stays float32.

The embedding lookup always reads the fp32 (dequantized) table; with tied embeddings the LM head, which
shares the embedding's weight, is replaced by its own quantized copy of it.

Under tensor parallelism int8, int4, w8a8 and w4a8 quantize each rank's shard from the loaded weights (a
row-parallel layer keeps its all_reduce; w4a8 then quantizes the dequantized GGUF weights again rather than
reading the file's blocks); gguf reads the file's whole blocks and is refused for --tp-size > 1.
"""

from __future__ import annotations

import itertools
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runtime.models import gguf
from runtime.models.parallel import RowParallelLinear, TensorParallel
from runtime.models.quantization import check_supported
from runtime.models.w4a8 import W4A8Linear
from runtime.platform import cpu_has_vnni

logger = logging.getLogger("radixlm.quantization")

INT4_GROUP = 32
# `_convert_weight_to_int4pack_for_cpu` keeps the CUDA kernel's argument; the CPU layout ignores its value.
_INNER_K_TILES = 2


# ----------------------------------------------------------------------------------------------- quantizers
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w [N, K] -> (q int8 [N, K], scale fp32 [N]); w ~= q * scale."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-128, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 (min/max per group along K): w [N, K] -> (q int32 [N, K] in 0..15,
    scale_zeros fp32 [K/group, N, 2]) with w ~= (q - 8) * scale + zero, the layout the CPU kernel takes."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs in_features divisible by the group size {group}, got {k}")
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    return q.reshape(n, k).contiguous(), int4_scale_zeros(scale, lo + 8.0 * scale)


def int4_scale_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """[N, G] scales and zeros (w = (q - 8) * scale + zero) -> the kernel's [G, N, 2] float32 tensor."""
    return torch.stack([scale.float().T, zero.float().T], dim=-1).contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int32 [N, K] values 0..15 -> the CPU kernel's packed uint8 [N, K/2]."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), _INNER_K_TILES)


INT4_ROWS = 16  # the CPU int4 kernel takes N divisible by 16: other row counts are padded with zero rows


def _pad_int4(q: torch.Tensor, scale_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int32 [N, K] and scale_zeros [G, N, 2] padded to N a multiple of INT4_ROWS (zero weights)."""
    extra = -q.shape[0] % INT4_ROWS
    if extra:
        q = torch.cat([q, q.new_zeros(extra, q.shape[1])])
        scale_zeros = torch.cat([scale_zeros, scale_zeros.new_zeros(scale_zeros.shape[0], extra, 2)], dim=1)
    return q, scale_zeros.contiguous()


def dequantize_int4(q: torch.Tensor, scale_zeros: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """Reference fp32 weight [N, K] of unpacked int4 values (what the kernel should be multiplying by)."""
    n, k = q.shape
    scale = scale_zeros[..., 0].T[:, :, None]  # [N, G, 1]
    zero = scale_zeros[..., 1].T[:, :, None]
    return ((q.float().reshape(n, k // group, group) - 8.0) * scale + zero).reshape(n, k)


# ----------------------------------------------------------------------------------------------- the layer
class QuantizedLinear(nn.Module):
    """Drop-in for `nn.Linear` (y = x W^T + b) with W stored as int8 per channel or packed int4 groups.

    Buffers: int8: qweight int8 [N, K], scales fp32 [N]; int4: qweight uint8 [N', K/2] (packed),
    scale_zeros fp32 [K/32, N', 2], N' = N rounded up to INT4_ROWS (zero rows, cut from the output). Bias
    stays fp32. `reduce_tp` (set when replacing a `RowParallelLinear`) sums the ranks' partial outputs before
    the bias, as the layer it replaces did.
    """

    reduce_tp: TensorParallel | None = None

    def __init__(
        self,
        kind: str,
        in_features: int,
        out_features: int,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        if kind not in ("int8", "int4"):
            raise ValueError(f"QuantizedLinear kind must be int8 or int4, got {kind!r}")
        self.kind = kind
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_float(cls, kind: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantizedLinear:
        n, k = weight.shape
        if kind == "int8":
            q, s = quantize_int8(weight.detach())
            return cls("int8", k, n, q, s, bias)
        q, sz = _pad_int4(*quantize_int4(weight.detach()))
        return cls("int4", k, n, pack_int4(q), sz, bias)

    @classmethod
    def from_int4(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None
    ) -> QuantizedLinear:
        """Exact int4 layer from unpacked q [N, K] (0..15), scale and zero [N, K/32]."""
        n, k = q.shape
        q, sz = _pad_int4(q, int4_scale_zeros(scale, zero))
        return cls("int4", k, n, pack_int4(q), sz, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            raise TypeError(f"QuantizedLinear takes float32 activations, got {x2.dtype}")
        if x2.shape[0] == 0:
            y = x2.new_empty(0, self.out_features)
        elif self.kind == "int8":
            y = torch._weight_int8pack_mm(x2.contiguous(), self.qweight, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2.contiguous(), self.qweight, INT4_GROUP, self.scales)
            if y.shape[1] != self.out_features:  # padded rows (INT4_ROWS)
                y = y[:, : self.out_features]
        if self.reduce_tp is not None:
            y = self.reduce_tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K] weight as the kernel sees it (x = identity rows; adding exact zeros keeps it exact)."""
        eye = torch.eye(self.in_features, dtype=torch.float32, device=self.qweight.device)
        if self.kind == "int8":
            return torch._weight_int8pack_mm(eye, self.qweight, self.scales).T.contiguous()
        y = torch._weight_int4pack_mm_for_cpu(eye, self.qweight, INT4_GROUP, self.scales)
        return y[:, : self.out_features].T.contiguous()

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}"


# fbgemm's packed weights are a TorchScript object that dynamo cannot trace through (each layer became a
# graph break and a recompile under --enable-torch-compile). Layers register their packed weight here and
# call one op by handle, which inductor treats as an opaque kernel between its fused loops. The op is
# registered with torch.library.Library rather than @custom_op: the latter's Python wrapper added ~14 us
# per call (121 calls in a bs-1 step), the dispatcher-level registration adds none measurable.
_W8A8_PACKED: dict[int, Any] = {}
_w8a8_handles = itertools.count()
_LIB = torch.library.Library("radixlm", "DEF")
_LIB.define("w8a8_linear(Tensor x, int handle, int out_features, bool reduce_range) -> Tensor")


def _w8a8_linear_cpu(x: torch.Tensor, handle: int, out_features: int, reduce_range: bool) -> torch.Tensor:
    """fbgemm's dynamic int8 linear of contiguous fp32 x [M, K] with packed weight `handle` -> [M, N]."""
    return torch.ops.quantized.linear_dynamic(x, _W8A8_PACKED[handle], reduce_range)


_LIB.impl("w8a8_linear", _w8a8_linear_cpu, "CPU")


@torch.library.register_fake("radixlm::w8a8_linear", lib=_LIB)
def _w8a8_linear_fake(x: torch.Tensor, handle: int, out_features: int, reduce_range: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class DynamicInt8Linear(nn.Module):
    """Drop-in for `nn.Linear` running fbgemm's dynamic int8 GEMM (`--quantization w8a8`).

    Weights: symmetric int8 per output channel (as `int8`), packed once by `quantized.linear_prepack`.
    Activations: quantized per call to uint8, then an int8 x int8 -> int32 GEMM rescaled to fp32 (+ bias).
    Unlike the weight-only modes both operands are 8-bit, so the GEMM runs on int8 dot products (VNNI).
    fbgemm's dynamic linear takes one activation scale for the whole [T, K] input; each row is first divided
    by its own max |x| (and the output rows multiplied back), which makes the quantization per token. That
    matters: SmolLM2's hidden states carry outlier tokens, and with one scale per tensor next-token top-1
    agreement with fp32 fell to 0.76 (down_proj alone: 0.75); per token it is 0.97 for down_proj alone
    (bench/quant_accuracy.py-style proxy, 114 positions). A token's result still depends slightly on the
    other rows of its batch (the zero point comes from the batch's min over normalised rows).
    On CPUs without VNNI the activations use 7 bits (`reduce_range`), which avoids int16 saturation in the
    AVX2 u8 x s8 kernel; with VNNI the full 8 bits are used (half the rounding error).
    `reduce_tp`: as in `QuantizedLinear`.
    """

    reduce_tp: TensorParallel | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        n, k = weight.shape
        self.kind = "w8a8"
        self.in_features, self.out_features = k, n
        self.reduce_range = not cpu_has_vnni()
        q, s = quantize_int8(weight.detach())
        with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated; fbgemm needs one
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            zeros = torch.zeros(n, dtype=torch.long)
            qw = torch._make_per_channel_quantized_tensor(q, s.double(), zeros, 0)
        b = None if bias is None else bias.detach().float().contiguous()
        self.register_buffer("bias", b)
        self._packed = torch.ops.quantized.linear_prepack(qw, None)
        self._handle = next(_w8a8_handles)
        _W8A8_PACKED[self._handle] = self._packed
        weakref.finalize(self, _W8A8_PACKED.pop, self._handle, None)  # freed with the layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            raise TypeError(f"DynamicInt8Linear takes float32 activations, got {x2.dtype}")
        if x2.shape[0] == 0:
            return x2.new_empty(*lead, self.out_features)
        # Per-token: scale each row to max |x| = 1, so the kernel's per-tensor range is every row's own; the
        # GEMM is linear, so multiplying its rows back by the scale is exact. One row needs no rescale: the
        # per-tensor range already is the token's (saves four small ops per call at bs 1).
        row = None if x2.shape[0] == 1 else x2.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)
        xin = x2 if row is None else x2 / row
        y = torch.ops.radixlm.w8a8_linear(
            xin.contiguous(), self._handle, self.out_features, self.reduce_range
        )
        if row is not None:
            y.mul_(row)
        if self.reduce_tp is not None:
            y = self.reduce_tp.all_reduce(y)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*lead, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K]: the int8 weight times its per-channel scale, as packed."""
        qw, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qw.dequantize()

    def extra_repr(self) -> str:
        return f"w8a8, in_features={self.in_features}, out_features={self.out_features}"


def _gguf_layer_int4(
    tensors: dict[str, Any], names: list[str], heads: list[int | None], bias: torch.Tensor | None
) -> QuantizedLinear | None:
    """Exact int4 layer from Q4_1 parts fused along rows; None if a part is not Q4_1."""
    blocks = gguf.fused_blocks(tensors, names, heads, "q4_1")
    if blocks is None:
        return None
    q, d, m = blocks
    # w = q*d + m = (q - 8)*d + (m + 8d); 8d is exact and m + 8d is exact in fp32 for fp16 inputs whose
    # exponents differ by < 13, so the kernel's dequantized weight is bit-identical to gguf's.
    return QuantizedLinear.from_int4(q.to(torch.int32), d, m + 8.0 * d, bias)


def _gguf_layer_w4a8(
    tensors: dict[str, Any], names: list[str], heads: list[int | None], kind: str, bias: torch.Tensor | None
) -> nn.Module | None:
    """w4a8 layer over the file's own Q4_1 / Q8_0 bytes (the same ones llama.cpp reads); None if the parts
    are stored in another type."""
    blocks = gguf.fused_blocks(tensors, names, heads, kind)
    if blocks is None:
        return None
    q, d, *m = blocks
    return W4A8Linear(kind, q, d.half(), m[0].half() if m else None, bias)


# ----------------------------------------------------------------------------------------------- the model
def _targets(model: nn.Module) -> list[tuple[nn.Module, str, list[str], list[int | None]]]:
    """(parent, attribute, GGUF tensor names, rope heads per part) for every linear layer to quantize."""
    cfg = model.cfg
    out = []
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"]
        out.append((attn, "qkv_proj", qkv, [cfg.num_heads, cfg.num_kv_heads, None]))
        out.append((attn, "o_proj", [b + "attn_output.weight"], [None]))
        shared = getattr(mlp, "shared_expert", None)  # a mixture of experts' dense shared expert (Qwen2-MoE)
        if shared is not None:
            gate_up = [b + "ffn_gate_shexp.weight", b + "ffn_up_shexp.weight"]
            out.append((shared, "gate_up_proj", gate_up, [None, None]))
            out.append((shared, "down_proj", [b + "ffn_down_shexp.weight"], [None]))
        if not hasattr(mlp, "gate_up_proj"):  # a mixture of experts: its experts are `_quantize_experts`'
            continue
        out.append((mlp, "gate_up_proj", [b + "ffn_gate.weight", b + "ffn_up.weight"], [None, None]))
        out.append((mlp, "down_proj", [b + "ffn_down.weight"], [None]))
    return out


def quantize_model(model: nn.Module, method: str, model_dir: str | None = None) -> dict[str, int]:
    """Replace every linear layer of a loaded `LlamaForCausalLM` (and give it a quantized LM head) in place.
    A mixture-of-experts layer's experts become two quantized layers each, from their float weights
    (`_expert_layer`; under gguf, or where a shape does not fit the blocks, they stay float with a warning);
    its router stays float32.

    Returns how many layers ended up in each storage ("int8", "int4", "fp32") for the start-up log.
    `model_dir` is needed for "gguf" (its source GGUF file is read again for the raw blocks).
    """
    check_supported(method, model.embed_tokens.weight.device.type, _dtype_name(model))
    counts = {"int8": 0, "int4": 0, "w8a8": 0, "q4_1": 0, "q8_0": 0, "fp32": 0}
    if method == "none":
        return counts
    if method == "gguf" and model.tp.size > 1:
        raise ValueError(
            f"--quantization gguf cannot be sharded over --tp-size {model.tp.size}: it reuses the GGUF "
            "file's whole Q4_1 blocks; use --quantization int8 or int4 (quantized per rank) or --tp-size 1"
        )
    pick: Callable[[nn.Linear, list[str], list[int | None]], nn.Module]
    if method == "gguf":
        if model_dir is None:
            raise ValueError("--quantization gguf needs the model folder to find its GGUF source")
        tensors = gguf.source_tensors(model_dir)

        def pick(lin: nn.Linear, names: list[str], heads: list[int | None]) -> nn.Module:
            gguf.check_names(tensors, names)
            layer = _gguf_layer_int4(tensors, names, heads, lin.bias)
            if layer is not None:
                return layer
            if gguf.stored_as(tensors, names, "q8_0"):
                # per-block scales do not fit the per-channel kernel: exact dequant (loaded) -> int8/channel
                return QuantizedLinear.from_float("int8", lin.weight, lin.bias)
            return lin  # other block types: keep the fp32 dequantization
    elif method == "w8a8":

        def pick(lin: nn.Linear, names: list[str], heads: list[int | None]) -> nn.Module:
            return DynamicInt8Linear(lin.weight, lin.bias)
    elif method == "w4a8":
        # the file's own blocks when the model is a GGUF conversion loaded whole, else quantize fp32 weights
        from_file = model_dir is not None and model.tp.size == 1 and gguf.is_gguf_conversion(model_dir)
        tensors = gguf.source_tensors(model_dir) if from_file else {}

        def pick(lin: nn.Linear, names: list[str], heads: list[int | None]) -> nn.Module:
            kind = "q8_0" if names[0] in _HEAD_NAMES else "q4_1"
            layer = None
            if tensors:
                gguf.check_names(tensors, names)
                layer = _gguf_layer_w4a8(tensors, names, heads, kind, lin.bias)
            if layer is None:
                layer = W4A8Linear.from_float(kind, lin.weight, lin.bias)
            return layer
    else:

        def pick(lin: nn.Linear, names: list[str], heads: list[int | None]) -> nn.Module:
            return QuantizedLinear.from_float(method, lin.weight, lin.bias)

    def replace(lin: nn.Linear, names: list[str], heads: list[int | None]) -> nn.Module:
        """`pick`'s layer for `lin`, checked against its shape and summing TP partial products like it."""
        new = pick(lin, names, heads)
        if new is lin:
            return lin
        if (new.out_features, new.in_features) != tuple(lin.weight.shape):  # only GGUF blocks can disagree
            raise ValueError(f"GGUF {names} shape disagrees with the model's {tuple(lin.weight.shape)}")
        if isinstance(lin, RowParallelLinear) and lin.tp.size > 1:
            new.reduce_tp = lin.tp  # the replaced layer summed the ranks' partial products: keep doing so
        return new

    _quantize_experts(model, method, counts)
    for parent, attr, names, heads in _targets(model):
        new = replace(getattr(parent, attr), names, heads)
        setattr(parent, attr, new)
        counts[new.kind if isinstance(new, _QUANTIZED) else "fp32"] += 1
    # tied: the head shares the embedding's weight; its quantized copy replaces it, the lookup keeps fp32 rows
    head_name = "token_embd.weight" if model.cfg.tie_word_embeddings else "output.weight"
    model.lm_head = replace(model.lm_head, [head_name], [None])
    counts[model.lm_head.kind if isinstance(model.lm_head, _QUANTIZED) else "fp32"] += 1
    logger.info("quantization %s: %s", method, counts)
    return counts


_QUANTIZED = (QuantizedLinear, DynamicInt8Linear, W4A8Linear)


def _expert_layer(method: str) -> Callable[[torch.Tensor], nn.Module] | None:
    """weight [N, K] -> a quantized layer for one expert projection under `method`, from float weights;
    None for gguf (a conversion's expert blocks are not read yet: the experts stay float)."""
    if method == "w4a8":
        return lambda w: W4A8Linear.from_float("q4_1", w)
    if method == "w8a8":
        return lambda w: DynamicInt8Linear(w, None)
    if method in ("int8", "int4"):
        return lambda w: QuantizedLinear.from_float(method, w, None)
    return None


def _quantize_experts(model: nn.Module, method: str, counts: dict[str, int]) -> None:
    """Quantize the experts of every mixture-of-experts layer (`SparseMoeBlock.quantize_experts`), counting
    them under counts[kind]; layers left float are counted under "fp32" and named in one warning."""
    make = _expert_layer(method)
    kept = []
    for i, layer in enumerate(model.layers):
        block = layer.mlp
        if not hasattr(block, "quantize_experts"):
            continue
        try:
            if make is None:
                raise ValueError(f"--quantization {method} has no expert layer")
            block.quantize_experts(make)
        except ValueError as e:
            kept.append((i, str(e)))
            counts["fp32"] += 2 * block.num_experts
            continue
        kind = block.experts[0][0].kind
        counts[kind] = counts.get(kind, 0) + 2 * block.num_experts
    if kept:
        logger.warning(
            "quantization %s: the experts of %d mixture-of-experts layers stay in %s (layer %d: %s)",
            method,
            len(kept),
            _dtype_name(model),
            *kept[0],
        )


_HEAD_NAMES = ("output.weight", "token_embd.weight")


def _dtype_name(model: nn.Module) -> str:
    return str(model.embed_tokens.weight.dtype).removeprefix("torch.")
