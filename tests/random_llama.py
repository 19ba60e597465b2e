"""Tiny random-weight Llama checkpoints for tests, saved as Hugging Face folders with a tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def save_random_llama(path: Path, tokenizer: Any, *, seed: int, std: float, **config: Any) -> str:
    """Build `LlamaConfig(**config)` with seeded random weights, every matrix drawn from N(0, std) (large
    enough that greedy choices sit far from ties, so outputs are stable under round-off), save it and
    `tokenizer` to `path`, and return the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def save_full_vocab_llama(path: Path, tokenizer: Any, *, max_position_embeddings: int = 512) -> str:
    """A 2-layer, 32-wide Llama over `tokenizer`'s whole vocabulary (any text it renders is in range), with
    sharp distributions (std 0.5: greedy choices far from ties) and a tied head."""
    return save_random_llama(
        path,
        tokenizer,
        seed=0,
        std=0.5,
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=1,
        tie_word_embeddings=True,
    )


def save_seeded(
    path: Path,
    config: Any,
    tokenizer: Any,
    *,
    seed: int,
    std: float,
    adjust: Callable[[Any], None] | None = None,
) -> Any:
    """A transformers model of `config` with seeded weights (every matrix, routers and stacked experts
    included, from N(0, std); norm weights perturbed, so (1 + w) norms matter), then `adjust(model)` where
    given (under no_grad: e.g. buffers the weights above do not cover), saved with `tokenizer` to `path`;
    returns the float32 model (the random Gemma, Phi and mixture-of-experts builders share it)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        if adjust is not None:
            adjust(model)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model
