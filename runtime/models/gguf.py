"""GGUF files: the folder a file resolves to, its weights, and the raw block readers.

Everything downstream reads its config and tokenizer from a Hugging Face folder, so a GGUF file resolves once
to a small cached folder -- config.json from the file's metadata, the tokenizer and chat template from the
same file, and a marker naming the file -- that holds no weights: the weights stay in the GGUF. By default
(`--quantization gguf_native`) the model is built from the file's blocks in place
(`runtime.models.gguf_model`); the other modes read float32 tensors dequantized from the file at load
(`iter_gguf_weights`, Q/K rows restored to Hugging Face's RoPE layout where llama.cpp permuted them), and the
modes that reuse the file's own Q4_1 / Q8_0 blocks (`--quantization gguf`, `w4a8`) read them here.
Architectures and the checks every file passes first live in `runtime.models.gguf_arch`. Nothing is ever
downloaded: every transformers call here is local-only.

(The third-party `gguf` package is imported inside functions as `gguf`: absolute imports never mean this
module.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.cache_dir import CACHE_ENV, cache_root, private_dir
from runtime.models.gguf_arch import (
    ARCHS,
    REFUSED,
    STACKED_EXPERTS,
    arch_config,
    block_tensors,
    check_tensors,
    check_types,
    expected_shapes,
    open_reader,
)
from runtime.models.gguf_arch import f32 as _f32
from runtime.models.gguf_linear import dequantize_tensor

logger = logging.getLogger("radixlm.gguf")

# Part of the cache key: bump it whenever the converted folder's content changes, so stale caches are ignored.
CONVERTER_VERSION = 2  # 2: the folder holds no weights (they are read from the file)
# Written last into a converted folder; a folder without it is not a finished conversion.
SOURCE_MARKER = "radixlm_source.json"

GGUF_MAGIC = b"GGUF"  # a GGUF file's first four bytes

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")

# Known Llama 3.x RoPE scaling settings (factor, low_freq_factor, high_freq_factor, original context). GGUF
# stores only the resulting per-frequency divisors (tensor rope_freqs); we recover the parameters by matching.
_LLAMA3_ROPE_CANDIDATES = [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 1.0, 4.0, 8192)]

_Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles (low nibble: element j, high nibble: element j + 16)
_Q8_0_BYTES = 34  # fp16 d, 32 int8


# ----------------------------------------------------------------------------------------------- the cache
def cache_folder_for(gguf_path: str, cache_dir: str | None = None) -> Path:
    """Where the conversion of `gguf_path` is cached; a changed (path, size, mtime) gives a new folder."""
    root = model_cache_root(cache_dir)
    src = Path(gguf_path).resolve()
    st = src.stat()
    key = f"{src}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", src.name.removesuffix(".gguf"))
    return root / f"{name}-{digest}"


def model_cache_root(cache_dir: str | None = None) -> Path:
    """`cache_dir`, else $RADIXLM_CACHE_DIR itself (the layout conversions always had), else
    ~/.cache/radixlm/models."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return cache_root() if os.environ.get(CACHE_ENV) else cache_root() / "models"


def _is_finished(folder: Path) -> bool:
    return (folder / SOURCE_MARKER).is_file() and (folder / "config.json").is_file()


def resolve_gguf(gguf_path: str, cache_dir: str | None = None) -> str:
    """The cached conversion of `gguf_path` (a Hugging Face folder), converted under a file lock into a temp
    dir renamed into place, so that concurrent processes convert once and never see a half-written folder."""
    t0 = time.perf_counter()
    final = cache_folder_for(gguf_path, cache_dir)
    private_dir(final.parent)  # 0700, ours, not writable by others (UnsafeCacheDir otherwise)
    if _is_finished(final):
        logger.info("warm load: cached conversion %s found in %.3f s", final, time.perf_counter() - t0)
        return str(final)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if _is_finished(final):  # another process finished while we waited for the lock
            logger.info(
                "cached conversion %s appeared while waiting (%.1f s)", final, time.perf_counter() - t0
            )
            return str(final)
        if final.exists():
            logger.warning("removing unfinished conversion folder %s", final)
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            convert_gguf(gguf_path, str(tmp))
            _make_readable(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("cold conversion of %s into %s took %.1f s", gguf_path, final, time.perf_counter() - t0)
    return str(final)


def _make_readable(folder: Path) -> None:
    """mkdtemp creates 0700 folders; a finished cache entry is read-only data anyone may load."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock (flock: held per open file, so it also serializes threads of one process)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone still keeps readers safe
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------------------------- conversion
def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write the folder a GGUF of a supported architecture (`ARCHS`) resolves to into the existing empty
    folder `out_dir`: config.json, generation_config.json, tokenizer files (with chat template) and the marker
    naming the file; no weights (`iter_gguf_weights`, `runtime.models.gguf_model` read them from the file).
    Whatever makes the file unservable is a ValueError naming the file, raised before any write."""
    reader = open_reader(gguf_path)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch in REFUSED:
        raise ValueError(
            f"GGUF architecture {arch!r} of {gguf_path} is not supported: {REFUSED[arch]} (supported: "
            f"{sorted(ARCHS)})"
        )
    if arch not in ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {gguf_path} (supported: {sorted(ARCHS)}); "
            "convert the model to a Hugging Face folder and pass that instead"
        )
    tensors = {t.name: t for t in reader.tensors}
    try:
        check_types(tensors)
        config = gguf_config(meta, tensors)
        plan = [(name, hf) for name in tensors if (hf := hf_tensor_name(name, arch)) is not None]
        qkv_bias = ARCHS[arch].qkv_bias or "blk.0.attn_q.bias" in tensors
        check_tensors(plan, tensors, expected_shapes(config, ARCHS[arch], qkv_bias))
    except ValueError as e:
        raise ValueError(f"{gguf_path}: {e}") from None
    out = Path(out_dir)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _write_generation_config(config, out)
    _write_tokenizer(gguf_path, arch, meta.get("tokenizer.chat_template"), out)
    st = Path(gguf_path).stat()
    marker = {
        "source": str(Path(gguf_path).resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
    }
    (out / SOURCE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def gguf_config(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """Build an HF config.json dict from GGUF metadata (`tensors`: GGUF name -> ReaderTensor).

    Keys read, as llama.cpp writes them for every architecture here: `{arch}.block_count`, `.context_length`,
    `.embedding_length`, `.feed_forward_length`, `.attention.head_count`, `.attention.head_count_kv`,
    `.attention.key_length` / `.value_length` (when head_dim is not hidden / heads: Qwen3),
    `.attention.layer_norm_rms_epsilon`, `.rope.freq_base`, `.rope.dimension_count`, `.rope.scaling.*`,
    `.vocab_size` (else the token list's length); tied embeddings when `output.weight` is absent. What an
    architecture adds (Gemma 3's layer types and softcapping, Phi-3's LongRoPE, Qwen3-MoE's experts, Mistral
    3's attention temperature) is `runtime.models.gguf_arch.arch_config`'s.
    """
    arch = meta["general.architecture"]
    spec = ARCHS[arch]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    if "token_embd.weight" not in tensors:
        raise ValueError("the file has no token_embd.weight tensor")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list: only uniform values map onto an HF config
        if len(set(kv_heads)) != 1:
            raise ValueError(f"per-layer KV head counts {sorted(set(kv_heads))} are not supported")
        kv_heads = kv_heads[0]
    head_dim = int(get("attention.key_length", hidden // heads))
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"value head dim {value_dim} != key head dim {head_dim} is not supported")
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":  # Phi-3 / Phi-4-mini: partial rotary (`arch_config`)
        raise ValueError(
            f"partial rotary embedding (rope dim {rope_dim} != head dim {head_dim}) is not supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = int(get("vocab_size", len(tokens) if tokens else None))
    embd_rows = int(tensors["token_embd.weight"].shape[-1])  # GGUF shapes are [cols, rows]
    if embd_rows != vocab_size:
        raise ValueError(f"vocab size {vocab_size} disagrees with token_embd rows {embd_rows}")
    layers = int(get("block_count"))

    config: dict[str, Any] = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, tensors, head_dim),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        # the classic key; transformers 5 reads "dtype" (and warns on torch_dtype alone)
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if spec.model_type in ("qwen2", "qwen3"):  # llama.cpp serves them with full attention: so do we
        config |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers}
    for key in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
    return arch_config(arch, meta, tensors, config)


def _rope_scaling(meta: dict[str, Any], arch: str, tensors: dict[str, Any], head_dim: int) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if "rope_freqs.weight" in tensors:
        return _infer_llama3_rope(
            tensors["rope_freqs.weight"], _f32(meta.get(f"{arch}.rope.freq_base", 1e4)), head_dim
        )
    if kind in (None, "none") or factor in (None, 0.0, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":  # Qwen2.5 / Qwen3 long-context files: factor and the context trained without it
        rope: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(factor)}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig:
            rope["original_max_position_embeddings"] = int(orig)
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := meta.get(f"{arch}.rope.scaling.{key}")) is not None:
                rope[hf] = _f32(value)
        # settings that would make llama.cpp's YaRN differ from transformers' default one
        if arch == "mistral3":  # its graph undoes YaRN's magnitude scaling (mistral3.cpp): attention factor 1
            rope["attention_factor"] = 1.0
        neutral_log_mul = (
            (0.0,) if arch != "mistral3" else (meta.get(f"{arch}.rope.scaling.yarn_log_multiplier"),)
        )
        for key, neutral in (("yarn_log_multiplier", neutral_log_mul), ("attn_factor", (1.0,)),
                             ("yarn_attn_factor", (1.0,)), ("yarn_ext_factor", (1.0, -1.0))):  # fmt: skip
            if meta.get(f"{arch}.rope.scaling.{key}") not in (None, *neutral):
                raise ValueError(f"GGUF YaRN setting {arch}.rope.scaling.{key} is not supported")
        return rope
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported")


def llama3_rope_divisors(
    base: float, head_dim: int, factor: float, low: float, high: float, original_ctx: int
) -> np.ndarray:
    """Per-frequency divisors of Llama 3.x RoPE scaling (what llama.cpp stores as rope_freqs),
    [head_dim // 2]: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    smoothly."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original_ctx / wavelen - low) / (high - low), 0.0, 1.0)
    # smooth == 0 -> divide by factor (long wavelengths); smooth == 1 -> unchanged (short wavelengths)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _infer_llama3_rope(tensor: Any, base: float, head_dim: int) -> dict:
    from gguf.quants import dequantize

    divisors = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    for factor, low, high, ctx in _LLAMA3_ROPE_CANDIDATES:
        expected = llama3_rope_divisors(base, head_dim, factor, low, high, ctx)
        if expected.shape == divisors.shape and np.allclose(expected, divisors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": ctx,
            }
    raise ValueError(
        "GGUF rope_freqs do not match any known Llama 3 RoPE scaling; this model is not supported"
    )


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF parameter name for a GGUF tensor name of architecture `arch` (`block_tensors`: stacked experts as
    mlp.experts.<proj>.weight, Phi-3's fused projections whole); None for tensors that are not parameters
    (rope_freqs, Phi-3's rope_factors_long / _short).
    """
    if gguf_name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        return None
    m = _BLOCK_RE.match(gguf_name)
    names = block_tensors(ARCHS[arch])
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no equivalent in radixlm's decoder (unsupported model variant)"
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time Q/K row permutation (weights [n_heads * head_dim, in] or bias [n_heads *
    head_dim]).

    HF Llama applies RoPE with rotate_half: within a head, component i pairs with i + head_dim/2. llama.cpp
    pairs adjacent components (2i, 2i+1), so its converter reorders each head's rows from
    [x0..x_{d/2-1}, y0..y_{d/2-1}] to [x0, y0, x1, y1, ...]. Here each head's rows are read as (d/2, 2) and
    transposed back to (2, d/2).
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(
    tensor: Any, config: dict[str, Any], rope_permuted: bool, norm_shift: float = 0.0
) -> np.ndarray:
    """Float32 numpy array in HF layout ([out, in] for matrices) for one GGUF tensor (type and shape already
    checked by `check_types` / `check_tensors`); `norm_shift` is taken back off norm weights (Gemma)."""
    w = dequantize_tensor(tensor).numpy()  # a fresh array: never the memory-mapped file's own bytes
    if norm_shift and tensor.name.endswith("norm.weight"):
        w = w - np.float32(norm_shift)
    if rope_permuted and ".attn_q." in tensor.name:
        w = unpermute_rope_rows(w, config["num_attention_heads"])
    elif rope_permuted and ".attn_k." in tensor.name:
        w = unpermute_rope_rows(w, config["num_key_value_heads"])
    return np.ascontiguousarray(w)


def iter_gguf_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, float32 tensor) of every parameter of the GGUF file `model_dir` resolved from,
    dequantized one tensor at a time (peak memory: the model in float32 plus one tensor)."""
    t0 = time.perf_counter()
    path = gguf_source(model_dir)
    reader = open_reader(path)
    arch = reader.fields["general.architecture"].contents()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    count = nbytes = 0
    spec = ARCHS[arch]
    held: dict[str, torch.Tensor] = {}  # gpt-oss: gate / up tensors waiting for their partner
    for t in reader.tensors:
        hf = hf_tensor_name(t.name, arch)
        if hf is None:
            continue
        w = torch.from_numpy(_dequantize(t, config, spec.rope_permuted, spec.norm_shift))
        count += 1
        nbytes += w.numel() * 4
        stacked = t.name.rsplit(".", 2)[1] in STACKED_EXPERTS
        if spec.sinks:  # gpt-oss's own checkpoint names (GptOssForCausalLM.load_weights)
            yield from _gpt_oss_weights(hf, w, held)
        elif stacked:  # [n_expert, out, in]: one HF tensor per expert
            base, _, leaf = hf.rpartition(".experts.")
            for e in range(w.shape[0]):
                yield f"{base}.experts.{e}.{leaf}", w[e]
        else:
            yield hf, w
    if held:
        raise ValueError(f"{path}: expert tensors without their gate / up partner: {sorted(held)[:3]}")
    logger.info(
        "dequantized %d tensors (%.0f MB of float32) from %s in %.2f s",
        count,
        nbytes / 1e6,
        path,
        time.perf_counter() - t0,
    )


def _gpt_oss_weights(
    hf: str, w: torch.Tensor, held: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A gpt-oss file's tensor under transformers' names: the sinks without ".weight"; the experts as the
    checkpoint stacks them, undoing llama.cpp's converter: gate and up ([E, I, H], biases [E, I]) interleaved
    by output back into `gate_up_proj` [E, H, 2I] (gate at even columns) once both have been read (`held`
    keeps the first), `down_proj` transposed to [E, I, H], biases as `<proj>_bias`."""
    if hf.endswith(".self_attn.sinks.weight"):
        yield hf.removesuffix(".weight"), w
        return
    base, sep, leaf = hf.rpartition(".experts.")
    if not sep:
        yield hf, w
        return
    proj, kind = leaf.split(".")
    name = f"{base}.experts.{{}}" + ("_bias" if kind == "bias" else "")
    if proj == "down_proj":
        yield name.format("down_proj"), w if kind == "bias" else w.transpose(1, 2).contiguous()
        return
    partner = f"{base}.experts.{'up_proj' if proj == 'gate_proj' else 'gate_proj'}.{kind}"
    if partner not in held:
        held[hf] = w
        return
    gate, up = (w, held.pop(partner)) if proj == "gate_proj" else (held.pop(partner), w)
    both = torch.stack((gate, up), dim=2)  # [E, I, 2(, H)]: row 2j is gate j, 2j + 1 up j
    if kind == "bias":
        yield name.format("gate_up_proj"), both.flatten(1)
    else:
        yield name.format("gate_up_proj"), both.flatten(1, 2).transpose(1, 2).contiguous()


FLOAT_SHARD_BYTES = 2 << 30  # float_folder's safetensors shards (bounds its peak memory)


def float_folder(model_dir: str) -> str:
    """A Hugging Face folder with float32 safetensors of the GGUF file `model_dir` resolved from, for programs
    that read weights from a folder (transformers, vLLM: the references of tests and benchmarks); written once
    beside it (`<folder>-float32`, 4 bytes a weight) under a lock and renamed into place. Any other folder is
    returned as it is. radixlm itself never needs it."""
    from safetensors.torch import save_file

    if not is_gguf_conversion(model_dir):
        return model_dir
    src = Path(model_dir)
    out = src.with_name(src.name + "-float32")
    if (out / "config.json").is_file():
        return str(out)
    with _file_lock(src.parent / f".{out.name}.lock"):
        if (out / "config.json").is_file():
            return str(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=src.parent))
        try:
            shards: list[dict[str, torch.Tensor]] = [{}]
            size = 0
            for name, w in iter_gguf_weights(model_dir):
                if shards[-1] and size + w.numel() * 4 > FLOAT_SHARD_BYTES:
                    shards.append({})
                    size = 0
                shards[-1][name] = w
                size += w.numel() * 4
            n = len(shards)
            names = (
                ["model.safetensors"]
                if n == 1
                else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
            )
            weight_map = {}
            for shard, fname in zip(shards, names, strict=True):
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map |= dict.fromkeys(shard, fname)
            if n > 1:
                index = {"metadata": {}, "weight_map": weight_map}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            for f in src.iterdir():  # config, generation config, tokenizer; not the marker
                if f.is_file() and f.name != SOURCE_MARKER:
                    shutil.copyfile(f, tmp / f.name)
            _make_readable(tmp)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return str(out)


def fingerprint_source(model_dir: str, h: Any, samples: int = 16, sample_bytes: int = 64 << 10) -> None:
    """Feed `h` (a hashlib object) the GGUF file `model_dir` resolved from: its size and `samples` spans of
    `sample_bytes` spread over it (header and tensor data), so another file at the same path hashes
    differently."""
    path = Path(gguf_source(model_dir))
    size = path.stat().st_size
    h.update(f"|gguf|{size}|".encode())
    with path.open("rb") as f:
        span = max(0, size - sample_bytes)
        for i in range(samples):
            f.seek(span * i // max(1, samples - 1))
            h.update(f.read(sample_bytes))


def _write_generation_config(config: dict[str, Any], out: Path) -> None:
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


# architectures whose files transformers' AutoTokenizer cannot open, as it reads their config first: it has
# none for mistral3, and its gpt-oss reader fails on the rope.scaling keys llama.cpp writes (a TypeError)
_NO_TRANSFORMERS_CONFIG = ("mistral3", "gpt-oss")


def _write_tokenizer(gguf_path: str, arch: str, chat_template: str | None, out: Path) -> None:
    """Build the HF fast tokenizer from the GGUF's own vocabulary and save it; verify the chat template."""
    from transformers import AutoTokenizer

    src = Path(gguf_path)
    if arch in _NO_TRANSFORMERS_CONFIG:  # AutoTokenizer reads the model's config first: only the vocabulary
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(
            str(src.parent), gguf_file=src.name, local_files_only=True
        )
    else:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, local_files_only=True)
    if chat_template and tok.chat_template != chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(out))
    if chat_template:
        reloaded = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
        if reloaded.chat_template != chat_template:
            raise RuntimeError(f"chat template of {gguf_path} was lost when saving the tokenizer")
    else:
        logger.warning("%s has no chat template: chat endpoints will not work with it", gguf_path)


# ---------------------------------------------------------------------------------------------- block readers
def q4_1_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unpack a Q4_1 tensor's bytes into (q uint8 [rows, cols], d fp32 [rows, cols/32], m fp32 [...])."""
    if cols % 32:
        raise ValueError(f"Q4_1 rows must be a multiple of 32 elements, got {cols}")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // 32, _Q4_1_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:]
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1).reshape(rows, cols)
    return q, d, m


def q8_0_blocks(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Unpack a Q8_0 tensor's bytes into (q int8 [rows, cols], d fp32 [rows, cols/32])."""
    if cols % 32:
        raise ValueError(f"Q8_0 rows must be a multiple of 32 elements, got {cols}")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // 32, _Q8_0_BYTES)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return q, d


def gguf_source(model_dir: str) -> str:
    """The GGUF file a converted model folder came from; ValueError when the folder is not a conversion."""
    if not is_gguf_conversion(model_dir):
        raise ValueError(
            f"--quantization gguf needs a GGUF model (--model default or a .gguf file); {model_dir} is a "
            "Hugging Face folder: use --quantization int8 or int4 instead"
        )
    src = json.loads((Path(model_dir) / SOURCE_MARKER).read_text())["source"]
    if not Path(src).is_file():
        raise FileNotFoundError(f"GGUF source {src} of {model_dir} is gone; pass the .gguf file again")
    return src


def fused_blocks(
    tensors: dict[str, Any], names: list[str], heads: list[int | None], kind: str
) -> list[torch.Tensor] | None:
    """The blocks of GGUF parts fused along rows (q|k|v or gate|up), or None if a part is not of `kind`:
    Q4_1 -> [q uint8 0..15, d fp32, m fp32], Q8_0 -> [q int8, d fp32] (d and m exact fp16 values).

    Blocks run along the input dim, so fusing parts along the output dim keeps every block intact; q/k rows
    are un-permuted back to HF's RoPE layout exactly as the fp32 conversion does, when the file's architecture
    was permuted (`tensors` from `source_tensors` knows; a plain dict is taken as llama's).
    """
    if not stored_as(tensors, names, kind):
        return None
    parts = [tensors[n] for n in names]
    unpack = q4_1_blocks if kind == "q4_1" else q8_0_blocks
    per_part = []
    for t, n_heads in zip(parts, heads, strict=True):
        cols, rows = (int(v) for v in t.shape)  # GGUF lists dims innermost first
        arrays = unpack(t.data, rows, cols)
        if n_heads is not None and getattr(tensors, "rope_permuted", True):
            arrays = tuple(unpermute_rope_rows(a, n_heads) for a in arrays)
        per_part.append(arrays)
    return [torch.from_numpy(np.concatenate(a)) for a in zip(*per_part, strict=True)]


def stored_as(tensors: dict[str, Any], names: list[str], kind: str) -> bool:
    """True when every tensor in `names` is stored as block type `kind` ("q4_1", "q8_0", ...)."""
    from gguf import GGMLQuantizationType

    return all(tensors[n].tensor_type == GGMLQuantizationType[kind.upper()] for n in names)


def is_gguf_conversion(model_dir: str) -> bool:
    """True when `model_dir` is a finished conversion of a GGUF file (it names its source)."""
    return (Path(model_dir) / SOURCE_MARKER).is_file()


class SourceTensors(dict):
    """GGUF tensor name -> the reader's tensor (raw blocks), and whether the file's Q/K rows are permuted."""

    rope_permuted: bool = True


def source_tensors(model_dir: str) -> SourceTensors:
    """The tensors of the GGUF file `model_dir` was converted from."""
    reader = open_reader(gguf_source(model_dir))
    tensors = SourceTensors((t.name, t) for t in reader.tensors)
    arch = reader.fields["general.architecture"].contents()
    tensors.rope_permuted = ARCHS[arch].rope_permuted
    return tensors


def check_names(tensors: dict[str, Any], names: list[str]) -> None:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"GGUF source lacks {missing}: it does not match the loaded model")
