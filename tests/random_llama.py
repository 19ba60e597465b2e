"""Tiny random-weight Llama checkpoints for tests, saved as Hugging Face folders with a tokenizer."""

from __future__ import annotations

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
