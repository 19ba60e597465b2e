"""What a GGUF file must hold to be served: its architecture's conversion rules, its tensor types, and the
names and shapes of its tensors against the config its metadata gives.

Everything here runs before a converted folder is written, so a file that cannot be served is refused at
start-up with a ValueError naming the file, the tensor and the problem, never a traceback from inside numpy or
torch. The rules follow llama.cpp's convert_hf_to_gguf.py: see `ARCHS`.

(The third-party `gguf` package is imported inside functions as `gguf`: absolute imports never mean
`runtime.models.gguf`.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Arch:
    """How llama.cpp's converter writes one `general.architecture`, and what it becomes here."""

    hf_class: str  # the Hugging Face architecture the converted folder declares
    model_type: str
    rope_permuted: bool  # Q/K rows (and biases) reordered for llama.cpp's adjacent-pair RoPE at convert time
    qkv_bias: bool  # attn_q/k/v biases always present (Qwen2); otherwise optional: all three or none
    qk_norm: bool  # per-head RMSNorm on q and k (attn_q_norm / attn_k_norm, [head_dim] each): Qwen3


# llama.cpp writes Llama and Mistral-family models (HF MistralForCausalLM) as "llama" and permutes their Q/K
# rows; Qwen2/2.5 and Qwen3 keep HF's row order (their RoPE rotates half-split pairs in both programs).
ARCHS = {
    "llama": Arch("LlamaForCausalLM", "llama", rope_permuted=True, qkv_bias=False, qk_norm=False),
    "qwen2": Arch("Qwen2ForCausalLM", "qwen2", rope_permuted=False, qkv_bias=True, qk_norm=False),
    "qwen3": Arch("Qwen3ForCausalLM", "qwen3", rope_permuted=False, qkv_bias=False, qk_norm=True),
}


def open_reader(gguf_path: str) -> Any:
    """gguf-py's reader over the file, or a ValueError naming the file when it is not a whole GGUF file."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # gguf-py fails in many ways (ValueError, IndexError, struct/mmap errors)
        raise ValueError(
            f"{gguf_path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e
    size = reader.data.shape[0]
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size or t.data.nbytes != int(t.n_bytes):
            raise ValueError(
                f"{gguf_path} is truncated: tensor {t.name} needs bytes {t.data_offset}..."
                f"{t.data_offset + int(t.n_bytes)} of a {size}-byte file"
            )
    return reader


@functools.cache
def readable_type(qtype: Any) -> bool:
    """True when gguf-py can dequantize tensors of this GGMLQuantizationType (tried on one zero block)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return True
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def check_types(tensors: dict[str, Any]) -> None:
    """Every tensor is of a type gguf-py dequantizes, whole blocks per row; ValueError naming the first that
    is not."""
    from gguf import GGML_QUANT_SIZES

    for name, t in tensors.items():
        qtype = t.tensor_type
        if not readable_type(qtype):
            raise ValueError(
                f"tensor {name} is stored as {qtype.name}, a type radixlm cannot load (gguf-py has no "
                "dequantization for it); re-quantize the model to a common type such as Q4_K_M or Q8_0"
            )
        block, _ = GGML_QUANT_SIZES[qtype]
        if int(t.shape[0]) % block:
            raise ValueError(
                f"tensor {name} ({qtype.name}) has rows of {int(t.shape[0])} elements, not whole blocks of "
                f"{block}"
            )


def expected_shapes(config: dict[str, Any], arch: Arch, qkv_bias: bool) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape ([out, in] for matrices) of every parameter the config's model has."""
    hidden, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_rows, kv_rows = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (q_rows, hidden),
            "self_attn.k_proj.weight": (kv_rows, hidden),
            "self_attn.v_proj.weight": (kv_rows, hidden),
            "self_attn.o_proj.weight": (hidden, q_rows),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        }
        if qkv_bias:
            layer |= {
                "self_attn.q_proj.bias": (q_rows,),
                "self_attn.k_proj.bias": (kv_rows,),
                "self_attn.v_proj.bias": (kv_rows,),
            }
        if arch.qk_norm:
            layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
        shapes |= {p + k: v for k, v in layer.items()}
    return shapes


def check_tensors(
    plan: list[tuple[str, str]], tensors: dict[str, Any], expected: dict[str, tuple[int, ...]]
) -> None:
    """The file's parameters (`plan`: GGUF name, HF name) are exactly `expected`, each of the right shape."""
    seen = set()
    for name, hf in plan:
        if hf not in expected:
            raise ValueError(f"tensor {name} ({hf}) does not belong to a model of this config")
        shape = tuple(int(d) for d in reversed(tensors[name].shape))  # GGUF lists dims innermost first
        if shape != expected[hf]:
            raise ValueError(
                f"tensor {name} has shape {list(shape)}, but the metadata's config needs {list(expected[hf])}"
            )
        seen.add(hf)
    missing = [hf for hf in expected if hf not in seen]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"the file lacks tensors the config needs: {missing[:3]}{more}")
