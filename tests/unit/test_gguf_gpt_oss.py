"""gpt-oss GGUF files (`general.architecture = gpt-oss`) served through radixlm's model runner.

The tiny random gpt-oss of tests/random_gpt_oss.py (sliding and full layers, sinks, 6 experts top-2, yarn) is
written as llama.cpp's converter writes gpt-oss (conversion/gpt_oss.py): gate_up_proj split into
ffn_gate_exps / ffn_up_exps ([E, I, H], gate from the even outputs) with their biases, down_proj transposed to
ffn_down_exps [E, H, I], the router as ffn_gate_inp with its bias, sinks as attn_sinks.weight,
post_attention_norm as the pre-MLP norm, rows in HF order, YaRN in the rope.scaling keys (no `truncate`: a
file's YaRN rounds its correction range as llama.cpp does, so the reference config rounds too).
An F32 file gives transformers' float32 logits on both paths (the float one, `--quantization none`, and the
blocks in place, `gguf_native`); a file with MXFP4 experts and Q8_0 projections (llama.cpp's MXFP4_MOE mix)
served in place agrees with float32 on its own dequantized weights; through the scheduler (radix cache,
chunked prefill, speculation on) the F32 file decodes transformers' greedy tokens; bad files are refused
naming the tensor.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from runtime.models import model_loader as ml
from runtime.models.gguf_linear import INTERLEAVED, GGUFLinear
from runtime.models.moe_fused import GGUFExperts
from tests.random_gpt_oss import EXPERTS, WINDOW, gpt_oss_config, random_gpt_oss
from tests.unit.test_gguf_architectures import VOCAB, runner_for, served_logits, write_metadata
from tests.unit.test_gguf_native import MIN_AGREEMENT, agreement

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [np.random.default_rng(i).integers(3, VOCAB, n).tolist() for i, n in enumerate((30, 9, 21))]
_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip


def tiny_gpt_oss(**overrides: Any) -> Any:
    """tests/random_gpt_oss's model on this file's vocabulary, its YaRN without `truncate` (see the
    module); `std` and config attributes overridden."""
    config = gpt_oss_config(vocab_size=VOCAB)
    config.rope_parameters = {k: v for k, v in config.rope_parameters.items() if k != "truncate"}
    std = overrides.pop("std", 0.3)
    for key, value in overrides.items():
        setattr(config, key, value)
    return random_gpt_oss(config, std=std)


def to_gguf(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The HF state dict as llama.cpp's converter writes gpt-oss (float32, before quantization)."""
    out: dict[str, np.ndarray] = {}
    for name, t in state.items():
        a = t.numpy().astype(np.float32)
        if name in _GLOBAL:
            out[_GLOBAL[name]] = a
            continue
        _, _, layer, block, rest = name.split(".", 4)
        b = f"blk.{layer}."
        if block == "self_attn" and rest == "sinks":
            out[b + "attn_sinks.weight"] = a
        elif block == "self_attn":
            proj, kind = rest.split(".")
            out[f"{b}{_ATTN[proj]}.{kind}"] = a
        elif block in _NORMS:
            out[f"{b}{_NORMS[block]}.weight"] = a
        elif rest.startswith("router."):
            out[f"{b}ffn_gate_inp.{rest.split('.')[1]}"] = a
        elif rest == "experts.gate_up_proj":  # [E, H, 2I] -> [E, 2I, H]; even outputs gate, odd up
            rows = a.transpose(0, 2, 1)
            out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = rows[:, 0::2], rows[:, 1::2]
        elif rest == "experts.gate_up_proj_bias":
            out[b + "ffn_gate_exps.bias"], out[b + "ffn_up_exps.bias"] = a[:, 0::2], a[:, 1::2]
        elif rest == "experts.down_proj":  # [E, I, H] -> [E, H, I]
            out[b + "ffn_down_exps.weight"] = a.transpose(0, 2, 1)
        elif rest == "experts.down_proj_bias":
            out[b + "ffn_down_exps.bias"] = a
        else:
            raise AssertionError(f"unmapped {name}")
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_gguf(arrays: dict[str, np.ndarray], layers: int) -> dict[str, torch.Tensor]:
    """`to_gguf`'s inverse: the HF state dict a file's (dequantized) tensors encode."""
    state = {hf: torch.from_numpy(arrays[g]) for hf, g in _GLOBAL.items()}
    for i in range(layers):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        for hf, g in _NORMS.items():
            state[f"{p}{hf}.weight"] = torch.from_numpy(arrays[f"{b}{g}.weight"])
        for hf, g in _ATTN.items():
            for kind in ("weight", "bias"):
                state[f"{p}self_attn.{hf}.{kind}"] = torch.from_numpy(arrays[f"{b}{g}.{kind}"])
        state[p + "self_attn.sinks"] = torch.from_numpy(arrays[b + "attn_sinks.weight"])
        for kind in ("weight", "bias"):
            state[f"{p}mlp.router.{kind}"] = torch.from_numpy(arrays[f"{b}ffn_gate_inp.{kind}"])
        gate, up = arrays[b + "ffn_gate_exps.weight"], arrays[b + "ffn_up_exps.weight"]
        both = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2])  # [E, 2I, H]
        state[p + "mlp.experts.gate_up_proj"] = torch.from_numpy(both.transpose(0, 2, 1).copy())
        gb, ub = arrays[b + "ffn_gate_exps.bias"], arrays[b + "ffn_up_exps.bias"]
        state[p + "mlp.experts.gate_up_proj_bias"] = torch.from_numpy(
            np.stack([gb, ub], 2).reshape(len(gb), -1)
        )
        state[p + "mlp.experts.down_proj"] = torch.from_numpy(
            arrays[b + "ffn_down_exps.weight"].transpose(0, 2, 1).copy()
        )
        state[p + "mlp.experts.down_proj_bias"] = torch.from_numpy(arrays[b + "ffn_down_exps.bias"])
    return state


def metadata(cfg: Any) -> dict[str, Any]:
    rope = cfg.rope_parameters
    return {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), "rope.freq_base": rope["rope_theta"],
        "attention.sliding_window": cfg.sliding_window, "expert_count": cfg.num_local_experts,
        "expert_used_count": cfg.num_experts_per_tok, "expert_feed_forward_length": cfg.intermediate_size,
        "rope.scaling.type": "yarn", "rope.scaling.factor": rope["factor"],
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        "rope.scaling.yarn_beta_fast": rope["beta_fast"], "rope.scaling.yarn_beta_slow": rope["beta_slow"],
    }  # fmt: skip


def write_gguf(path: Path, model: Any, *, mix: bool = False, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """`model` as a gpt-oss file: every tensor F32, or (`mix`) llama.cpp's MXFP4_MOE mix (experts MXFP4,
    the other matrices Q8_0; norms, biases, sinks and the router F32); returns the HF state dict the file
    encodes (gguf-py's dequantization of what was written)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_name("gpt-oss-tiny")
    write_metadata(w, "gpt-oss", metadata(cfg), "default")
    back: dict[str, np.ndarray] = {}
    for name, a in to_gguf(model.state_dict()).items():
        if name in drop:
            continue
        qtype = Q.F32
        if mix and name.endswith("_exps.weight"):
            qtype = Q.MXFP4
        elif mix and name.endswith(".weight") and a.ndim == 2 and "ffn_gate_inp" not in name:
            qtype = Q.Q8_0
        data = a if qtype == Q.F32 else quantize(a, qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
        back[name] = np.asarray(dequantize(data, qtype), np.float32).reshape(a.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return from_gguf(back, cfg.num_hidden_layers) if not drop else {}


def folder_of(tmp_path: Path, name: str) -> str:
    return ml.resolve_model_path(str(tmp_path / name), str(tmp_path / "cache"))


def reference(model: Any, state: dict[str, torch.Tensor]) -> Any:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    missing, unexpected = ref.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    return ref


def hf_logits(model: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float() for p in prompts]


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_gpt_oss()


def test_config_follows_llama_cpp(tmp_path: Path, model: Any) -> None:
    """Layers sliding first then alternating (llama.cpp's default pattern of 2), the window, the experts,
    YaRN's keys, the clamped SwiGLU's limit; the architecture is GptOssForCausalLM."""
    write_gguf(tmp_path / "c.gguf", model)
    cfg = ml.load_hf_config(folder_of(tmp_path, "c.gguf"))
    assert cfg.architectures == ["GptOssForCausalLM"] and cfg.model_type == "gpt_oss"
    assert (
        cfg.layer_types
        == model.config.layer_types
        == ["sliding_attention", "full_attention"] * 1 + ["sliding_attention"]
    )
    assert cfg.sliding_window == WINDOW and cfg.swiglu_limit == 7.0
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (EXPERTS, 2, 32)
    rope = cfg.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 256)


def test_f32_file_serves_like_transformers(tmp_path: Path, model: Any) -> None:
    """Both paths give transformers' float32 logits at every position: the float one reassembles the
    checkpoint's interleaved gate_up_proj; gguf_native fills the per-expert loop's float experts."""
    encoded = write_gguf(tmp_path / "f.gguf", model)
    for name, t in model.state_dict().items():  # the writer's inverse: the file holds the model
        torch.testing.assert_close(encoded[name], t, atol=0, rtol=0)
    want = hf_logits(model, PROMPTS)
    for quantization in ("none", "gguf_native"):
        runner = runner_for(folder_of(tmp_path, "f.gguf"), quantization=quantization)
        assert type(runner.model).__name__ == "GptOssForCausalLM"
        for got, ref in zip(served_logits(runner, PROMPTS), want, strict=True):
            torch.testing.assert_close(got, ref, atol=3e-4, rtol=1e-4)
            assert torch.equal(got.argmax(-1), ref.argmax(-1)), quantization


def test_weights_read_in_place_are_mapped_at_load(tmp_path: Path, monkeypatch) -> None:
    """Start-up faults in every page the projections and experts read from the file in place (Q8_0 here;
    MXFP4 is copied into the interleaved layout on AVX512-VNNI), so the first requests do not."""
    from runtime.models import gguf_model

    seen: list[int] = []
    real = gguf_model.map_in_place_weights
    monkeypatch.setattr(gguf_model, "map_in_place_weights", lambda m, r: seen.append(real(m, r)) or seen[-1])
    write_gguf(tmp_path / "m.gguf", tiny_gpt_oss(), mix=True)
    runner = runner_for(folder_of(tmp_path, "m.gguf"), quantization="gguf_native")
    kept = [m for m in runner.model.modules() if isinstance(m, (GGUFLinear, GGUFExperts))]
    in_place = [(m, i) for m in kept for i, t in enumerate(m.types) if not t & INTERLEAVED]
    want = sum(getattr(m, f"w{i}").numel() for m, i in in_place)
    assert seen == [want] and want > 0


def test_mxfp4_file_served_in_place_agrees(tmp_path: Path) -> None:
    """MXFP4 experts and Q8_0 projections read in place (one GGUFExperts of MXFP4 blocks per layer, q|k|v
    and o as Q8_0 GGUFLinear, the head too) agree with float32 on the file's own dequantized weights. As in
    test_gguf_more_architectures, every token is routed to all the experts: at top-2 of 6 the int8
    activations' ~0.5% error per projection flips near-tied choices upstream of the router and changes
    those tokens' logits wholesale (measured: 13% of the logits' norm, 85% raw top-1), which would measure
    the routing's ties, not the blocks; top-k routing itself is checked exactly by the F32 tests. Weights of
    N(0, 0.05) measured 0.8% of the logits' norm and every top-1 alike."""
    model = tiny_gpt_oss(std=0.05, num_experts_per_tok=EXPERTS)
    encoded = write_gguf(tmp_path / "q.gguf", model, mix=True)
    runner = runner_for(folder_of(tmp_path, "q.gguf"), quantization="gguf_native")
    layers = runner.model.layers
    experts = [layer.mlp.experts for layer in layers]
    assert all(isinstance(e, GGUFExperts) for e in experts)
    assert all([t & ~INTERLEAVED for t in e.types] == [39] * 3 for e in experts)
    assert all(layer.mlp.w13 is None for layer in layers)
    linears = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 2 * len(layers) + 1 and {m.kind for m in linears} == {"Q8_0"}
    ours, ref = served_logits(runner, PROMPTS), hf_logits(reference(model, encoded), PROMPTS)
    agree = agreement(ours, ref)
    assert agree >= MIN_AGREEMENT, f"top-1 agreement {agree:.3f}"
    for got, want in zip(ours, ref, strict=True):
        assert (got - want).norm() / want.norm() < 0.03


def test_scheduler_decodes_transformers_greedy(tmp_path: Path, model: Any) -> None:
    """The F32 file through the real scheduler as `radixlm serve --model FILE` runs it (blocks in place,
    speculation on), prefill chunks of 16 across the window and two requests sharing a cached prefix: every
    output is transformers' greedy continuation, and every KV slot comes back."""
    from runtime.managers.scheduler.scheduler import Scheduler
    from runtime.messages import GenerateReq
    from runtime.sampling_params import SamplingParams
    from runtime.server_args import ServerArgs

    write_gguf(tmp_path / "s.gguf", model)
    folder = folder_of(tmp_path, "s.gguf")
    args = ServerArgs(
        model=folder, dtype="float32", quantization="gguf_native", max_total_tokens=1024, log_interval=0,
        attention_backend="torch_native", chunked_prefill_size=16,
    )  # fmt: skip
    sched = Scheduler(args, folder, tokenizer=ml.load_tokenizer(folder))
    # PROMPTS[2] is left out: its 5th greedy token is a near-tie (top-2 logits 0.003 apart) that float
    # round-off decides either way; over these, 8 tokens' top-2 gaps are >= 0.03
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][:20] + [5, 6, 7]]
    params = SamplingParams(max_new_tokens=8, min_new_tokens=8, temperature=0.0)
    outs: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        sched.handle(GenerateReq(rid=str(i), input_ids=ids, params=params))
        for o in sched.step():  # one arrival a step: the last finds the first's prefix cached
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
    while sched.has_work():
        for o in sched.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
    sched.check_accounting()
    for i, ids in enumerate(prompts):
        tokens = list(ids)
        with torch.no_grad():
            for _ in range(8):  # greedy by hand: min_new_tokens bans EOS (2)
                logits = model(torch.tensor([tokens])).logits[0, -1]
                logits[2] = -float("inf")
                tokens.append(int(logits.argmax()))
        assert outs[str(i)] == tokens[len(ids) :], f"prompt {i}"


@pytest.mark.parametrize(
    ("drop", "match"),
    [
        (("blk.1.attn_sinks.weight",), r"lacks tensors.*layers\.1\.self_attn\.sinks"),
        (("blk.0.ffn_up_exps.bias",), r"lacks tensors.*layers\.0\.mlp\.experts\.up_proj\.bias"),
    ],
)
def test_bad_files_are_refused_naming_the_tensor(tmp_path: Path, model: Any, drop: tuple, match: str) -> None:
    write_gguf(tmp_path / "bad.gguf", model, drop=drop)
    with pytest.raises(ValueError, match=match) as info:
        folder_of(tmp_path, "bad.gguf")
    assert str(tmp_path / "bad.gguf") in str(info.value)
