"""Tiny random-weight Gemma 2, Gemma 3 and Phi-3 checkpoints for tests, saved as HF folders.

Each carries what sets it apart, at sizes where it shows in a few dozen tokens:
- gemma2: layers sliding (window 8) and global in turn, one rope, query_pre_attn_scalar != head_dim,
  attention logits soft-capped at 3 (low enough that tanh bends most of this model's scores), final logit
  soft-capping, tied embeddings;
- gemma3: layers sliding (window 8), sliding, global, sliding, the two kinds with their own rope (the global
  one linearly scaled), query_pre_attn_scalar != head_dim, final logit soft-capping, tied embeddings;
- phi3: LongRoPE (original length 64, context 256) with partial rotary (0.75 of head_dim), a sliding
  window of 24 on every layer, fused qkv_proj and gate_up_proj tensors in the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.random_llama import save_seeded

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
GEMMA3_WINDOW = 8
GEMMA2_WINDOW = 8
GEMMA2_ATTN_SOFTCAP = 3.0
PHI3_WINDOW = 24
PHI3_ORIGINAL_MAX = 64


# Gemma 3's instruction-tuned chat template (its tokenizer_config.json's): a system message becomes the
# first user turn's prefix, roles must alternate, the assistant's role is "model".
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


def dense_config(arch: str, **overrides: Any) -> Any:
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config

    common = COMMON | overrides
    gemma = dict(
        num_hidden_layers=4,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    )
    if arch == "gemma2":
        return Gemma2Config(
            **common,
            **gemma,
            sliding_window=GEMMA2_WINDOW,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attn_logit_softcapping=GEMMA2_ATTN_SOFTCAP,
            architectures=["Gemma2ForCausalLM"],
        )
    if arch == "gemma3":
        return Gemma3TextConfig(
            **common,
            **gemma,
            sliding_window=GEMMA3_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
            architectures=["Gemma3ForCausalLM"],
        )
    if arch == "phi3":
        rotary_half = int(16 * 0.75) // 2
        return Phi3Config(
            **common,
            num_hidden_layers=3,
            max_position_embeddings=256,
            original_max_position_embeddings=PHI3_ORIGINAL_MAX,
            rms_norm_eps=1e-5,
            sliding_window=PHI3_WINDOW,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": PHI3_ORIGINAL_MAX,
                "factor": 256 / PHI3_ORIGINAL_MAX,
                "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
                "long_factor": [1.0 + 3.0 * i for i in range(rotary_half)],
            },
            tie_word_embeddings=False,
            architectures=["Phi3ForCausalLM"],
        )
    raise ValueError(arch)


def save_random_dense(
    path: Path, arch: str, tokenizer: Any = None, *, seed: int = 0, std: float = 0.3, **overrides: Any
) -> Any:
    """Build `arch`'s tiny config with seeded weights (every matrix from N(0, std), norm weights perturbed,
    so greedy choices sit far from ties and Gemma's (1 + w) norms matter), save it (and `tokenizer`) to
    `path`, and return the float32 transformers model. `overrides`: config fields (e.g. vocab_size)."""
    return save_seeded(path, dense_config(arch, **overrides), tokenizer, seed=seed, std=std)
