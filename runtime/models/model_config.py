"""The decoder's view of a Hugging Face config: one place that knows the Llama-family variations.

Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) differ only in the
fields below, so one decoder implementation serves them all. Qwen3-MoE (Qwen3's attention), Qwen2-MoE,
Mixtral (Mistral's) and GLM-4.5 (partial rotary, optional q/k norms) swap some or all MLPs for a mixture of
experts (`MoeConfig`, `runtime.models.moe`). Phi-3 / Phi-4
is Llama with fused checkpoint tensors (split by the loader), partial rotary and LongRoPE (`LongRope`).
Gemma 2's and Gemma 3's layers differ enough to have their own module (`runtime.models.gemma`); their configs
are read here too (Gemma 2's attention logit soft-capping is `attn_logit_softcap`).
So does gpt-oss's (`runtime.models.gpt_oss`: attention sinks, its own mixture of experts, yarn rope).

Sliding-window layers (Mistral's and Phi-3's `sliding_window`, any `layer_types` entry "sliding_attention")
are `sliding_windows[layer]` > 0: the attention backends read only the window, and the KV pool keeps those
layers' K/V in a smaller pool of windows (`runtime.mem_cache.memory_pool`; the prefix reuse rule is in
docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from runtime.models.moe import Routing

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss",
    "Glm4MoeForCausalLM": "glm4_moe",
}
# Rope variants whose frequencies do not depend on the sequence length (dynamic NTK would). LongRoPE's two
# sets are chosen once per server by its context length (`LongRope`).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class LongRope:
    """LongRoPE (Phi-3 / Phi-4): `ModelConfig.inv_freq` holds the short factors' frequencies, this the long
    ones'. transformers uses the long set for a whole sequence once it is longer than
    `original_max_position_embeddings` (Phi-3's `generate` recomputes the cache when it crosses), the short
    set otherwise. A KV cache shared across requests cannot switch a sequence's past keys, so radixlm
    chooses once per server, as llama.cpp does: a context length above `original_max` serves every position
    with the long set (equal to transformers for sequences past it), else the short set (equal to
    transformers for every sequence the server can hold). `ModelConfig.for_context_length` applies it."""

    long_inv_freq: torch.Tensor
    original_max: int


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts MLP: `num_experts` SiLU-gated experts of `intermediate_size`, chosen and weighed
    per token by `routing`; `sparse_layers` lists the layers that have it (the others keep the dense MLP of
    `ModelConfig.intermediate_size`). `score_bias`: the router has a learned choice bias per expert
    (GLM-4.5's e_score_correction_bias). `shared_intermediate_size` > 0: every token also runs one shared
    SiLU-gated expert of that size, scaled by a sigmoid gate of its own where `shared_gated` (Qwen2-MoE's
    `shared_expert` and `shared_expert_gate`), added as it is otherwise (GLM-4.5's `shared_experts`)."""

    num_experts: int
    intermediate_size: int
    routing: Routing
    sparse_layers: frozenset[int]
    score_bias: bool = False
    shared_intermediate_size: int = 0
    shared_gated: bool = True

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    @classmethod
    def from_hf(cls, cfg: Any, kind: str) -> MoeConfig | None:
        layers = range(cfg.num_hidden_layers)
        # gpt-oss: every layer sparse; softmax over the k chosen logits = renormalised top-k (its own block,
        # runtime.models.gpt_oss.GptOssMoe, with biases and a clamped SwiGLU)
        if kind in ("mixtral", "gpt_oss"):  # every layer sparse, top-k always renormalised
            routing = Routing(cfg.num_experts_per_tok, True)
            return cls(cfg.num_local_experts, cfg.intermediate_size, routing, frozenset(layers))
        if kind in ("qwen3_moe", "qwen2_moe"):  # transformers' decoder layers pick sparse layers this way
            dense, step = set(getattr(cfg, "mlp_only_layers", None) or ()), cfg.decoder_sparse_step
            sparse = frozenset(
                i for i in layers if i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0
            )
            return cls(
                cfg.num_experts,
                cfg.moe_intermediate_size,
                Routing(cfg.num_experts_per_tok, cfg.norm_topk_prob),
                sparse,
                shared_intermediate_size=(
                    getattr(cfg, "shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
                ),
            )
        if kind == "glm4_moe":  # the first `first_k_dense_replace` layers dense; sigmoid routing
            routing = Routing(
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                "sigmoid",
                cfg.n_group,
                cfg.topk_group,
                cfg.routed_scaling_factor,
            )
            return cls(
                cfg.n_routed_experts,
                cfg.moe_intermediate_size,
                routing,
                frozenset(range(cfg.first_k_dense_replace, cfg.num_hidden_layers)),
                score_bias=True,
                shared_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
                shared_gated=False,
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
    sliding_windows: tuple[int, ...] = ()  # per layer: 0 global, W > 0 a window of W keys; (): all global
    long_rope: LongRope | None = None
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per head (`AttentionLayer.sinks`)
    attn_logit_softcap: float = 0.0  # Gemma 2: scores soft-capped before the softmax (`AttentionLayer`)

    def sliding_window(self, layer_id: int) -> int:
        return self.sliding_windows[layer_id] if self.sliding_windows else 0

    def for_context_length(self, context_length: int) -> ModelConfig:
        """This config for a server holding sequences of up to `context_length` tokens: LongRoPE's long set
        where that passes its original length (see `LongRope`)."""
        if self.long_rope is None or context_length <= self.long_rope.original_max:
            return self
        return dataclasses.replace(self, inv_freq=self.long_rope.long_inv_freq, long_rope=None)

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
        softcap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0)
        if softcap and kind != "gemma2":
            raise ValueError(
                "attention logit soft-capping (config.attn_logit_softcapping) is supported for Gemma 2, "
                f"not {arch}"
            )
        if softcap < 0:
            raise ValueError(f"config.attn_logit_softcapping must be positive, got {softcap}")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("bidirectional attention (an embedding model's config) is not supported")
        rope_layer_type = "full_attention" if kind == "gemma3_text" else None  # Gemma 3: per layer type
        inv_freq, scaling = _rope_frequencies(cfg, head_dim, rope_layer_type)
        long_rope = None
        if _rope_params(cfg, None).get("rope_type") == "longrope":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            original = _rope_params(cfg, None)["original_max_position_embeddings"]
            long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=original + 1)
            long_rope = LongRope(long_inv.float(), original)
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
            qkv_bias=kind in ("qwen2", "qwen2_moe") or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3_text") or bool(getattr(cfg, "use_qk_norm", False)),
            inv_freq=inv_freq,
            rope_attention_scaling=scaling,
            eos_token_ids=eos_ids,
            hf_config=cfg,
            moe=MoeConfig.from_hf(cfg, kind),
            sliding_windows=_sliding_windows(cfg, kind),
            long_rope=long_rope,
            attention_sinks=kind == "gpt_oss",
            attn_logit_softcap=softcap,
        )


def _sliding_windows(cfg: Any, kind: str) -> tuple[int, ...]:
    """Per layer, its sliding window (0: global), as transformers applies `sliding_window`: per
    `layer_types` where the config lists them (Gemma 3, Qwen2/3's `use_sliding_window`), else to every
    layer for Mistral, Mixtral and Phi-3. A window no shorter than the context is global attention."""
    window = getattr(cfg, "sliding_window", None) or 0
    if window <= 0 or window >= cfg.max_position_embeddings:
        return ()
    types = getattr(cfg, "layer_types", None)
    if types:
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif kind in ("mistral", "mixtral", "phi3"):
        windows = (window,) * cfg.num_hidden_layers
    else:
        return ()
    return windows if any(windows) else ()


def _rope_params(cfg: Any, layer_type: str | None) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {}
    return (params.get(layer_type) or {}) if layer_type is not None else params


def _rope_frequencies(cfg: Any, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies exactly as transformers computes them (same function for scaled variants);
    `layer_type` picks one of per-layer-type parameters (Gemma 3's sliding and full layers). A partial
    rotary factor gives frequencies for the first `head_dim * factor` dims only."""
    params = _rope_params(cfg, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    if rope_type == "default":
        base = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        dim = int(head_dim * params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", **kwargs)
    return inv.float(), float(scaling)
