"""The decoder's view of a Hugging Face config: one place that knows the Llama-family variations.

Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) differ only in the
fields below, so one decoder implementation serves them all. Qwen3-MoE (Qwen3's attention) and Mixtral
(Mistral's) swap some or all MLPs for a mixture of experts (`MoeConfig`, `runtime.models.moe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# Rope variants whose frequencies do not depend on the sequence length (dynamic NTK would).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts MLP: `num_experts` SiLU-gated experts of `intermediate_size`, softmax top-k
    routing, the k weights renormalised to sum to 1 when `renormalize`; `sparse_layers` lists the layers
    that have it (the others keep the dense MLP of `ModelConfig.intermediate_size`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: frozenset[int]

    @classmethod
    def from_hf(cls, cfg: Any, kind: str) -> MoeConfig | None:
        if kind == "mixtral":  # every layer sparse, top-k always renormalised
            return cls(
                cfg.num_local_experts,
                cfg.num_experts_per_tok,
                cfg.intermediate_size,
                True,
                frozenset(range(cfg.num_hidden_layers)),
            )
        if kind == "qwen3_moe":  # transformers' Qwen3MoeDecoderLayer picks sparse layers this way
            dense, step = set(getattr(cfg, "mlp_only_layers", None) or ()), cfg.decoder_sparse_step
            sparse = frozenset(
                i
                for i in range(cfg.num_hidden_layers)
                if i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0
            )
            return cls(
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                cfg.norm_topk_prob,
                sparse,
            )
        return None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    inv_freq: torch.Tensor  # [head_dim // 2] float32
    rope_attention_scaling: float
    eos_token_ids: tuple[int, ...]
    hf_config: Any  # the source transformers config, for anything model-specific
    moe: MoeConfig | None = None  # set for mixture-of-experts architectures

    @classmethod
    def from_hf(cls, cfg: Any) -> ModelConfig:
        archs = getattr(cfg, "architectures", None) or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.model_type!r}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        kind = SUPPORTED_ARCHITECTURES[arch]
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if getattr(cfg, "sliding_window", None) and getattr(
            cfg, "use_sliding_window", kind in ("mistral", "mixtral")
        ):
            if cfg.sliding_window < cfg.max_position_embeddings:
                raise ValueError("sliding-window attention is not supported (config.sliding_window is set)")
        inv_freq, scaling = _rope_frequencies(cfg, head_dim)
        eos = getattr(cfg, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=kind in ("qwen3", "qwen3_moe"),
            inv_freq=inv_freq,
            rope_attention_scaling=scaling,
            eos_token_ids=eos_ids,
            hf_config=cfg,
            moe=MoeConfig.from_hf(cfg, kind),
        )


def _rope_frequencies(cfg: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies exactly as transformers computes them (same function for scaled variants)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    if rope_type == "default":
        base = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv.float(), float(scaling)
