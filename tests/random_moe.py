"""Tiny random-weight mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5) for tests, saved
as HF folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.random_llama import save_seeded

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


# Qwen3-MoE's and Qwen2-MoE's: layer 1 dense (`mlp_only_layers`), top-k weights not renormalised
QWEN_MOE = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
    norm_topk_prob=False,
)


def moe_config(arch: str) -> Any:
    """A tiny config of `arch`: 8 experts, top-2. Qwen3-MoE and Qwen2-MoE: layer 1 dense (`mlp_only_layers`),
    their top-k weights not renormalised (`norm_topk_prob=False`, the other branch from Mixtral's); Qwen2-MoE
    adds a shared expert with its sigmoid gate, and q/k/v biases. GLM-4.5: layer 0 dense
    (`first_k_dense_replace`), sigmoid routing limited to 1 of 2 groups of 4 experts, weights renormalised
    and scaled by 2.5, an ungated shared expert, q/k/v biases, q/k norms and rotary on half of each head."""
    from transformers import Glm4MoeConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**COMMON, **QWEN_MOE, head_dim=16)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**COMMON, **QWEN_MOE, shared_expert_intermediate_size=64)
    if arch == "mixtral":
        return MixtralConfig(
            **COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=None
        )
    if arch == "glm4_moe":
        return Glm4MoeConfig(
            **COMMON,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            attention_bias=True,
            use_qk_norm=True,
        )
    raise ValueError(arch)


def save_random_moe(path: Path, arch: str, tokenizer: Any = None, *, seed: int = 0, std: float = 0.3) -> Any:
    """Build `arch`'s tiny config with seeded weights (every matrix, router and stacked experts included,
    from N(0, std), so greedy choices and routing sit far from ties), save it (and `tokenizer`) to `path`,
    and return the float32 transformers model."""

    def choice_bias(model: Any) -> None:
        """GLM-4.5's routers' choice bias is a buffer (zeros at init): random, so that it matters."""
        import torch

        g = torch.Generator().manual_seed(seed + 1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)

    adjust = choice_bias if arch == "glm4_moe" else None
    return save_seeded(path, moe_config(arch), tokenizer, seed=seed, std=std, adjust=adjust)
