"""Which module class builds each architecture a `ModelConfig` names: the Llama decoder, unless the
architecture's layer has its own module."""

from __future__ import annotations

from runtime.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from runtime.models.gpt_oss import GptOssForCausalLM
from runtime.models.llama import LlamaForCausalLM

_OWN_MODULES = {c.__name__: c for c in (Gemma2ForCausalLM, Gemma3ForCausalLM, GptOssForCausalLM)}


def model_class_for(architecture: str) -> type:
    """The module class that builds `architecture` (a ModelConfig's); the Llama decoder serves the rest."""
    return _OWN_MODULES.get(architecture, LlamaForCausalLM)
