"""GGUFs of every supported architecture and tensor type, served through radixlm's loader (issue 49).

Each test builds a tiny seeded transformers model (Qwen2 / Qwen3 / Mistral; Llama itself is
tests/unit/test_model_loader.py's), writes it as a GGUF with gguf-py's writer following llama.cpp's
convert_hf_to_gguf.py rules (Mistral as arch "llama" with Q/K rows permuted; Qwen2 with q/k/v biases and
Qwen3 with q/k norms, rows as HF has them; tied embeddings by leaving output.weight out), loads it through
`resolve_model_path` + `ModelRunner` and compares logits with transformers in float32: against the model
itself for F32 files, against the model holding gguf-py's own dequantization of the file's blocks for
quantized ones (plus top-1 agreement with the unquantized model). Bad files must be start-up ValueErrors
naming the file and the problem.
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
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

from runtime.model_executor.model_runner import ModelRunner
from runtime.models import model_loader as ml
from tests.unit.test_model_loader import _TEMPLATE, _TOKENS, llamacpp_permute
from tests.unit.test_model_parity import Harness

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = len(_TOKENS)
COMMON = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=50000.0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
CONFIGS = {
    "qwen2": lambda **kw: Qwen2Config(**(COMMON | kw), tie_word_embeddings=True),
    "qwen3": lambda **kw: Qwen3Config(**(COMMON | kw), head_dim=32, tie_word_embeddings=False),  # != 256 / 4
    "mistral": lambda **kw: MistralConfig(**(COMMON | kw), sliding_window=None, tie_word_embeddings=False),
}
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}  # llama.cpp writes Mistral as llama
PERMUTED = {"qwen2": False, "qwen3": False, "mistral": True}

_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

# Byte offsets of the fp16 scale fields in one block of each type (ggml's block structs): the rest of a
# block is quant bits, so random bytes with small finite scales there make a valid block.
_FP16_AT = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}  # fmt: skip
# fp16 scale so weights come out ~0.05 at most: 1 / (largest 6-bit sub-scale x largest quant value)
_SCALE = {Q.Q2_K: 1 / (15 * 3), Q.Q3_K: 1 / (31 * 4), Q.Q4_K: 1 / (63 * 15), Q.Q5_K: 1 / (63 * 31),
          Q.Q6_K: 1 / (127 * 32), Q.IQ4_NL: 1 / 127, Q.IQ4_XS: 1 / (32 * 127)}  # fmt: skip
# dmin / d making a block's mean weight ~0 (the mean quant value): without it every row shares one large
# positive mean, q and k rows look alike, and attention would not notice rows in the wrong order
_MIN_RATIO = {Q.Q2_K: 1.5, Q.Q4_K: 7.5, Q.Q5_K: 15.5}
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)  # gguf-py's quantize() implements these
PROMPTS = [[1, 40, 90, 7, 200, 3], list(range(5, 40, 3)), [9, 120, 121, 122, 30, 31, 250, 4, 4, 4]]


# ------------------------------------------------------------------------------------------------ writing
def tiny_model(kind: str, seed: int = 0, **config: Any) -> Any:
    """A seeded random transformers model; biases and norms perturbed so their code paths matter."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](**config), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 2:
                p.normal_(0, 0.05)  # greedy choices far from ties
    return model


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator, gain: float = 1.0) -> np.ndarray:
    """Random bytes of `rows` x `cols` elements of `qtype` with small positive fp16 scales: a valid block
    of any type."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = 0.05 * gain * _SCALE.get(qtype, 1 / 16)
    for at, ratio in zip(_FP16_AT[qtype], (1.0, _MIN_RATIO.get(qtype, 1.0))):
        d = (rng.uniform(0.5, 1.5, size=raw.shape[:2]) * scale * ratio).astype(np.float16)
        raw[..., at : at + 2] = d[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def encode(a: np.ndarray, qtype: Q, rng: np.random.Generator, gain: float = 1.0) -> np.ndarray:
    """`a` ([rows, cols] float32) stored as `qtype`: quantized where gguf-py can, else random blocks
    (`gain` scales them)."""
    if qtype in (Q.F32, Q.F16, Q.BF16) or qtype in QUANTIZABLE:
        return quantize(a, qtype)
    return random_blocks(qtype, *a.shape, rng, gain)


def write_metadata(w: Any, arch: str, keys: dict[str, Any], pre: str) -> None:
    """`arch`'s metadata `keys` (strings, float32s, else uint32s) and the test tokenizer (pre-tokenizer `pre`)
    and chat template, as a converted file holds them."""
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", int(value))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(_TOKENS)
    w.add_token_merges(["h e", "he l"])
    w.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(_TEMPLATE)


def write_gguf(
    path: Path,
    model: Any,
    kind: str,
    *,
    qtype: Q = Q.F32,
    drop: tuple[str, ...] = (),
    keep_f32: tuple[str, ...] = (),
    types: dict[str, Q] | None = None,
    meta: dict[str, Any] | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp's converter would for `kind`, matrices stored as `qtype` (norms, biases
    F32; a matrix whose rows are not whole blocks of `qtype` falls back to Q8_0, as llama-quantize does).
    `types` maps a tensor name's ending to its type where it differs from `qtype` (a Q4_K_M-like mix).
    Returns the HF state dict the file encodes: gguf-py's dequantization of what was written, un-permuted.
    """
    cfg = model.config
    arch = GGUF_ARCH[kind]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("Mistral-Tiny" if kind == "mistral" else f"{kind}-tiny")
    keys = {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": heads, "attention.head_count_kv": kv_heads,
        "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
    }  # fmt: skip
    if kind == "qwen3":  # written when the HF config has head_dim
        keys |= {"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim}
    if arch == "llama":  # LlamaModel.set_gguf_parameters adds these two
        keys |= {"vocab_size": cfg.vocab_size, "rope.dimension_count": cfg.hidden_size // heads}
    write_metadata(w, arch, keys | (meta or {}), "qwen2" if kind.startswith("qwen") else "default")
    rng = np.random.default_rng(1)
    encoded: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output.weight
        a = t.numpy().astype(np.float32)
        stem, suffix = name.rsplit(".", 1)
        if stem in _GLOBAL:
            gname = f"{_GLOBAL[stem]}.{suffix}"
        else:
            layer, module = stem.split(".", 3)[2:]
            gname = f"blk.{layer}.{_BLOCK[module]}.{suffix}"
            n = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads}.get(module)
            if PERMUTED[kind] and n is not None:
                a = llamacpp_permute(a, n)
        if gname in drop:
            continue
        t_type = Q.F32
        if a.ndim == 2 and qtype != Q.F32 and gname not in keep_f32:
            want = next((t for end, t in (types or {}).items() if gname.endswith(end)), qtype)
            t_type = want if a.shape[1] % gguf.GGML_QUANT_SIZES[want][0] == 0 else Q.Q8_0
        gain = 6.0 if gname.endswith(("attn_q.weight", "attn_k.weight")) else 1.0  # sharp attention: a wrong
        # q/k row order must change the logits
        data = np.ascontiguousarray(encode(a, t_type, rng, gain) if t_type != Q.F32 else a)
        w.add_tensor(gname, data, raw_dtype=None if data.dtype in (np.float32, np.float16) else t_type)
        back = np.asarray(dequantize(data, t_type), dtype=np.float32).reshape(a.shape)
        if PERMUTED[kind] and gname.endswith(
            ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")
        ):
            n = heads if ".attn_q." in gname else kv_heads
            back = (
                back.reshape(n, back.shape[0] // n // 2, 2, *back.shape[1:]).swapaxes(1, 2).reshape(a.shape)
            )
        encoded[name] = torch.from_numpy(back.copy())
    for gname, a in (extra or {}).items():
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return encoded


# ------------------------------------------------------------------------------------------------ serving
def runner_for(folder: str, **kwargs: Any) -> ModelRunner:
    return ModelRunner(
        folder, dtype="float32", device="cpu", max_total_tokens=512, max_running_requests=4,
        attention_backend="torch_native", **kwargs,
    )  # fmt: skip


def served_logits(runner: ModelRunner, prompts: list[list[int]] = PROMPTS) -> list[torch.Tensor]:
    """radixlm's logits [len, vocab] of every position of each prompt (one extend batch)."""
    logits = Harness(runner).extend(dict(enumerate(prompts)), all_logits=True)
    return list(torch.split(logits, [len(p) for p in prompts]))


def hf_logits(model: Any, prompts: list[list[int]] = PROMPTS) -> list[torch.Tensor]:
    """transformers' logits [len, vocab] of every position of each prompt."""
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float() for p in prompts]


def with_weights(model: Any, state: dict[str, torch.Tensor]) -> Any:
    ref = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    ref.load_state_dict(state, strict=False)  # tied lm_head follows embed_tokens
    return ref


def serve_gguf(tmp_path: Path, name: str) -> tuple[str, ModelRunner]:
    folder = ml.resolve_model_path(str(tmp_path / name), str(tmp_path / "cache"))
    return folder, runner_for(folder)


@pytest.mark.slow  # builds and compares whole models: the full suite, not test-fast
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_f32_gguf_serves_like_transformers(tmp_path: Path, kind: str) -> None:
    model = tiny_model(kind)
    write_gguf(tmp_path / "m.gguf", model, kind)
    folder, runner = serve_gguf(tmp_path, "m.gguf")
    cfg = ml.load_hf_config(folder)
    hf_class = {"mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    assert cfg.architectures == [hf_class[kind]]
    assert cfg.tie_word_embeddings == model.config.tie_word_embeddings and cfg.head_dim == (
        getattr(model.config, "head_dim", None) or 64
    )
    ours, ref = served_logits(runner), hf_logits(model)
    for got, want in zip(ours, ref, strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))  # greedy next tokens at every position
    tok = ml.load_tokenizer(folder)
    assert tok.chat_template == _TEMPLATE and tok.decode(tok("hello").input_ids) == "hello"
    # transformers' own GGUF loader reads the same file the same way: the writer follows llama.cpp's rules
    # (not for Qwen3 here: transformers ignores qwen3.attention.key_length, so head_dim 32 defeats it)
    if kind == "qwen3":
        return
    oracle = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    for got, want in zip(ours, hf_logits(oracle.eval()), strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.slow  # builds and compares whole models: the full suite, not test-fast
def test_yarn_rope_scaling_is_carried_over(tmp_path: Path) -> None:
    """Long-context Qwen files carry YaRN as rope.scaling.{type,factor,original_context_length}."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    model = tiny_model("qwen3", rope_theta=None, rope_parameters=rope)
    yarn = {
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 128,
    }
    write_gguf(tmp_path / "y.gguf", model, "qwen3", meta=yarn)
    folder, runner = serve_gguf(tmp_path, "y.gguf")
    assert ml.load_hf_config(folder).rope_parameters["rope_type"] == "yarn"
    for got, want in zip(served_logits(runner), hf_logits(model), strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    write_gguf(tmp_path / "y2.gguf", model, "qwen3", meta=yarn | {"rope.scaling.yarn_log_multiplier": 0.1})
    assert_refused(tmp_path, "y2.gguf", "yarn_log_multiplier is not supported")


TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16,
         Q.IQ4_NL, Q.IQ4_XS]  # fmt: skip


@pytest.mark.slow  # builds and compares whole models: the full suite, not test-fast
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_loads_as_ggufpy_dequantizes_it(tmp_path: Path, qtype: Q) -> None:
    """Architectures rotate over the types, so each sees block types with and without Q/K permutation."""
    kind = sorted(CONFIGS)[TYPES.index(qtype) % len(CONFIGS)]
    model = tiny_model(kind)
    encoded = write_gguf(tmp_path / "q.gguf", model, kind, qtype=qtype)
    _, runner = serve_gguf(tmp_path, "q.gguf")
    for got, want in zip(served_logits(runner), hf_logits(with_weights(model, encoded)), strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.slow  # builds and compares whole models: the full suite, not test-fast
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_q8_0_gguf_agrees_with_float_model(tmp_path: Path, kind: str) -> None:
    model = tiny_model(kind)
    write_gguf(tmp_path / "q8.gguf", model, kind, qtype=Q.Q8_0)
    _, runner = serve_gguf(tmp_path, "q8.gguf")
    ours, ref = torch.cat(served_logits(runner)), torch.cat(hf_logits(model))
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"top-1 agreement {agree:.3f} of Q8_0 with float32"


@pytest.mark.slow  # builds and compares whole models: the full suite, not test-fast
def test_qwen2_q4_1_blocks_served_in_place_without_unpermuting(tmp_path: Path) -> None:
    """--quantization gguf reuses the file's Q4_1 blocks: for Qwen2 (rows never permuted) they must be used
    as stored, giving the same logits as the dequantized float32 model (the tied head too: its 261 rows, not a
    multiple of the int4 kernel's 16, are padded)."""
    model = tiny_model("qwen2")
    encoded = write_gguf(tmp_path / "q41.gguf", model, "qwen2", qtype=Q.Q4_1)
    folder = ml.resolve_model_path(str(tmp_path / "q41.gguf"), str(tmp_path / "cache"))
    runner = runner_for(folder, quantization="gguf")
    for got, want in zip(served_logits(runner), hf_logits(with_weights(model, encoded)), strict=True):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)


@pytest.mark.slow  # builds and compares whole models: the full suite, not test-fast
def test_qwen2_q4_k_file_starts_and_decodes_greedy_through_the_scheduler(tmp_path: Path) -> None:
    """What `radixlm serve --model qwen2.5-...-q4_k_m.gguf` does, with this test's qwen2 file standing in:
    resolve the arguments as the CLI does, convert, and decode greedily through the real scheduler
    (speculative decoding on, as by default) exactly as transformers' greedy generate on the same weights."""
    from runtime.managers.scheduler.scheduler import Scheduler
    from runtime.messages import GenerateReq
    from runtime.sampling_params import SamplingParams
    from runtime.server_args import ServerArgs

    model = tiny_model("qwen2")
    encoded = write_gguf(tmp_path / "qwen2-q4_k_m.gguf", model, "qwen2", qtype=Q.Q4_K)
    # a GGUF file is served from its blocks by default (tests/unit/test_gguf_native.py); here as float32
    assert ServerArgs(model=str(tmp_path / "qwen2-q4_k_m.gguf")).resolve().quantization in (
        "gguf_native",
        "none",
    )
    folder = ml.resolve_model_path(str(tmp_path / "qwen2-q4_k_m.gguf"), str(tmp_path / "cache"))
    args = ServerArgs(
        model=folder, dtype="float32", quantization="none", kv_cache_dtype="float32", max_total_tokens=1024,
        log_interval=0, attention_backend="torch_native",
    )  # fmt: skip
    tokenizer = ml.load_tokenizer(folder)
    sched = Scheduler(args, folder, tokenizer=tokenizer)
    params = SamplingParams(max_new_tokens=12, min_new_tokens=12, temperature=0.0)
    for i, ids in enumerate(PROMPTS):
        sched.handle(GenerateReq(rid=str(i), input_ids=ids, params=params))
    outs: dict[str, list[int]] = {}
    while sched.has_work():
        for o in sched.step():
            outs.setdefault(o.rid, []).extend(o.new_token_ids)
    sched.check_accounting()
    ref = with_weights(model, encoded)
    for i, ids in enumerate(PROMPTS):
        tokens = list(ids)
        with torch.no_grad():
            for _ in range(12):  # greedy by hand: generate() would stop at EOS, the scheduler does not
                logits = ref(torch.tensor([tokens])).logits[0, -1]
                logits[2] = -float("inf")  # min_new_tokens bans EOS
                tokens.append(int(logits.argmax()))
        assert outs[str(i)] == tokens[len(ids) :], f"prompt {i}"


# ------------------------------------------------------------------------------------------------ refusals
def assert_refused(tmp_path: Path, name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        ml.resolve_model_path(str(tmp_path / name), str(tmp_path / "refused"))
    assert str(tmp_path / name) in str(info.value)  # the message names the file
    assert [p.name for p in (tmp_path / "refused").iterdir() if not p.name.endswith(".lock")] == []


def test_unreadable_type_is_refused_naming_tensor_and_type(tmp_path: Path) -> None:
    model = tiny_model("qwen2")
    write_gguf(tmp_path / "i8.gguf", model, "qwen2", drop=("blk.1.ffn_down.weight",),
               extra={"blk.1.ffn_down.weight": np.zeros((256, 512), np.int8)})  # fmt: skip
    assert_refused(tmp_path, "i8.gguf", r"tensor blk\.1\.ffn_down\.weight is stored as I8")


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    write_gguf(tmp_path / "t.gguf", tiny_model("qwen3"), "qwen3")
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[: len(data) - 4096])
    assert_refused(tmp_path, "t.gguf", "truncated")
    (tmp_path / "t.gguf").write_bytes(data[:200])  # inside the metadata
    assert_refused(tmp_path, "t.gguf", "truncated or corrupt")


@pytest.mark.parametrize(
    ("kind", "drop", "meta", "match"),
    [
        ("qwen2", (), {"feed_forward_length": 384}, r"ffn_gate\.weight has shape \[512, 256\].*\[384, 256\]"),
        ("qwen2", (), {"attention.head_count_kv": 4}, r"attn_k\.weight has shape \[128, 256\].*\[256, 256\]"),
        ("qwen2", ("blk.1.attn_k.bias",), {}, r"lacks tensors.*model\.layers\.1\.self_attn\.k_proj\.bias"),
        ("qwen3", ("blk.0.attn_q_norm.weight",), {}, r"lacks tensors.*q_norm"),
        ("qwen3", (), {"attention.value_length": 64}, "value head dim 64"),
        ("mistral", ("output_norm.weight",), {}, r"lacks tensors.*model\.norm\.weight"),
        ("mistral", (), {"block_count": 1}, r"blk\.1\..* does not belong"),
    ],
)  # fmt: skip
def test_tensors_not_matching_the_config_are_refused(
    tmp_path: Path, kind: str, drop: tuple[str, ...], meta: dict[str, Any], match: str
) -> None:
    write_gguf(tmp_path / "bad.gguf", tiny_model(kind), kind, drop=drop, meta=meta)
    assert_refused(tmp_path, "bad.gguf", match)


def test_other_architectures_are_refused_listing_the_supported(tmp_path: Path) -> None:
    model = tiny_model("qwen2")
    write_gguf(tmp_path / "g.gguf", model, "qwen2")
    data = (tmp_path / "g.gguf").read_bytes().replace(b"qwen2", b"gemm2")  # arch name and its keys
    (tmp_path / "g.gguf").write_bytes(data)
    assert_refused(
        tmp_path,
        "g.gguf",
        r"unsupported GGUF architecture 'gemm2'.*'gemma3', 'gpt-oss', 'llama', .*'qwen2', 'qwen3'",
    )


def test_the_reader_gives_ggufpy_fields_and_tensors(tmp_path: Path) -> None:
    """open_reader's reader (array values cut on first use, see gguf_arch._reader_class) gives gguf-py's own
    fields (offsets, parts, data indices, types, contents) and tensors for every kind of value."""
    from runtime.models.gguf_arch import open_reader

    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "qwen2")
    w.add_string("test.string", "héllo")
    w.add_uint32("test.u32", 7)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.bool", True)
    w.add_array("test.strings", ["a", "", "ünï", "x" * 300])
    w.add_array("test.ints", [3, -1, 2])
    w.add_array("test.floats", [0.5, -2.0])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("t.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = open_reader(str(tmp_path / "v.gguf")), gguf.GGUFReader(str(tmp_path / "v.gguf"))
    assert list(ours.fields) == list(ref.fields)
    for name, want in ref.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.name, got.data, got.types) == (want.offset, want.name, want.data, want.types)
        assert [(p.dtype, p.tolist()) for p in got.parts] == [(p.dtype, p.tolist()) for p in want.parts]
        assert got.contents() == want.contents(), name
    assert ours.fields["test.strings"].contents() == ["a", "", "ünï", "x" * 300]
    assert [(t.name, t.data_offset, t.data.tolist()) for t in ours.tensors] == [
        (t.name, t.data_offset, t.data.tolist()) for t in ref.tensors
    ]
