"""Gemma 3 (text-only `Gemma3ForCausalLM`) over the paged KV pool, built from the Llama decoder's pieces.

Where Gemma 3's layer differs from Llama's:
- RMSNorm scales by (1 + weight), computed in float32 and then cast (`GemmaRMSNorm`), and each layer norms
  four times: before and after attention, before and after the MLP (the "sandwich");
- the MLP is GeGLU (gelu, tanh approximation) on the fused gate|up projection;
- queries are scaled by query_pre_attn_scalar ** -0.5, after per-head q/k norms;
- layers alternate sliding-window and global attention (`layer_types`), each kind with its own rope base
  (`rope_parameters["sliding_attention"]` and `["full_attention"]`); the window is the attention backend's
  (`AttentionLayer.sliding_window`);
- the embedding is scaled by sqrt(hidden_size) (rounded to the model's dtype, as transformers does), and the
  LM head (tied) is soft-capped where the config has final_logit_softcapping.

Checkpoint names are Llama's plus the two feed-forward norms, so `LlamaForCausalLM.load_weights` loads it.
The layers run eagerly (no fused C++ layer plan: its norms are Llama's).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.llama import MLP, Attention, LlamaForCausalLM, Rotary
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


class Gemma3Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__(cfg, layer_id, tp)
        self.meta = dataclasses.replace(self.meta, scaling=cfg.hf_config.query_pre_attn_scalar**-0.5)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class GeGLU(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        act = getattr(cfg.hf_config, "hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(
                f"Gemma 3 with hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)"
            )
        self.self_attn = Gemma3Attention(cfg, layer_id, tp)
        self.mlp = GeGLU(cfg, tp)
        self.local_rope = cfg.hf_config.layer_types[layer_id] == "sliding_attention"
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


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.tp = tp = tp or TensorParallel()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.inv_freq, cfg.rope_attention_scaling)  # global layers
        with torch.device("cpu"):  # real tensors even while the model is built on the meta device
            local_inv_freq, local_scaling = _rope_frequencies(
                cfg.hf_config, cfg.head_dim, "sliding_attention"
            )
        self.rotary_local = Rotary(local_inv_freq, local_scaling)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.embed_scale = cfg.hidden_size**0.5
        self.logit_softcap = getattr(cfg.hf_config, "final_logit_softcapping", None)
        self.fused_cpu_ops = False
        self._fused_plan = None
        self.tie_weights()

    def use_fused_cpu_ops(self, enable: bool = True) -> None:
        """Gemma 3's layers always run eagerly: the fused layer plan is Llama's (its norms, its MLP)."""
        self.fused_cpu_ops = False

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        h = h * torch.tensor(self.embed_scale).to(h.dtype)  # the scale rounded to the model's dtype, as in HF
        rope_global = self.rotary.cos_sin(batch.positions, h.dtype)
        rope_local = self.rotary_local.cos_sin(batch.positions, h.dtype)
        for layer in self.layers:
            cos, sin = rope_local if layer.local_rope else rope_global
            h = layer(h, cos, sin, batch, backend)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        logits = self._logits(self.norm(h))
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits
