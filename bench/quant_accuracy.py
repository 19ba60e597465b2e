"""Cheap accuracy proxy for `--quantization`: next-token top-1 agreement and KL(fp32 || mode) over every
position of a few short prompts, on the default model. It is not MMLU (which decides the default), only a
minutes-long check that a mode's logits stay close to fp32's.

    python bench/quant_accuracy.py --modes int8,int4,gguf --threads 1
    python bench/quant_accuracy.py --modes bfloat16,w8a8,bfloat16+none --threads 1
    python -m bench.quant_accuracy --modes w4a8,bfloat16,w8a8 --threads 1 --name quant_accuracy

A mode is QUANT (float32 activations), DTYPE (no quantization) or DTYPE+QUANT, optionally followed by
@KV_DTYPE, the KV cache's storage dtype (`--kv-cache-dtype`; e.g. `w4a8@float16`). With --name the figures
also go to bench/results/NAME.json (the source `--quantization auto`'s table cites).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PROMPTS = [
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP through a process "
    "called",
    "In 1492, Christopher Columbus sailed across the Atlantic Ocean. His voyages led to the European "
    "colonization of",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "print(fibonacci(",
    "Question: What is the capital of Australia?\nA. Sydney\nB. Melbourne\nC. Canberra\nD. Perth\nAnswer:",
]


DTYPES = ("float32", "bfloat16", "float16")


def parse_mode(mode: str) -> tuple[str, str]:
    """'int8' -> (float32, int8); 'bfloat16' -> (bfloat16, none); 'float32+w8a8' -> (float32, w8a8)."""
    if "+" in mode:
        dtype, quant = mode.split("+", 1)
        return dtype, quant
    return (mode, "none") if mode in DTYPES else ("float32", mode)


def all_logits(model_dir: str, mode: str, seqs: list[list[int]]) -> torch.Tensor:
    """Float32 logits [sum(len(seqs)), vocab] of one extend batch under mode (see `parse_mode`)."""
    from runtime.model_executor.forward_batch import ForwardBatch
    from runtime.model_executor.model_runner import ModelRunner

    mode, _, kv_dtype = mode.partition("@")
    dtype, quant = parse_mode(mode)
    r = ModelRunner(
        model_dir,
        max_total_tokens=1024,
        max_running_requests=8,
        dtype=dtype,
        quantization=quant,
        kv_cache_dtype=kv_dtype or None,
    )
    rows = [r.req_to_token_pool.alloc() for _ in seqs]
    n = sum(len(s) for s in seqs)
    slots = r.allocator.alloc(n)
    off = 0
    for row, s in zip(rows, seqs, strict=True):
        r.req_to_token_pool.write(row, 0, slots[off : off + len(s)])
        off += len(s)
    batch = ForwardBatch.build_extend(seqs, [0] * len(seqs), rows, slots, logits_indices=list(range(n)))
    return r.forward(batch)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="int8,int4,gguf", help="comma-separated quantization modes")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--name", default=None, help="also write bench/results/NAME.json")
    p.add_argument("--results-dir", default=None, help="where NAME.json goes (default: bench/results)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from runtime.models.model_loader import load_tokenizer, resolve_model_path

    model_dir = resolve_model_path("default")
    tok = load_tokenizer(model_dir)
    seqs = [tok(t)["input_ids"] for t in PROMPTS]
    ref = F.log_softmax(all_logits(model_dir, "none", seqs), -1)
    print(f"{ref.shape[0]} positions; reference: fp32 (the GGUF dequantized)")
    modes = {}
    for mode in args.modes.split(","):
        lq = F.log_softmax(all_logits(model_dir, mode, seqs), -1)
        kl = (ref.exp() * (ref - lq)).sum(-1)
        agree = (lq.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{mode:>14}: top-1 agreement {agree:.3f}, KL mean {kl.mean():.4f} max {kl.max():.4f}")
        modes[mode] = {"top1_agreement": agree, "kl_mean": kl.mean().item(), "kl_max": kl.max().item()}
    if args.name:
        from bench.harness import common
        from runtime.platform import cpu_flags

        flags = sorted(f for f in cpu_flags() if f in ("avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16"))
        config = {
            "command": common.command_line(),
            "modes": list(modes),
            "positions": ref.shape[0],
            "prompts": len(PROMPTS),
            "reference": "float32, quantization none",
            "threads": torch.get_num_threads(),
            "cpu_flags": flags,  # which kernels ran: w4a8's VNNI loop or its scalar one, native bf16 or not
        }
        common.write_results(args.name, config, {"modes": modes}, results_dir=args.results_dir)


if __name__ == "__main__":
    main()
