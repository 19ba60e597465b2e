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
import logging
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger("radixlm.gguf")


@dataclass(frozen=True)
class Arch:
    """How llama.cpp's converter writes one `general.architecture`, and what it becomes here."""

    hf_class: str  # the Hugging Face architecture the converted folder declares
    model_type: str
    rope_permuted: bool  # Q/K rows (and biases) reordered for llama.cpp's adjacent-pair RoPE at convert time
    qkv_bias: bool  # attn_q/k/v biases always present (Qwen2); otherwise optional: all three or none
    qk_norm: bool  # per-head RMSNorm on q and k (attn_q_norm / attn_k_norm, [head_dim] each)
    norm_shift: float = 0.0  # added to every norm weight at convert time (Gemma's (1 + w) norms store 1 + w)
    sandwich: bool = False  # Gemma: post_attention_norm, post_ffw_norm, and ffn_norm is the pre-MLP norm
    fused: bool = False  # Phi-3: attn_qkv (rows q | k | v) and ffn_up (rows gate | up), one tensor each
    moe: bool = False  # every layer's MLP is experts: ffn_{gate,up,down}_exps [n_expert, ...], ffn_gate_inp
    # gpt-oss: attention sinks (attn_sinks [heads]), biases on o, the router and every expert projection,
    # and post_attention_norm (not ffn_norm) as the pre-MLP norm
    sinks: bool = False


# llama.cpp writes Llama and Mistral-family models (HF MistralForCausalLM) as "llama" and permutes their Q/K
# rows; "mistral3" (Ministral 3, Mistral Small 3.x text) is the same llama-shaped decoder with YaRN and
# Llama 4's attention temperature in its metadata, rows permuted alike. Qwen2/2.5, Qwen3, Qwen3-MoE, Phi-3,
# Gemma 2 and 3 and gpt-oss keep HF's row order (their RoPE rotates half-split pairs in both programs).
ARCHS = {
    "llama": Arch("LlamaForCausalLM", "llama", rope_permuted=True, qkv_bias=False, qk_norm=False),
    "mistral3": Arch("LlamaForCausalLM", "llama", rope_permuted=True, qkv_bias=False, qk_norm=False),
    "qwen2": Arch("Qwen2ForCausalLM", "qwen2", rope_permuted=False, qkv_bias=True, qk_norm=False),
    "qwen3": Arch("Qwen3ForCausalLM", "qwen3", rope_permuted=False, qkv_bias=False, qk_norm=True),
    "qwen3moe": Arch(
        "Qwen3MoeForCausalLM", "qwen3_moe", rope_permuted=False, qkv_bias=False, qk_norm=True, moe=True
    ),
    "phi3": Arch("Phi3ForCausalLM", "phi3", rope_permuted=False, qkv_bias=False, qk_norm=False, fused=True),
    "gemma2": Arch(
        "Gemma2ForCausalLM",
        "gemma2",
        rope_permuted=False,
        qkv_bias=False,
        qk_norm=False,
        norm_shift=1.0,
        sandwich=True,
    ),
    "gemma3": Arch(
        "Gemma3ForCausalLM",
        "gemma3_text",
        rope_permuted=False,
        qkv_bias=False,
        qk_norm=True,
        norm_shift=1.0,
        sandwich=True,
    ),
    "gpt-oss": Arch(
        "GptOssForCausalLM",
        "gpt_oss",
        rope_permuted=False,
        qkv_bias=True,
        qk_norm=False,
        moe=True,
        sinks=True,
    ),
}
# Architectures llama.cpp writes that radixlm's decoder cannot run, and why (named in the refusal).
REFUSED = {
    "gemma": "Gemma 1 is not among radixlm's decoders (Gemma 2 and 3 are)",
}

# GGUF block tensor -> HF module (under model.layers.N.), per layout
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_DENSE_MLP = ("ffn_gate", "ffn_up", "ffn_down")
# the experts stacked [n_expert, rows, cols]: `iter_gguf_weights` yields mlp.experts.E.<proj> per expert
STACKED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def block_tensors(arch: Arch) -> dict[str, str]:
    """GGUF block tensor name (between "blk.N." and ".weight") -> HF module name under model.layers.N."""
    names = dict(_BLOCK)
    if arch.sandwich:
        names |= {
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        }
    if arch.fused:
        for n in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
            del names[n]
        names |= {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
    if arch.moe:
        for n in _DENSE_MLP:
            del names[n]
        names["ffn_gate_inp"] = "mlp.gate"
        names |= {g: f"mlp.experts.{hf}" for g, hf in STACKED_EXPERTS.items()}
    if arch.sinks:
        del names["ffn_norm"]
        names |= {
            "post_attention_norm": "post_attention_layernorm",
            "attn_sinks": "self_attn.sinks",
            "ffn_gate_inp": "mlp.router",
        }
    return names


@functools.cache
def _reader_class() -> type:
    """gguf-py's reader, with the same fields, values and tensors, opened faster. gguf-py cuts one array per
    metadata value and per element of every array value (~300k for a 49k-token vocabulary, its merges and
    token types) when the file is opened: 2.1 s for the bundled model's file. Here (1) it slices a plain
    ndarray view of the memory map, not the np.memmap itself, whose every slice runs memmap's own
    __array_finalize__ (0.85 s); and (2) an array value's elements are cut only when the field is first read
    (`_LazyArrayField`): opening walks past them, strings by their lengths alone (0.04 s). Serving reads
    only the tensors and a few scalars; the vocabulary is read once, when a file is first converted."""
    import gguf
    from gguf import GGUFValueType, ReaderField

    class _LazyArrayField(ReaderField):
        """A ReaderField of an array value whose parts, data indices and types gguf-py builds on first use."""

        def __new__(cls, reader, offset: int, name: str, head: list, value_offset: int):
            field = super().__new__(cls, offset, name)
            field.__dict__.update(reader=reader, head=head, value_offset=value_offset, built=None)
            return field

        def _build(self) -> tuple:
            if self.built is None:
                _, parts, idxs, types = self.reader._get_field_parts(self.value_offset, GGUFValueType.ARRAY)
                self.__dict__["built"] = (self.head + parts, [i + len(self.head) for i in idxs], types)
            return self.built

        parts = property(lambda self: self._build()[0])
        data = property(lambda self: self._build()[1])
        types = property(lambda self: self._build()[2])

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count, dt = int(count), np.dtype(dtype)
            arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

        def _build_fields(self, offs: int, count: int) -> int:
            for _ in range(count):
                orig = offs
                klen, kdata = self._get_str(offs)
                offs += int(klen.nbytes + kdata.nbytes)
                raw_type = self._get(offs, np.uint32)
                offs += int(raw_type.nbytes)
                head = [klen, kdata, raw_type]
                name = str(bytes(kdata), encoding="utf-8")
                if raw_type[0] != GGUFValueType.ARRAY:
                    size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
                    self._push_field(
                        ReaderField(orig, name, head + parts, [i + len(head) for i in idxs], types),
                        skip_sum=True,
                    )
                else:
                    size = self._array_size(offs)
                    if offs + size > self.data.shape[0]:
                        raise ValueError(f"the array {name!r} runs past the end of the file")
                    self._push_field(_LazyArrayField(self, orig, name, head, offs), skip_sum=True)
                offs += size
            return offs

        def _array_size(self, offs: int) -> int:
            """Bytes of the array value at `offs` (item type, count, items): scalar items by their size,
            strings by walking their length prefixes, nested arrays as gguf-py walks them."""
            item_type = int(self._get(offs, np.uint32)[0])
            n = int(self._get(offs + 4, np.uint64)[0])
            end = offs + 12
            scalar = self.gguf_scalar_to_np.get(GGUFValueType(item_type))
            if scalar is not None:
                return 12 + n * np.dtype(scalar).itemsize
            if item_type != GGUFValueType.STRING:
                return self._get_field_parts(offs, GGUFValueType.ARRAY)[0]
            order = "<" if (self.byte_order == "I") == (sys.byteorder == "little") else ">"
            lengths = struct.Struct(order + "Q")
            raw = self.__dict__["_plain"]
            for _ in range(n):  # struct.error past the end of the file: open_reader's ValueError
                end += 8 + lengths.unpack_from(raw, end)[0]
            return end - offs

    return Reader


def open_reader(gguf_path: str) -> Any:
    """gguf-py's reader over the file, or a ValueError naming the file when it is not a whole GGUF file."""
    try:
        reader = _reader_class()(gguf_path)
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
    """HF parameter name -> shape ([out, in] for matrices) of every parameter the config's model has, as the
    file stores it: Phi-3's fused qkv_proj / gate_up_proj whole, a mixture of experts' projections stacked
    as mlp.experts.<proj>.weight [n_expert, out, in]."""
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
        layer: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.o_proj.weight": (hidden, q_rows),
        }
        if arch.fused:
            layer |= {
                "self_attn.qkv_proj.weight": (q_rows + 2 * kv_rows, hidden),
                "mlp.gate_up_proj.weight": (2 * inter, hidden),
            }
        else:
            layer |= {
                "self_attn.q_proj.weight": (q_rows, hidden),
                "self_attn.k_proj.weight": (kv_rows, hidden),
                "self_attn.v_proj.weight": (kv_rows, hidden),
            }
        if arch.moe:
            n, moe_inter = _experts(config)
            layer |= {
                f"mlp.{'router' if arch.sinks else 'gate'}.weight": (n, hidden),
                "mlp.experts.gate_proj.weight": (n, moe_inter, hidden),
                "mlp.experts.up_proj.weight": (n, moe_inter, hidden),
                "mlp.experts.down_proj.weight": (n, hidden, moe_inter),
            }
            if arch.sinks:
                layer |= {
                    "self_attn.o_proj.bias": (hidden,),
                    "self_attn.sinks.weight": (config["num_attention_heads"],),
                    "mlp.router.bias": (n,),
                    "mlp.experts.gate_proj.bias": (n, moe_inter),
                    "mlp.experts.up_proj.bias": (n, moe_inter),
                    "mlp.experts.down_proj.bias": (n, hidden),
                }
        elif not arch.fused:
            layer |= {
                "mlp.gate_proj.weight": (inter, hidden),
                "mlp.up_proj.weight": (inter, hidden),
            }
        if not arch.moe:
            layer["mlp.down_proj.weight"] = (hidden, inter)
        if arch.sandwich:
            layer |= {
                "pre_feedforward_layernorm.weight": (hidden,),
                "post_feedforward_layernorm.weight": (hidden,),
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


def _experts(config: dict[str, Any]) -> tuple[int, int]:
    """(experts, rows of each): Qwen3-MoE's config keys, or gpt-oss's (num_local_experts, and experts as wide
    as its intermediate_size)."""
    if "num_local_experts" in config:
        return config["num_local_experts"], config["intermediate_size"]
    return config["num_experts"], config["moe_intermediate_size"]


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


def f32(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999974e-06; keep the shortest decimal that round-trips."""
    return float(str(np.float32(value)))


# Gemma 3 as llama.cpp runs it (llama-model.cpp): every 6th layer global, the others sliding; the sliding
# layers' RoPE base is 10000, unscaled, whatever the file's rope keys say (those are the global layers').
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def arch_config(name: str, meta: dict[str, Any], tensors: dict[str, Any], config: dict[str, Any]) -> dict:
    """`config` (the keys every architecture shares, built by `runtime.models.gguf.gguf_config`) completed
    with what architecture `name` adds, read from its metadata as llama.cpp reads it."""

    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{name}.{k}", default)

    if name == "gemma2":
        return _gemma2_config(key, config)
    if name == "gemma3":
        return _gemma3_config(key, config)
    if name == "phi3":
        return _phi3_config(key, tensors, config)
    if name == "qwen3moe":
        if key("expert_count") is None or key("expert_used_count") is None:
            raise ValueError("GGUF metadata lacks qwen3moe.expert_count / expert_used_count")
        if int(key("expert_shared_count", 0)):
            raise ValueError("shared experts (qwen3moe.expert_shared_count) are not supported")
        # llama.cpp's qwen3moe graph routes softmax top-k with the k weights renormalised, in every layer
        return config | {
            "num_experts": int(key("expert_count")),
            "num_experts_per_tok": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length", config["intermediate_size"])),
            "norm_topk_prob": bool(key("expert_weights_norm", True)),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": config["num_hidden_layers"],
        }
    if name == "mistral3":
        return _mistral3_config(key, config)
    if name == "gpt-oss":
        return _gpt_oss_config(key, config)
    return config


# Gemma 2 as llama.cpp runs it (llama-model.cpp): layers sliding and global in turn, sliding first; one rope
# for both; where the file has no key, a window of 4096 and caps of 50 (attention) and 30 (final logits).
GEMMA2_SWA_PATTERN = 2
GEMMA2_DEFAULT_WINDOW = 4096
GEMMA2_DEFAULT_ATTN_SOFTCAP = 50.0
GEMMA2_DEFAULT_FINAL_SOFTCAP = 30.0


def _gemma_layers(config: dict[str, Any], layers_27b: int, window: int, sliding: list[bool]) -> dict:
    """What Gemma 2's and 3's configs share: `config` without its rope keys (each sets its own), GeGLU, the
    query scale and the layer types. llama.cpp scales Gemma's queries by 1 / sqrt(head_dim), except for the
    27B (Gemma 2: 46 layers, Gemma 3: 62): 1 / sqrt(hidden / heads)."""
    if config["num_hidden_layers"] == layers_27b:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = config["head_dim"]
    out = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    return out | {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s and window else "full_attention" for s in sliding],
    }


def _gemma2_config(key: Any, config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    window = int(key("attention.sliding_window", GEMMA2_DEFAULT_WINDOW) or 0)
    sliding = [i % GEMMA2_SWA_PATTERN < GEMMA2_SWA_PATTERN - 1 for i in range(layers)]
    if config["rope_scaling"]:
        kind = config["rope_scaling"].get("rope_type")
        raise ValueError(f"Gemma 2 with {kind} rope scaling is not supported (llama.cpp's files have none)")
    attn_cap = float(key("attn_logit_softcapping", GEMMA2_DEFAULT_ATTN_SOFTCAP))
    final_cap = float(key("final_logit_softcapping", GEMMA2_DEFAULT_FINAL_SOFTCAP))
    if attn_cap <= 0 or final_cap <= 0:
        raise ValueError(
            f"gemma2.attn_logit_softcapping ({attn_cap}) and final_logit_softcapping ({final_cap}) must be "
            "positive (llama.cpp always applies both)"
        )
    return _gemma_layers(config, 46, window, sliding) | {
        "rope_parameters": {"rope_type": "default", "rope_theta": config["rope_theta"]},
        "attn_logit_softcapping": f32(attn_cap),
        "final_logit_softcapping": f32(final_cap),
    }


def _gemma3_config(key: Any, config: dict[str, Any]) -> dict[str, Any]:
    layers, window = config["num_hidden_layers"], int(key("attention.sliding_window", 0) or 0)
    pattern = key("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):  # per layer: True where the layer is sliding
        sliding = [bool(v) for v in pattern]
    else:
        sliding = (
            [(i + 1) % int(pattern) != 0 for i in range(layers)] if int(pattern) > 0 else [False] * layers
        )
    if len(sliding) != layers:
        raise ValueError(
            f"gemma3.attention.sliding_window_pattern has {len(sliding)} entries for {layers} layers"
        )
    full = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    scaling = config["rope_scaling"] or {}
    if scaling and scaling.get("rope_type") != "linear":
        raise ValueError(f"Gemma 3 with {scaling.get('rope_type')} rope scaling is not supported (linear is)")
    if key("attn_logit_softcapping"):
        raise ValueError("attention logit soft-capping (gemma3.attn_logit_softcapping) is not supported")
    softcap = key("final_logit_softcapping")
    return _gemma_layers(config, 62, window, sliding) | {
        "rope_parameters": {
            "full_attention": full | scaling,
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE},
        },
        "final_logit_softcapping": f32(softcap) if softcap else None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def _phi3_config(key: Any, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    head_dim = config["head_dim"]
    rope_dim = int(key("rope.dimension_count", head_dim))
    window = int(key("attention.sliding_window", 0) or 0)  # 0: Phi-4, no window
    orig = int(key("rope.scaling.original_context_length", config["max_position_embeddings"]))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    if rope_dim != head_dim:
        rope["partial_rotary_factor"] = rope_dim / head_dim
    has_long, has_short = "rope_factors_long.weight" in tensors, "rope_factors_short.weight" in tensors
    if has_long != has_short:
        raise ValueError("the file has one of rope_factors_long / rope_factors_short but not the other")
    if has_long:  # LongRoPE: per-frequency divisors for sequences past `orig` (long) and within it (short)
        from gguf.quants import dequantize

        factors = {}
        for which in ("long", "short"):
            t = tensors[f"rope_factors_{which}.weight"]
            v = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
            if v.shape[0] != rope_dim // 2:
                raise ValueError(
                    f"tensor rope_factors_{which}.weight has {v.shape[0]} entries, the rope needs "
                    f"{rope_dim // 2}"
                )
            factors[which] = [f32(x) for x in v]
        ctx = config["max_position_embeddings"]
        rope |= {
            "rope_type": "longrope",
            "original_max_position_embeddings": orig,
            "factor": ctx / orig,
            "long_factor": factors["long"],
            "short_factor": factors["short"],
        }
        attn = key("rope.scaling.attn_factor")
        scale = ctx / orig
        default = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
        if attn is not None and abs(float(attn) - default) > 1e-5:
            rope["attention_factor"] = f32(attn)
    out = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    return out | {
        "rope_parameters": rope,
        "original_max_position_embeddings": orig,
        "sliding_window": window or None,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attention_dropout": 0.0,
    }


def _mistral3_config(key: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Llama's config; Llama 4's attention temperature (queries scaled by 1 + beta * log(1 + floor(pos /
    L))) is 1 below L, so a file with it is served up to L positions (exactly, with no scaling to apply)."""
    beta = float(key("attention.temperature_scale", 0.0) or 0.0)
    if beta == 0.0:
        return config
    length = key("attention.temperature_length") or key("rope.scaling.original_context_length")
    if not length:
        raise ValueError(
            "mistral3.attention.temperature_scale is set but neither attention.temperature_length nor "
            "rope.scaling.original_context_length says from which position it applies"
        )
    ctx = min(int(config["max_position_embeddings"]), int(length))
    if ctx < int(config["max_position_embeddings"]):
        logger.warning(
            "mistral3 file: Llama 4 attention temperature (beta %g) starts at position %d, which radixlm "
            "does not apply; the context is limited to %d tokens (the file says %d), where it is exactly 1",
            beta, int(length), ctx, int(config["max_position_embeddings"]),
        )  # fmt: skip
    return config | {"max_position_embeddings": ctx}


# gpt-oss as llama.cpp runs it (models/openai-moe.cpp): the clamped SwiGLU's limit and alpha are constants of
# its graph (LLM_FFN_SWIGLU_OAI_MOE), not metadata; the layers alternate sliding and global, sliding first,
# unless attention.sliding_window_pattern says otherwise.
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_SWA_PATTERN = 2


def _gpt_oss_config(key: Any, config: dict[str, Any]) -> dict[str, Any]:
    """transformers' GptOssConfig keys from a gpt-oss file. YaRN comes from the shared rope keys; a file
    carries no `truncate`, so its correction range is rounded to whole dimensions as llama.cpp does
    (transformers' default; OpenAI's own config does not round)."""
    if key("expert_count") is None or key("expert_used_count") is None:
        raise ValueError("GGUF metadata lacks gpt-oss.expert_count / expert_used_count")
    layers, window = config["num_hidden_layers"], int(key("attention.sliding_window", 0) or 0)
    pattern = key("attention.sliding_window_pattern", GPT_OSS_SWA_PATTERN)
    if isinstance(pattern, list):  # per layer: True where the layer is sliding
        sliding = [bool(v) for v in pattern]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    if len(sliding) != layers:
        raise ValueError(
            f"gpt-oss.attention.sliding_window_pattern has {len(sliding)} entries for {layers} layers"
        )
    base_swa = key("rope.freq_base_swa")
    if base_swa is not None and f32(base_swa) != config["rope_theta"]:
        raise ValueError(
            f"gpt-oss.rope.freq_base_swa {f32(base_swa)} differs from rope.freq_base {config['rope_theta']}: "
            "one rope base for both layer types is supported"
        )
    scale = key("expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ValueError(
            f"gpt-oss.expert_weights_scale {scale} is not supported (llama.cpp's files have none)"
        )
    return config | {
        "num_local_experts": int(key("expert_count")),
        "num_experts_per_tok": int(key("expert_used_count")),
        "intermediate_size": int(key("expert_feed_forward_length", config["intermediate_size"])),
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s and window else "full_attention" for s in sliding],
        "swiglu_limit": GPT_OSS_SWIGLU_LIMIT,
        "attention_bias": True,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
    }
