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


HARMONY_TAGS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)

# A minimal harmony chat template written after gpt-oss's (no template ships in the test environment): the
# system and developer headers, tools as TypeScript-like signatures in the `functions` namespace, assistant
# turns on the final channel, calls on the commentary channel to `functions.NAME` with JSON arguments, tool
# results from `functions.NAME` to the assistant, and the generation prompt `<|start|>assistant`.
HARMONY_TEMPLATE = """
{%- set ns = namespace(last_call='') -%}
<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06

Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{% if tools %}Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- set sys = messages | selectattr('role', 'equalto', 'system') | list -%}
{%- if sys or tools %}<|start|>developer<|message|>
{%- if sys %}# Instructions

{{ sys[0].content }}
{%- endif %}
{%- if tools %}
{%- if sys %}{{ '\n\n' }}{% endif %}# Tools

## functions

namespace functions {
{% for t in tools %}
// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions
{%- endif %}<|end|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' and m.tool_calls %}
{%- for c in m.tool_calls %}
{%- set ns.last_call = c.function.name -%}
<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>
{{- c.function.arguments | tojson }}<|call|>
{%- endfor %}
{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'tool' %}<|start|>functions.{{ ns.last_call }} to=assistant<|channel|>commentary<|message|>
{{- m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}
"""


def harmony_tokenizer(base: Any) -> Any:
    """A copy of `base` (the default model's tokenizer) with harmony's tags as added special tokens and
    `HARMONY_TEMPLATE`."""
    import copy

    tok = copy.deepcopy(base)
    tok.add_special_tokens({"additional_special_tokens": list(HARMONY_TAGS)})
    tok.chat_template = HARMONY_TEMPLATE
    return tok
