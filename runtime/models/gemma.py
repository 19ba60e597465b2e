"""Gemma 2 and Gemma 3 (text-only `Gemma2ForCausalLM`, `Gemma3ForCausalLM`) over the paged KV pool, built from
the Llama decoder's pieces.

Where Gemma 2's layer differs from Llama's:
- RMSNorm scales by (1 + weight), computed in float32 and then cast (`GemmaRMSNorm`), and each layer norms
  four times: before and after attention, before and after the MLP (the "sandwich");
- the MLP is GeGLU (gelu, tanh approximation) on the fused gate|up projection;
- queries are scaled by query_pre_attn_scalar ** -0.5, and each score is soft-capped, cap * tanh(s / cap),
  before the softmax (attn_logit_softcapping: `AttentionLayer.logit_softcap`, which the backend applies);
- layers alternate sliding-window and global attention (`layer_types`); the window is the attention
  backend's (`AttentionLayer.sliding_window`);
- the embedding is scaled by sqrt(hidden_size) (rounded to the model's dtype, as transformers does), and the
  LM head (tied) is soft-capped where the config has final_logit_softcapping.

Gemma 3 adds per-head q/k norms before the rope, gives each layer kind its own rope base
(`rope_parameters["sliding_attention"]` and `["full_attention"]`) and drops the attention soft-capping.

Checkpoint names are Llama's plus the two feed-forward norms, so `LlamaForCausalLM.load_weights` loads both.
In float32 on the CPU the layers run as the decoder's fused C++ ops do (`_forward_fused`): each norm is the
`rms_norm` kernel with (1 + weight) computed once, the residual stream carried apart; GeGLU and the q/k norms
stay eager.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.llama import MLP, Attention, LlamaForCausalLM, Rotary, linear_call
from runtime.models.model_config import ModelConfig, _rope_frequencies
from runtime.models.parallel import ParallelLMHead, TensorParallel, VocabParallelEmbedding

if TYPE_CHECKING:
    from radixlm_kernels.base import AttentionBackend
    from runtime.model_executor.forward_batch import ForwardBatch


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, then cast to x's dtype (Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class Gemma2Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__(cfg, layer_id, tp)
        self.meta = dataclasses.replace(
            self.meta,
            scaling=cfg.hf_config.query_pre_attn_scalar**-0.5,
            logit_softcap=cfg.attn_logit_softcap,
        )


class Gemma3Attention(Gemma2Attention):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__(cfg, layer_id, tp)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class GeGLU(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma2DecoderLayer(nn.Module):
    attention_class: type[Attention] = Gemma2Attention

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        act = getattr(cfg.hf_config, "hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(
                f"{cfg.architecture} with hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)"
            )
        self.self_attn = self.attention_class(cfg, layer_id, tp)
        self.mlp = GeGLU(cfg, tp)
        self.local_rope = False  # whether the layer takes the sliding layers' own rope (Gemma 3)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, h, cos, sin, batch, backend) -> torch.Tensor:
        h = h + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(h), cos, sin, batch, backend)
        )
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__(cfg, layer_id, tp)
        self.local_rope = cfg.hf_config.layer_types[layer_id] == "sliding_attention"


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_class: type[Gemma2DecoderLayer] = Gemma2DecoderLayer

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.tp = tp = tp or TensorParallel()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.inv_freq, cfg.rope_attention_scaling)  # global layers
        self.rotary_local = self._local_rotary(cfg)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.embed_scale = cfg.hidden_size**0.5
        self.logit_softcap = getattr(cfg.hf_config, "final_logit_softcapping", None)
        self.fused_cpu_ops = False
        self._fused_plan = None
        self.tie_weights()

    def _local_rotary(self, cfg: ModelConfig) -> Rotary:
        """The rope of layers whose `local_rope` is set: Gemma 2 has one rope for every layer."""
        return self.rotary

    def _ropes(self, cos_sin) -> tuple:
        """(global, local) ropes, `cos_sin(rotary)` of each; the local one only where it differs (Gemma 3)."""
        rope = cos_sin(self.rotary)
        return rope, rope if self.rotary_local is self.rotary else cos_sin(self.rotary_local)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        h = h * torch.tensor(self.embed_scale).to(h.dtype)  # the scale rounded to the model's dtype, as in HF
        if self.fused_cpu_ops:
            return self._softcap(self._forward_fused(h, batch, backend))
        rope_global, rope_local = self._ropes(lambda r: r.cos_sin(batch.positions, h.dtype))
        for layer in self.layers:
            cos, sin = rope_local if layer.local_rope else rope_global
            h = layer(h, cos, sin, batch, backend)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        return self._softcap(self._logits(self.norm(h)))

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def _layer_plan(self) -> list[tuple]:
        """Per layer: its four norms as (1 + weight, eps), its projections (`linear_call`), the qkv split, the
        q/k norms (None: Gemma 2 has none), the attention metadata and whether it takes the local rope."""

        def norm(n: GemmaRMSNorm) -> tuple:
            return (1.0 + n.weight.detach().float(), n.eps)

        plan = []
        for layer in self.layers:
            a, mlp, m = layer.self_attn, layer.mlp, layer.self_attn.meta
            split = (
                m.num_heads + 2 * m.num_kv_heads,
                m.head_dim,
                (m.num_heads, m.num_kv_heads, m.num_kv_heads),
            )
            plan.append(
                (
                    norm(layer.input_layernorm),
                    linear_call(a.qkv_proj),
                    split,
                    None if a.q_norm is None else (a.q_norm, a.k_norm),
                    m,
                    linear_call(a.o_proj),
                    norm(layer.post_attention_layernorm),
                    norm(layer.pre_feedforward_layernorm),
                    linear_call(mlp.gate_up_proj),
                    mlp.inter,
                    linear_call(mlp.down_proj),
                    norm(layer.post_feedforward_layernorm),
                    layer.local_rope,
                )
            )
        return plan

    def _forward_fused(self, residual: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend):
        """float32 on the CPU (FUSED_LAYERS loaded): `residual` is the scaled embedding, then the residual
        stream; `h` the last layer's normed MLP output, added to `residual` in place as the next norm runs."""
        top = max(batch.seq_lens_cpu) - 1
        ropes = self._ropes(lambda r: r.cos_sin_rows(batch.positions, top))
        plan = self._fused_plan
        if plan is None:
            plan = self._fused_plan = self._layer_plan()
        ops = torch.ops.radixlm
        rms_norm, add_rms_norm_, rope_ = ops.rms_norm, ops.fused_add_rms_norm_, ops.rope_
        attend = backend.forward
        h = None
        for norm_in, qkv, (
            n_heads,
            d,
            heads,
        ), qk_norm, meta, o, norm_post_attn, norm_pre_ff, gate_up, inter, down, norm_post_ff, local in plan:
            if h is None:
                h = rms_norm(residual, *norm_in)
            else:  # residual += h; h = norm(residual)
                add_rms_norm_(h, residual, *norm_in)
            q, k, v = qkv[0](h, *qkv[1]).view(-1, n_heads, d).split_with_sizes(heads, dim=1)
            if qk_norm is not None:
                q, k = qk_norm[0](q), qk_norm[1](k)
            cos, sin = ropes[local]
            rope_(q, k, cos, sin)
            out = attend(q, k, v, meta, batch).flatten(1)
            a = rms_norm(o[0](out if out.is_contiguous() else out.contiguous(), *o[1]), *norm_post_attn)
            add_rms_norm_(a, residual, *norm_pre_ff)  # residual += attention; a = pre-MLP norm of it
            gate, up = gate_up[0](a, *gate_up[1]).split([inter, inter], dim=-1)
            h = rms_norm(down[0](F.gelu(gate, approximate="tanh") * up, *down[1]), *norm_post_ff)
        if batch.logits_indices is not None:
            h, residual = h[batch.logits_indices], residual[batch.logits_indices]
        add_rms_norm_(h, residual, 1.0 + self.norm.weight.detach().float(), self.norm.eps)
        return self._logits(h)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_class = Gemma3DecoderLayer

    def _local_rotary(self, cfg: ModelConfig) -> Rotary:
        with torch.device("cpu"):  # real tensors even while the model is built on the meta device
            inv_freq, scaling = _rope_frequencies(cfg.hf_config, cfg.head_dim, "sliding_attention")
        return Rotary(inv_freq, scaling)
