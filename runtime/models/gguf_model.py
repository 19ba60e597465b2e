"""A Llama-family model built straight from a GGUF file, its quantized tensors used in place
(`--quantization gguf_native`, what `--quantization auto` picks for a GGUF file).

The file is memory-mapped (gguf-py's reader). Every projection (q|k|v, o, gate|up, down, the LM head) becomes
a `runtime.models.gguf_linear.GGUFLinear` over the tensor's own bytes: a view of the mapped file, except the
Q/K rows of a `llama` file, which llama.cpp stored permuted and which are copied back into Hugging Face's
order (whole rows of blocks: nothing is dequantized), and, on the AVX512-VNNI build, Q4_K / Q5_K / Q6_K
tensors, whose bits GGUFLinear copies once into its 16-row interleaved layout (same size; the mapping's
pages are then no longer read). The token embedding stays as the file's blocks too
(`GGUFEmbedding`: each lookup dequantizes the rows it reads); norms and biases are float32. Tensors stored as
F32 / F16 / BF16 serve as float32 (`nn.Linear`, a float embedding). Any other type is refused at start-up
naming the tensor and its type; so is tensor parallelism.

Per architecture (`runtime.models.gguf_arch.ARCHS`): Gemma 2 and 3 build `Gemma2ForCausalLM` /
`Gemma3ForCausalLM` (their norms stored as 1 + w are taken back to w); Phi-3's fused attn_qkv and ffn_up
(gate | up) are one GGUFLinear each; a mixture of experts (qwen3moe) serves its stacked ffn_*_exps tensors'
blocks as they are (one expert is a contiguous byte range of each; the K types interleaved expert by expert)
through the fused MoE op (`runtime.models.moe_fused.GGUFExperts`: one C++ call per layer); its router
(ffn_gate_inp) is float32.
gpt-oss builds `GptOssForCausalLM` the same way (`_gpt_oss`: its experts' biases and clamped SwiGLU, sinks).
Pages of the file read in place are faulted in once the model is built (`map_in_place_weights`).

The folder `--model FILE.gguf` resolves to (`runtime.models.gguf.resolve_gguf`) holds only the config, the
tokenizer and the marker naming this file: no weights are written.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from runtime.models.gguf import gguf_source, unpermute_rope_rows
from runtime.models.gguf_arch import ARCHS, open_reader
from runtime.models.gguf_linear import (
    FLOAT_TYPES,
    KERNEL_TYPES,
    GGUFEmbedding,
    GGUFLinear,
    dequantize_tensor,
    tensor_rows,
)
from runtime.models.gpt_oss import GptOssForCausalLM
from runtime.models.model_config import ModelConfig
from runtime.models.moe import SparseMoeBlock
from runtime.models.moe_fused import GGUFExperts
from runtime.models.parallel import TensorParallel
from runtime.models.registry import model_class_for

logger = logging.getLogger("radixlm.gguf_model")


def check_served_types(tensors: dict[str, Any], path: str) -> None:
    """Every tensor is of a type this path serves (a block kernel's or a float type); ValueError naming the
    first that is not."""
    for name, t in tensors.items():
        qtype = int(t.tensor_type)
        if qtype not in KERNEL_TYPES and qtype not in FLOAT_TYPES:
            served = sorted([*(v[0] for v in KERNEL_TYPES.values()), *FLOAT_TYPES.values()])
            raise ValueError(
                f"{path}: tensor {name} is stored as {t.tensor_type.name}, which radixlm does not serve in "
                f"place (served: {', '.join(served)}); re-quantize the file to one of those (e.g. Q4_K_M), "
                "or "
                "pass --quantization none to dequantize it to float32 at load"
            )


class _Loader:
    def __init__(self, gguf_path: str, cfg: ModelConfig):
        self.path = gguf_path
        reader = open_reader(gguf_path)
        self.reader = reader  # keeps the mapping alive as long as the loader; tensors keep their own views
        arch = reader.fields["general.architecture"].contents()
        self.arch = ARCHS[arch]
        self.rope_permuted = self.arch.rope_permuted
        self.tensors = {t.name: t for t in reader.tensors}
        check_served_types(self.tensors, gguf_path)
        self.cfg = cfg
        self.counts: dict[str, int] = {}

    def get(self, name: str) -> Any:
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"{self.path}: the file lacks tensor {name}")
        return t

    def linear(self, names: list[str], heads: list[int | None], in_features: int, bias: list[str] | None):
        """The projection fused from `names` along rows: a GGUFLinear when every part has a block kernel,
        else a float32 nn.Linear."""
        parts = [self.get(n) for n in names]
        b = None
        if bias is not None:
            b = torch.cat(
                [self._rows(dequantize_tensor(self.get(n)), h) for n, h in zip(bias, heads, strict=True)]
            )
        for n, t in zip(names, parts, strict=True):
            if int(t.shape[0]) != in_features:
                raise ValueError(
                    f"{self.path}: tensor {n} has rows of {int(t.shape[0])}, expected {in_features}"
                )
        if all(int(t.tensor_type) in KERNEL_TYPES for t in parts):
            blocks = [
                (int(t.tensor_type), self._rows(tensor_rows(t), h)) for t, h in zip(parts, heads, strict=True)
            ]
            layer: nn.Module = GGUFLinear(in_features, blocks, b)
            for t in parts:
                key = t.tensor_type.name
                self.counts[key] = self.counts.get(key, 0) + 1
            return layer
        w = torch.cat([self._rows(dequantize_tensor(t), h) for t, h in zip(parts, heads, strict=True)])
        layer = nn.Linear(in_features, w.shape[0], bias=b is not None)
        layer.weight.data = w
        if b is not None:
            layer.bias.data = b
        self.counts["F32"] = self.counts.get("F32", 0) + len(parts)
        return layer

    def norm(self, name: str) -> torch.Tensor:
        """A norm weight as the model's module holds it: Gemma's stored 1 + w taken back to w."""
        w = dequantize_tensor(self.get(name))
        return w - self.arch.norm_shift if self.arch.norm_shift else w

    def experts(self, block: str, **extra: Any) -> GGUFExperts | None:
        """The stacked ffn_{gate,up,down}_exps tensors' blocks for the fused MoE op (views of the mapped file,
        or their interleaved copies), `extra` passed on (biases, the activation); None when a part is not of a
        block kernel's type (served as float)."""
        gate, up, down = (self.get(f"{block}ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
        if not all(int(t.tensor_type) in KERNEL_TYPES for t in (gate, up, down)):
            return None
        fused = GGUFExperts([(int(t.tensor_type), _expert_rows(t)) for t in (gate, up, down)], **extra)
        for t in (gate, up, down):
            self.counts[t.tensor_type.name] = self.counts.get(t.tensor_type.name, 0) + fused.num_experts
        return fused

    def float_experts(self, block: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H]: gate rows then up rows, w2 [E, H, I]) of experts stored as floats, dequantized to
        float32 in the file's stacking ([E, out, in]), for the per-expert loop."""
        gate, up, down = (
            dequantize_tensor(self.get(f"{block}ffn_{p}_exps.weight")) for p in ("gate", "up", "down")
        )
        self.counts["F32"] = self.counts.get("F32", 0) + 3 * gate.shape[0]
        return torch.cat([gate, up], dim=1), down

    def _rows(self, rows: torch.Tensor, heads: int | None) -> torch.Tensor:
        """Q/K rows back into HF order where llama.cpp permuted them (a copy); other rows untouched."""
        if heads is None or not self.rope_permuted:
            return rows
        return torch.from_numpy(np.ascontiguousarray(unpermute_rope_rows(rows.numpy(), heads)))


def _expert_rows(t: Any) -> torch.Tensor:
    """A stacked expert tensor's bytes as uint8 [n_expert, rows, row bytes]: a view of the mapped file, so
    expert e's rows ([e]) are one contiguous byte range."""
    rows, n = (int(v) for v in t.shape[1:3])
    return tensor_rows(t).reshape(n, rows, -1)


def load_gguf_model(
    model_dir: str, cfg: ModelConfig, tp: TensorParallel, device: torch.device, dtype: torch.dtype
):
    """The model of the GGUF file `model_dir` was resolved from, with its blocks in place (see the module)."""
    t0 = time.perf_counter()
    if tp.size > 1:
        raise ValueError(
            "--quantization gguf_native serves a GGUF file's whole tensors on one rank: use --tp-size 1, or "
            "--quantization int8 / w4a8 to shard"
        )
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError("--quantization gguf_native runs on the CPU with float32 activations")
    ld = _Loader(gguf_source(model_dir), cfg)
    model = (_gpt_oss if ld.arch.sinks else _llama_family)(ld, cfg, tp, device)
    left = [n for n, p in model.named_parameters() if p.is_meta] + [
        n for n, p in model.named_buffers() if p.is_meta
    ]
    if left:
        raise ValueError(f"{ld.path}: no GGUF tensor fills {left[:3]}")
    t1 = time.perf_counter()
    mapped = map_in_place_weights(model, ld.reader)
    logger.info(
        "GGUF %s served in place (%s) in %.2f s; norms float32; %.1f GB of it mapped in %.2f s",
        ld.path,
        ", ".join(f"{n} {k}" for k, n in sorted(ld.counts.items())),
        t1 - t0,
        mapped / 1e9,
        time.perf_counter() - t1,
    )
    return model


def _llama_family(ld: _Loader, cfg: ModelConfig, tp: TensorParallel, device: torch.device) -> nn.Module:
    """Llama, Qwen2/3, Mistral 3, Phi-3, Gemma 2/3 and Qwen3-MoE from their files (see the module)."""
    arch = ld.arch
    with torch.device("meta"):
        model_class = model_class_for(cfg.architecture)
        model = model_class(cfg, tp)
    hidden, q_rows = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    float_experts: dict[int, str] = {}  # layer -> block prefix, for experts served as float32
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        if arch.fused:  # Phi-3: rows q | k | v in one tensor, never permuted
            attn.qkv_proj = ld.linear([b + "attn_qkv.weight"], [None], hidden, None)
        else:
            qkv_bias = [b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"] if cfg.qkv_bias else None
            attn.qkv_proj = ld.linear(
                [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"],
                [cfg.num_heads, cfg.num_kv_heads, None],
                hidden,
                qkv_bias,
            )
        attn.o_proj = ld.linear([b + "attn_output.weight"], [None], q_rows, None)
        if isinstance(mlp, SparseMoeBlock):
            experts = ld.experts(b)
            if experts is None:
                float_experts[i] = b
            else:
                mlp.use_fused_experts(experts)
            continue
        gate_up = [b + "ffn_up.weight"] if arch.fused else [b + "ffn_gate.weight", b + "ffn_up.weight"]
        mlp.gate_up_proj = ld.linear(gate_up, [None] * len(gate_up), hidden, None)
        mlp.down_proj = ld.linear([b + "ffn_down.weight"], [None], cfg.intermediate_size, None)
    _embedding_head_and_rest(ld, model, cfg, device)
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
        if arch.sandwich:  # Gemma: ffn_norm is the pre-MLP norm; two more after attention and the MLP
            norms = {
                "input_layernorm": "attn_norm",
                "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm",
            }
        for module, name in norms.items():
            getattr(layer, module).weight.data.copy_(ld.norm(f"{b}{name}.weight"))
        if layer.self_attn.q_norm is not None:
            layer.self_attn.q_norm.weight.data.copy_(ld.norm(b + "attn_q_norm.weight"))
            layer.self_attn.k_norm.weight.data.copy_(ld.norm(b + "attn_k_norm.weight"))
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.gate_weight.data.copy_(
                dequantize_tensor(ld.get(b + "ffn_gate_inp.weight"))
            )  # the router
        if i in float_experts:
            w13, w2 = ld.float_experts(b)
            layer.mlp.w13.data.copy_(w13)
            layer.mlp.w2.data.copy_(w2)
    return model


PAGE = 4096


def map_in_place_weights(model: nn.Module, reader: Any) -> int:
    """Fault in every page of the mapped file that a projection or an expert reads in place (one byte read
    per page; the embedding's rows are left to their lookups), so that the first requests do not pay for
    them: a random gpt-oss-20b file's first 8-stream decode ran at 9.4 tok/s against 15.7 once its experts'
    pages were mapped. Returns the bytes mapped."""
    lo = reader.data.ctypes.data
    hi = lo + reader.data.nbytes
    done, total = set(), 0
    for module in model.modules():
        if isinstance(module, GGUFEmbedding):
            continue
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if t.dtype != torch.uint8 or not lo <= t.data_ptr() < hi or t.data_ptr() in done:
                continue
            done.add(t.data_ptr())
            flat = t.reshape(-1)  # a view: in-place weights are contiguous slices of the mapping
            int(flat[::PAGE].sum())
            total += flat.numel()
    return total


def _embedding_head_and_rest(ld: _Loader, model: nn.Module, cfg: ModelConfig, device: torch.device) -> None:
    """The LM head and the token embedding from the file (the embedding kept as blocks where the file's are,
    sharing the head's copy when tied); then what is still on the meta device (norms, biases, a float
    embedding) gets storage, and the float embedding and the final norm are filled from the file."""
    hidden = cfg.hidden_size
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    model.lm_head = ld.linear([head], [None], hidden, None)
    embd = ld.get("token_embd.weight")
    blocks = int(embd.tensor_type) in KERNEL_TYPES
    if blocks and cfg.tie_word_embeddings and isinstance(model.lm_head, GGUFLinear):
        # the head's copy (in the kernel's layout): one resident copy of the table, not two
        model.embed_tokens = GGUFEmbedding(model.lm_head.types[0], model.lm_head.w0, hidden)
    elif blocks:  # kept as blocks: each lookup dequantizes its rows
        model.embed_tokens = GGUFEmbedding(int(embd.tensor_type), tensor_rows(embd), hidden)
    for module in model.modules():
        if any(p.is_meta for p in module.parameters(recurse=False)):
            module.to_empty(device=device, recurse=False)
    if not blocks:
        model.embed_tokens.load_shard("weight", dequantize_tensor(embd), 0)
    model.norm.weight.data.copy_(ld.norm("output_norm.weight"))


def _gpt_oss(ld: _Loader, cfg: ModelConfig, tp: TensorParallel, device: torch.device) -> nn.Module:
    """gpt-oss from its file: q|k|v (with their biases) and o as GGUFLinear, o's bias, the sinks, the router
    (float32, with its bias) and each layer's experts as one GGUFExperts with their biases and the clamped
    SwiGLU (MXFP4 experts read in place, as `--quantization mxfp4` serves a checkpoint's); experts stored as
    floats fill the per-expert loop's w13 / b13 / w2 / b2 instead."""
    from runtime.models.moe_fused import ExpertActivation

    with torch.device("meta"):
        model = GptOssForCausalLM(cfg, tp)
    hidden, q_rows = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    float_experts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (b13, b2), experts as floats
    for i, layer in enumerate(model.layers):
        b, attn, mlp = f"blk.{i}.", layer.self_attn, layer.mlp
        attn.qkv_proj = ld.linear(
            [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"],
            [None] * 3,
            hidden,
            [b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias"],
        )
        attn.o_proj = ld.linear([b + "attn_output.weight"], [None], q_rows, None)
        gate_b, up_b, b2 = (
            dequantize_tensor(ld.get(f"{b}ffn_{p}_exps.bias")) for p in ("gate", "up", "down")
        )
        b13 = torch.cat([gate_b, up_b], dim=1)
        activation = ExpertActivation("clamped_swiglu", mlp.alpha, mlp.limit)
        experts = ld.experts(b, b13=b13, b2=b2, activation=activation)
        if experts is None:
            float_experts[i] = (b13, b2)
            continue
        mlp.w13 = mlp.w2 = mlp.b13 = mlp.b2 = None
        mlp.experts = experts
    _embedding_head_and_rest(ld, model, cfg, device)
    for i, layer in enumerate(model.layers):
        b, attn, mlp = f"blk.{i}.", layer.self_attn, layer.mlp
        layer.input_layernorm.weight.data.copy_(ld.norm(b + "attn_norm.weight"))
        layer.post_attention_layernorm.weight.data.copy_(ld.norm(b + "post_attention_norm.weight"))
        attn.o_bias.data.copy_(dequantize_tensor(ld.get(b + "attn_output.bias")))
        attn.sinks.data.copy_(dequantize_tensor(ld.get(b + "attn_sinks.weight")))
        attn.bind_sinks()
        mlp.router_weight.data.copy_(dequantize_tensor(ld.get(b + "ffn_gate_inp.weight")))
        mlp.router_bias.data.copy_(dequantize_tensor(ld.get(b + "ffn_gate_inp.bias")))
        if i in float_experts:
            (w13, w2), (b13, b2) = ld.float_experts(b), float_experts[i]
            for param, value in ((mlp.w13, w13), (mlp.b13, b13), (mlp.w2, w2), (mlp.b2, b2)):
                param.data.copy_(value)
    return model
