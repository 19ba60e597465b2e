"""PEFT LoRA adapters with random weights over a tiny random Llama, saved as PEFT folders, for LoRA tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(
    base_dir: str, out: Path, *, seed: int, rank: int, targets: list[str], alpha: float = 16.0, **extra: Any
) -> str:
    """A `peft` LoRA adapter on the model in `base_dir`, A and B both drawn at random (peft's B starts at
    zero, which would make the adapter a no-op), saved to `out`; returns the folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **extra)
    peft_model = get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5 / rank**0.5)
    peft_model.save_pretrained(out)
    return str(out)


def peft_model(base_dir: str, adapter_dir: str):
    """transformers + peft: the reference for an adapter's outputs."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter_dir).eval()
