"""Tiny random-weight mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral) for tests, saved as HF
folders."""

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


def moe_config(arch: str) -> Any:
    """A tiny config of `arch`: 8 experts, top-2. Qwen3-MoE: layer 1 dense (`mlp_only_layers`), its top-k
    weights not renormalised (`norm_topk_prob=False`, the other branch from Mixtral's)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **COMMON,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    if arch == "qwen2_moe":  # a shared expert with its sigmoid gate; q/k/v biases; layer 1 dense
        return Qwen2MoeConfig(
            **COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    if arch == "mixtral":
        return MixtralConfig(
            **COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=None
        )
    raise ValueError(arch)


def save_random_moe(path: Path, arch: str, tokenizer: Any = None, *, seed: int = 0, std: float = 0.3) -> Any:
    """Build `arch`'s tiny config with seeded weights (every matrix, router and stacked experts included,
    from N(0, std), so greedy choices and routing sit far from ties), save it (and `tokenizer`) to `path`,
    and return the float32 transformers model."""
    return save_seeded(path, moe_config(arch), tokenizer, seed=seed, std=std)
