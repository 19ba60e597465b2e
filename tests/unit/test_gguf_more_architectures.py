"""GGUF files of Gemma 2, Gemma 3, Phi-3, Mistral 3 and Qwen3-MoE served through radixlm's model runner.

Each test builds a tiny seeded transformers model and writes it as a GGUF following llama.cpp's
convert_hf_to_gguf.py for its architecture:
- gemma2: every norm weight stored as 1 + w; query_pre_attn_scalar = head_dim; layers sliding and global in
  turn (attention.sliding_window); attn_logit_softcapping (low, so that it bends the scores) and
  final_logit_softcapping; no rope key (llama.cpp's default base); tied embeddings; rows in HF order;
- gemma3: every norm weight stored as 1 + w; query_pre_attn_scalar = head_dim; every 6th layer global, the
  others sliding (attention.sliding_window), their rope base 10000 and the global layers' rope.freq_base with
  linear scaling; final_logit_softcapping; tied embeddings (no output.weight); rows in HF order;
- phi3: fused attn_qkv and ffn_up (gate | up) whole; partial rotary (rope.dimension_count); LongRoPE as the
  rope_factors_long / _short tensors with rope.scaling.original_context_length and attn_factor; a sliding
  window on every layer; rows in HF order;
- mistral3 (Ministral 3): llama's tensors, Q/K rows permuted, YaRN (rope.scaling.*, yarn_log_multiplier) and
  Llama 4's attention temperature (attention.temperature_scale), served up to the position it starts at;
- qwen3moe: the experts stacked as ffn_{gate,up,down}_exps [n_expert, out, in] and the router ffn_gate_inp,
  q/k norms, rows in HF order.
F32 files must give transformers' float32 logits and greedy tokens (both the float path and gguf_native);
Q8_0 and a Q4_K_M-like mix served in place must agree with the float32 model of the file's own dequantized
weights within test_gguf_native's top-1 bound. Bad files are ValueErrors naming the tensor.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from runtime.models import model_loader as ml
from runtime.models.gguf_linear import GGUFLinear
from runtime.models.moe_fused import GGUFExperts
from tests.unit.test_gguf_architectures import (
    VOCAB,
    assert_refused,
    encode,
    hf_logits,
    runner_for,
    served_logits,
    write_metadata,
)
from tests.unit.test_gguf_native import MIN_AGREEMENT, agreement
from tests.unit.test_model_loader import llamacpp_permute

os.environ.setdefault("HF_HUB_OFFLINE", "1")

KINDS = ("gemma2", "gemma3", "phi3", "mistral3", "qwen3moe")
PHI3_ORIGINAL, PHI3_CONTEXT, PHI3_ROTARY = 64, 256, 0.75
MISTRAL3_ORIGINAL = 128
# prompts of <= 64 tokens: within Phi-3's original length (short factors, as transformers picks for them)
PROMPTS = [np.random.default_rng(i).integers(3, VOCAB, n).tolist() for i, n in enumerate((40, 64, 23))]
Q4_K_M = {"attn_v.weight": Q.Q6_K, "attn_qkv.weight": Q.Q6_K, "ffn_down.weight": Q.Q6_K,
          "ffn_down_exps.weight": Q.Q6_K}  # fmt: skip


def hf_config(kind: str, **overrides: Any) -> Any:
    from transformers import Gemma2Config, Gemma3TextConfig, Ministral3Config, Phi3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6,
    )  # fmt: skip
    if kind == "gemma2":
        return Gemma2Config(
            **common, num_hidden_layers=4, head_dim=64, max_position_embeddings=1024, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,  # llama.cpp's: in turn, sliding first
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, query_pre_attn_scalar=64,
            attn_logit_softcapping=1.0, final_logit_softcapping=30.0, tie_word_embeddings=True,
        )  # fmt: skip
    if kind == "gemma3":
        return Gemma3TextConfig(
            **common, num_hidden_layers=6, head_dim=64, max_position_embeddings=1024, sliding_window=8,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],  # llama.cpp's: every 6th global
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
            query_pre_attn_scalar=64, final_logit_softcapping=30.0, tie_word_embeddings=True,
        )  # fmt: skip
    if kind == "phi3":
        half = int(64 * PHI3_ROTARY) // 2
        return Phi3Config(
            **common, num_hidden_layers=2, max_position_embeddings=PHI3_CONTEXT,
            original_max_position_embeddings=PHI3_ORIGINAL, sliding_window=24, tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": PHI3_ROTARY,
                "original_max_position_embeddings": PHI3_ORIGINAL, "factor": PHI3_CONTEXT / PHI3_ORIGINAL,
                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [1.0 + 3.0 * i for i in range(half)],
            },
        )  # fmt: skip
    if kind == "mistral3":
        return Ministral3Config(
            **common, num_hidden_layers=2, head_dim=64, max_position_embeddings=512,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                "original_max_position_embeddings": MISTRAL3_ORIGINAL, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
            },
        )  # fmt: skip
    moe = dict(num_hidden_layers=2, head_dim=64, max_position_embeddings=512, moe_intermediate_size=256,
               num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
               tie_word_embeddings=False)  # fmt: skip
    return Qwen3MoeConfig(**(common | moe | overrides))


def tiny_model(kind: str, seed: int = 0, **overrides: Any) -> Any:
    """A seeded random transformers model; norms perturbed so their code paths (and Gemma's 1 + w) matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(kind, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() >= 2:
                p.normal_(0, 0.05)
    return model


_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp",
}  # fmt: skip
_GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip


def to_gguf(kind: str, cfg: Any, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The HF state dict as llama.cpp's converter writes it for `kind` (float32, before quantization)."""
    out: dict[str, np.ndarray] = {}
    for name, t in state.items():
        a = t.numpy().astype(np.float32)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in _GLOBAL:
            gname = _GLOBAL[name]
        else:
            layer, module = name.split(".", 3)[2:]
            module = module.rsplit(".", 1)[0] if module.endswith(".weight") else module
            b = f"blk.{layer}."
            if module == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows then up rows
                out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = np.split(a, 2, axis=1)
                continue
            if module == "mlp.experts.down_proj":
                out[b + "ffn_down_exps.weight"] = a
                continue
            short = (_GEMMA if kind.startswith("gemma") else {}).get(module) or _BLOCK[module]
            gname = f"{b}{short}.weight"
            if kind == "mistral3" and short in ("attn_q", "attn_k"):
                a = llamacpp_permute(
                    a, cfg.num_attention_heads if short == "attn_q" else cfg.num_key_value_heads
                )
        if kind.startswith("gemma") and gname.endswith("norm.weight"):
            a = a + 1.0  # Gemma's RMSNorm scales by 1 + w: llama.cpp stores 1 + w
        out[gname] = a
    return out


def from_gguf(kind: str, cfg: Any, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """`to_gguf`'s inverse: the HF state dict a file's (dequantized) tensors encode."""
    inverse = {(f"blk.{i}.{v}.weight"): f"model.layers.{i}.{k}.weight" for i in range(cfg.num_hidden_layers)
               for k, v in (_BLOCK | (_GEMMA if kind.startswith("gemma") else {})).items()
               if k != "mlp.gate_up_proj"}  # fmt: skip
    inverse |= {v: k for k, v in _GLOBAL.items()}
    if kind == "phi3":
        inverse |= {f"blk.{i}.ffn_up.weight": f"model.layers.{i}.mlp.gate_up_proj.weight"
                    for i in range(cfg.num_hidden_layers)}  # fmt: skip
    state: dict[str, torch.Tensor] = {}
    for gname, a in arrays.items():
        b = gname.rsplit(".", 2)[0] + "."
        layer = b.split(".")[1] if b.startswith("blk.") else ""
        if gname.endswith("ffn_gate_exps.weight"):
            up = arrays[b + "ffn_up_exps.weight"]
            state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.from_numpy(
                np.concatenate([a, up], 1)
            )
            continue
        if gname.endswith("ffn_up_exps.weight"):
            continue
        if gname.endswith("ffn_down_exps.weight"):
            state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.from_numpy(a.copy())
            continue
        if kind.startswith("gemma") and gname.endswith("norm.weight"):
            a = a - 1.0
        if kind == "mistral3" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            n = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads
            a = a.reshape(n, a.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(a.shape)
        state[inverse[gname]] = torch.from_numpy(np.ascontiguousarray(a))
    return state


def metadata(kind: str, cfg: Any) -> dict[str, Any]:
    keys: dict[str, Any] = {
        "block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "context_length": cfg.max_position_embeddings,
    }  # fmt: skip
    rope = cfg.rope_parameters
    if kind == "gemma2":  # Gemma2Model's keys: no rope key at all
        keys |= {"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                 "attn_logit_softcapping": cfg.attn_logit_softcapping,
                 "final_logit_softcapping": cfg.final_logit_softcapping,
                 "attention.sliding_window": cfg.sliding_window}  # fmt: skip
    elif kind == "gemma3":
        full = rope["full_attention"]
        keys |= {"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                 "rope.freq_base": full["rope_theta"], "rope.scaling.type": "linear",
                 "rope.scaling.factor": full["factor"],
                 "final_logit_softcapping": cfg.final_logit_softcapping,
                 "attention.sliding_window": cfg.sliding_window}  # fmt: skip
    elif kind == "phi3":
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        scale = PHI3_CONTEXT / PHI3_ORIGINAL
        keys |= {"rope.scaling.original_context_length": PHI3_ORIGINAL, "rope.freq_base": rope["rope_theta"],
                 "rope.dimension_count": int(head_dim * PHI3_ROTARY),
                 "attention.sliding_window": cfg.sliding_window,
                 "rope.scaling.attn_factor":
                     math.sqrt(1 + math.log(scale) / math.log(PHI3_ORIGINAL))}  # fmt: skip
    elif kind == "mistral3":  # LlamaModel's keys, and Ministral3Model's two
        keys |= {"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                 "vocab_size": cfg.vocab_size, "rope.dimension_count": cfg.head_dim,
                 "rope.freq_base": rope["rope_theta"], "rope.scaling.type": "yarn",
                 "rope.scaling.factor": rope["factor"],
                 "rope.scaling.original_context_length": MISTRAL3_ORIGINAL,
                 "rope.scaling.yarn_beta_fast": rope["beta_fast"],
                 "rope.scaling.yarn_beta_slow": rope["beta_slow"],
                 "rope.scaling.yarn_log_multiplier": rope["mscale_all_dim"],
                 "attention.temperature_scale": rope["llama_4_scaling_beta"]}  # fmt: skip
    else:
        keys |= {"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                 "rope.freq_base": rope["rope_theta"], "expert_count": cfg.num_experts,
                 "expert_used_count": cfg.num_experts_per_tok,
                 "expert_feed_forward_length": cfg.moe_intermediate_size}  # fmt: skip
    return keys


def write_gguf(
    path: Path,
    model: Any,
    kind: str,
    *,
    qtype: Q = Q.F32,
    types: dict[str, Q] | None = None,
    drop: tuple[str, ...] = (),
    meta: dict[str, Any] | None = None,
    reshape: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would for `kind` (matrices as `qtype`, `types` by name ending; norms and the
    router F32; rows that are not whole blocks of a type fall back to Q8_0); returns the HF state dict the
    file encodes (gguf-py's dequantization of what was written)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), kind)
    w.add_name(f"{kind}-tiny")
    write_metadata(w, kind, metadata(kind, cfg) | (meta or {}), "default")
    rng = np.random.default_rng(1)
    back: dict[str, np.ndarray] = {}
    for gname, a in to_gguf(kind, cfg, model.state_dict()).items():
        if gname in drop:
            continue
        t_type = Q.F32
        if a.ndim >= 2 and qtype != Q.F32 and not gname.endswith("ffn_gate_inp.weight"):
            want = next((t for end, t in (types or {}).items() if gname.endswith(end)), qtype)
            t_type = want if a.shape[-1] % gguf.GGML_QUANT_SIZES[want][0] == 0 else Q.Q8_0
        flat = a.reshape(-1, a.shape[-1])
        data = np.ascontiguousarray(encode(flat, t_type, rng) if t_type != Q.F32 else flat)
        data = data.reshape(*a.shape[:-1], data.shape[-1])
        if reshape and gname in reshape:
            data = np.zeros(reshape[gname], np.float32)
        w.add_tensor(gname, data, raw_dtype=None if data.dtype == np.float32 else t_type)
        back[gname] = np.asarray(dequantize(data, t_type), dtype=np.float32).reshape(data.shape[:-1] + (-1,))
    if kind == "phi3":  # LongRoPE's factors, as Phi3MiniModel.generate_extra_tensors writes them
        rope = cfg.rope_parameters
        for which in ("long", "short"):
            if f"rope_factors_{which}.weight" not in drop:
                w.add_tensor(f"rope_factors_{which}.weight", np.asarray(rope[f"{which}_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return from_gguf(kind, cfg, back) if not drop and not reshape else {}


def serve(tmp_path: Path, name: str, kind: str, quantization: str) -> Any:
    folder = ml.resolve_model_path(str(tmp_path / name), str(tmp_path / "cache"))
    kwargs = {"context_length": PHI3_ORIGINAL} if kind == "phi3" else {}
    return runner_for(folder, quantization=quantization, **kwargs)


def with_weights(model: Any, state: dict[str, torch.Tensor]) -> Any:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return ref


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    """One tiny model per kind; "qwen3moe-all": the same experts, every one of them routed to each token."""
    every = {"num_experts_per_tok": 4}
    return {kind: tiny_model(kind) for kind in KINDS} | {"qwen3moe-all": tiny_model("qwen3moe", **every)}


@pytest.mark.parametrize("kind", KINDS)
def test_f32_file_serves_like_transformers(tmp_path: Path, models: dict[str, Any], kind: str) -> None:
    """The float path (--quantization none) and gguf_native (float tensors as nn.Linear) both give
    transformers' logits and greedy tokens at every position."""
    model = models[kind]
    encoded = write_gguf(tmp_path / "m.gguf", model, kind)
    for name, t in model.state_dict().items():  # the writer's inverse: the file holds the model
        if name in encoded:
            torch.testing.assert_close(encoded[name], t, atol=1e-6, rtol=0)
    ref = hf_logits(model, PROMPTS)
    for quantization in ("none", "gguf_native"):
        runner = serve(tmp_path, "m.gguf", kind, quantization)
        assert runner.config.architecture == {"gemma2": "Gemma2ForCausalLM",
                                              "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                                              "mistral3": "LlamaForCausalLM",
                                              "qwen3moe": "Qwen3MoeForCausalLM"}[kind]  # fmt: skip
        for got, want in zip(served_logits(runner, PROMPTS), ref, strict=True):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
            assert torch.equal(got.argmax(-1), want.argmax(-1)), quantization


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K_M"])
def test_quantized_file_served_in_place_agrees(
    tmp_path: Path, models: dict[str, Any], kind: str, mix: str
) -> None:
    """The file's blocks served in place against float32 on the same (dequantized) weights. A mixture of
    experts routes every token to all its experts here: where two experts' router scores nearly tie, the int8
    activations' ~1% error upstream of the (float32) router flips the top-k choice, as in llama.cpp, which
    changes that token's logits wholesale (measured: 8 of 154 top-1 choices, at top-2 of 4) and would measure
    the routing's ties, not the blocks; top-k routing itself is checked exactly by the F32 test."""
    model = models["qwen3moe-all" if kind == "qwen3moe" else kind]
    qtype, types = (Q.Q8_0, None) if mix == "Q8_0" else (Q.Q4_K, Q4_K_M)
    encoded = write_gguf(tmp_path / "q.gguf", model, kind, qtype=qtype, types=types)
    runner = serve(tmp_path, "q.gguf", kind, "gguf_native")
    layers = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    experts = [m for m in runner.model.modules() if isinstance(m, GGUFExperts)]
    n = model.config.num_hidden_layers
    per_layer = 2 if kind == "qwen3moe" else 4
    assert len(layers) == per_layer * n + 1  # every projection and the head: the blocks
    assert len(experts) == (n if kind == "qwen3moe" else 0)  # a layer's experts: the stacked blocks
    if mix == "Q4_K_M":
        assert {"Q4_K", "Q6_K"} <= {k for m in layers + experts for k in m.kind.split("+")}
    ours, ref = served_logits(runner, PROMPTS), hf_logits(with_weights(model, encoded), PROMPTS)
    agree = agreement(ours, ref)
    assert agree >= MIN_AGREEMENT, f"top-1 agreement {agree:.3f}"
    for got, want in zip(ours, ref, strict=True):
        assert (got - want).norm() / want.norm() < 0.05


def test_each_expert_reads_its_own_rows(tmp_path: Path, models: dict[str, Any]) -> None:
    """Expert e's gate|up and down (`GGUFExperts.expert_calls`: the bytes the fused op reads for it)
    compute with expert e's slice of the stacked tensors (int8 activations apart), not a neighbour's; the
    stacked float weights are gone."""
    model = models["qwen3moe"]
    encoded = write_gguf(tmp_path / "e.gguf", model, "qwen3moe", qtype=Q.Q8_0)
    runner = serve(tmp_path, "e.gguf", "qwen3moe", "gguf_native")
    block = runner.model.layers[1].mlp
    assert not hasattr(block, "w13") and block.fused.num_experts == model.config.num_experts
    gate_up, down = (
        encoded["model.layers.1.mlp.experts.gate_up_proj"],
        encoded["model.layers.1.mlp.experts.down_proj"],
    )
    x = torch.randn(5, model.config.hidden_size)
    h = torch.randn(5, model.config.moe_intermediate_size)
    for e, (gu, d) in enumerate(block.fused.expert_calls()):
        for layer, inp, stacked in ((gu, x, gate_up), (d, h, down)):
            got = layer(inp)
            errors = [((got - inp @ stacked[j].T).norm() / got.norm()).item() for j in range(len(stacked))]
            assert errors[e] < 0.05 and min(errors[:e] + errors[e + 1 :]) > 0.5, (e, errors)


def test_gemma3_config_follows_llama_cpp(tmp_path: Path, models: dict[str, Any]) -> None:
    write_gguf(tmp_path / "g.gguf", models["gemma3"], "gemma3")
    folder = ml.resolve_model_path(str(tmp_path / "g.gguf"), str(tmp_path / "cache"))
    cfg = ml.load_hf_config(folder)
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and cfg.sliding_window == 8
    assert cfg.query_pre_attn_scalar == 64 and cfg.final_logit_softcapping == 30.0 and cfg.tie_word_embeddings
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg.rope_parameters["full_attention"]["factor"] == 2.0


def test_gemma2_config_follows_llama_cpp(tmp_path: Path, models: dict[str, Any]) -> None:
    """The file's keys as llama.cpp reads them; without them, llama.cpp's defaults (window 4096, caps 50 and
    30); the 46-layer 27B's queries scaled by hidden / heads."""
    from runtime.models.gguf_arch import arch_config

    write_gguf(tmp_path / "g.gguf", models["gemma2"], "gemma2")
    folder = ml.resolve_model_path(str(tmp_path / "g.gguf"), str(tmp_path / "cache"))
    cfg = ml.load_hf_config(folder)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2 and cfg.sliding_window == 8
    assert cfg.attn_logit_softcapping == 1.0 and cfg.final_logit_softcapping == 30.0
    assert cfg.query_pre_attn_scalar == 64 and cfg.tie_word_embeddings
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    base = {"num_hidden_layers": 46, "hidden_size": 4608, "num_attention_heads": 32, "head_dim": 128,
            "rope_theta": 10000.0, "rope_scaling": None}  # fmt: skip
    big = arch_config("gemma2", {}, {}, base)
    assert big["query_pre_attn_scalar"] == 144 and big["sliding_window"] == 4096
    assert big["attn_logit_softcapping"] == 50.0 and big["final_logit_softcapping"] == 30.0
    assert big["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]


def test_mistral3_context_stops_where_the_attention_temperature_starts(
    tmp_path: Path, models: dict[str, Any]
) -> None:
    write_gguf(tmp_path / "m.gguf", models["mistral3"], "mistral3")
    folder = ml.resolve_model_path(str(tmp_path / "m.gguf"), str(tmp_path / "cache"))
    assert ml.load_hf_config(folder).max_position_embeddings == MISTRAL3_ORIGINAL
    write_gguf(tmp_path / "n.gguf", models["mistral3"], "mistral3", meta={"attention.temperature_scale": 0.0})
    folder = ml.resolve_model_path(str(tmp_path / "n.gguf"), str(tmp_path / "cache"))
    assert ml.load_hf_config(folder).max_position_embeddings == 512


@pytest.mark.parametrize(
    ("kind", "drop", "reshape", "match"),
    [
        ("gemma3", ("blk.2.post_ffw_norm.weight",), None, r"lacks.*layers\.2\.post_feedforward_layernorm"),
        ("phi3", (), {"blk.1.attn_qkv.weight": (384, 256)}, r"blk\.1\.attn_qkv\.weight has shape \[384,"),
        ("phi3", ("rope_factors_short.weight",), None, "rope_factors_long / rope_factors_short"),
        ("qwen3moe", ("blk.0.ffn_gate_inp.weight",), None, r"lacks tensors.*layers\.0\.mlp\.gate\.weight"),
        ("qwen3moe", (), {"blk.1.ffn_up_exps.weight": (3, 256, 256)},
         r"blk\.1\.ffn_up_exps\.weight has shape \[3, 256, 256\].*\[4, 256, 256\]"),
    ],
)  # fmt: skip
def test_bad_files_are_refused_naming_the_tensor(
    tmp_path: Path, models: dict[str, Any], kind: str, drop: tuple, reshape: dict | None, match: str
) -> None:
    write_gguf(tmp_path / "bad.gguf", models[kind], kind, drop=drop, reshape=reshape)
    assert_refused(tmp_path, "bad.gguf", match)


def test_gemma1_is_refused_saying_why(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma")
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_refused(tmp_path, "g.gguf", r"'gemma'.*Gemma 1 is not among")
