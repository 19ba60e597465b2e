"""A tiny random-weight gpt-oss checkpoint for tests, saved as a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

WINDOW = 8  # the sliding layers' window: prompts of the tests pass it
EXPERTS, TOP_K = 6, 2


def gpt_oss_config(vocab_size: int = 512, eos_token_id: int | list[int] = 2) -> Any:
    """3 layers (sliding, full, sliding), 4 query heads over 2 KV heads of 16, 6 experts of 32 (top-2), yarn
    rope (factor 4 over an original 256 positions)."""
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        sliding_window=WINDOW,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 256,
        },
        bos_token_id=1,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )


def random_gpt_oss(config: Any, *, seed: int = 0, std: float = 0.3) -> Any:
    """transformers' float32 model of `config` with seeded weights: every matrix, bias and router from
    N(0, std) (greedy choices and routing far from ties), sinks from N(0, 1) (so they matter), norm weights
    perturbed."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 1.0 if name.endswith("sinks") else std)
    return model


def save_random_gpt_oss(path: Path, tokenizer: Any = None, *, seed: int = 0, **config: Any) -> Any:
    """`random_gpt_oss` saved (with `tokenizer`) to `path`; returns the float32 transformers model."""
    model = random_gpt_oss(gpt_oss_config(**config), seed=seed)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model
