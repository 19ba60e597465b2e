"""One-stream decode of a random-weight GGUF served from its own blocks (`--quantization gguf_native`):
the model's forward at batch 1 through `ModelRunner` (no scheduler, no speculation), tokens/s and the
bandwidth it reads weights at (bytes of the file's projection tensors per token / time per token). Each
--layouts entry (the blocks in the file's layout, or interleaved as the AVX512-VNNI build serves them) is a
model loaded in this one process; their decode steps alternate in --rounds, so both see the same load.

    .venv/bin/python -m bench.gguf_decode --out /tmp/llama1b-q4_k_m.gguf --threads 2

The file is written first if missing: Llama-3.2-1B's shape (16 layers, hidden 2048, MLP 8192, 32 heads, 8 KV
heads, vocabulary 128256, tied embedding), random blocks in a Q4_K_M-like mix (Q4_K; attn_v, ffn_down and the
embedding / head Q6_K), a synthetic vocabulary. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

SCALE_AT = {12: (0, 2), 14: (208,)}  # fp16 scale fields of Q4_K (d, dmin) and Q6_K (d)
SIZES = {12: 144, 14: 210}
SCALE = {12: 0.02 / 15 / 63, 14: 0.02 / 32 / 127}


def random_blocks(qtype: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    raw = rng.integers(0, 256, size=(rows, cols // 256, SIZES[qtype]), dtype=np.uint8)
    for i, at in enumerate(SCALE_AT[qtype]):
        ratio = 7.5 if i else 1.0  # dmin: a block's mean weight near 0
        d = (rng.uniform(0.5, 1.5, size=raw.shape[:2]) * SCALE[qtype] * ratio).astype(np.float16)
        raw[..., at : at + 2] = d[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write(path: Path, layers: int, hidden: int, inter: int, heads: int, kv_heads: int, vocab: int) -> None:
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(0)
    hd = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("random-llama-1b")
    for key, value in {
        "block_count": layers, "context_length": 4096, "embedding_length": hidden,
        "feed_forward_length": inter, "attention.head_count": heads, "attention.head_count_kv": kv_heads,
        "vocab_size": vocab, "rope.dimension_count": hd,
    }.items():  # fmt: skip
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    from tests.unit.test_model_loader import _TOKENS

    tokens = [*_TOKENS, *(f"<filler{i}>" for i in range(vocab - len(_TOKENS)))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(["h e", "he l"])
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def mat(name: str, rows: int, cols: int, qtype: int) -> None:
        w.add_tensor(name, random_blocks(qtype, rows, cols, rng), raw_dtype=Q(qtype))

    mat("token_embd.weight", vocab, hidden, 14)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        mat(b + "attn_q.weight", hidden, hidden, 12)
        mat(b + "attn_k.weight", kv_heads * hd, hidden, 12)
        mat(b + "attn_v.weight", kv_heads * hd, hidden, 14)
        mat(b + "attn_output.weight", hidden, hidden, 12)
        mat(b + "ffn_gate.weight", inter, hidden, 12)
        mat(b + "ffn_up.weight", inter, hidden, 12)
        mat(b + "ffn_down.weight", hidden, inter, 14)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _rss_gb() -> float:
    """This process's resident memory now (VmRSS), GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/llama1b-q4_k_m.gguf")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="the steps split into rounds, layouts alternating")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=["file", "interleaved"], choices=["file", "interleaved"])
    p.add_argument("--cache", default="/tmp/gguf_decode_cache")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.out)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if not path.exists():
        t0 = time.perf_counter()
        write(path, args.layers, args.hidden, args.inter, args.heads, args.kv_heads, args.vocab)
        print(
            f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )

    from runtime.model_executor.model_runner import ModelRunner
    from runtime.models import model_loader as ml
    from runtime.models.gguf_linear import INTERLEAVE_ENV, GGUFLinear, kernel_isa
    from tests.unit.test_model_parity import Harness

    folder = ml.resolve_model_path(str(path), args.cache)
    kernel_isa()  # the kernels built / loaded before any timing
    runs = {}
    for layout in args.layouts:  # each layout's model in this process, decoded in alternating rounds
        os.environ[INTERLEAVE_ENV] = "all" if layout == "interleaved" else "0"
        rss0, t0 = _rss_gb(), time.perf_counter()
        runner = ModelRunner(
            folder, dtype="float32", device="cpu", max_total_tokens=4096, max_running_requests=4,
            quantization="gguf_native",
        )  # fmt: skip
        load_s = time.perf_counter() - t0
        gc.collect()
        weight_bytes = sum(
            sum(w.numel() for w in m.weights()) for m in runner.model.modules() if isinstance(m, GGUFLinear)
        )
        h = Harness(runner)
        logits = h.extend({0: list(range(3, 35))})
        token = int(logits[-1].argmax())
        for _ in range(4):  # warm-up
            token = int(h.decode({0: token})[0].argmax())
        runs[layout] = {"h": h, "token": token, "seconds": 0.0, "load_s": load_s, "bytes": weight_bytes,
                        "rss_GB": _rss_gb() - rss0}  # fmt: skip
    per_round = max(1, args.steps // args.rounds)
    for _ in range(args.rounds):
        for run in runs.values():
            t0 = time.perf_counter()
            for _ in range(per_round):
                run["token"] = int(run["h"].decode({0: run["token"]})[0].argmax())
            run["seconds"] += time.perf_counter() - t0
    results = {}
    for layout, run in runs.items():
        per_token = run["seconds"] / (per_round * args.rounds)
        results[layout] = {
            "load_s": round(run["load_s"], 2), "decode_tok_s": round(1 / per_token, 2),
            "ms_per_token": round(per_token * 1e3, 2), "weights_read_GB": round(run["bytes"] / 1e9, 3),
            "weight_GB_s": round(run["bytes"] / per_token / 1e9, 2), "rss_added_GB": round(run["rss_GB"], 3),
        }  # fmt: skip
    from bench.harness import common

    out = {
        "command": common.command_line(), "environment": common.environment(),
        "file": str(path), "file_GB": round(path.stat().st_size / 1e9, 3), "threads": args.threads,
        "isa": kernel_isa(), "cpu": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2),
        "layouts": results,
    }  # fmt: skip
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
