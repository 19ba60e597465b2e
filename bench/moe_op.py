"""The fused CPU MoE op (runtime/models/moe_fused.py) against the per-expert Python loop it replaced, on one
Qwen3-30B-A3B-shaped layer (hidden 2048, 128 experts, top-8, expert intermediate 768), in one process.

    .venv/bin/python -m bench.moe_op --batch 1 8 --threads 1 2 --out bench/results/moe_op_qwen3_30b_a3b.json

Formats: "gguf Q4_K_M" (gate / up Q4_K, down Q6_K: a Q4_K_M file's experts, random blocks) and "w4a8 Q4_1"
(random float weights quantized). The loop is what served them before the op: `grouped_moe_layers` over one
pair of layers per expert (`GGUFLinear` / `W4A8Linear`, each a C++ call; index_select in, index_add_ out).
Each call routes the batch anew (random top-8 of 128, cycling through 64 routings), so, as in decode, the
experts' weights (~390 MB a layer at Q4_K_M) come from DRAM. The two sides are called alternately (on a
shared machine both then meet the same load); ms = median and min_ms = minimum over --iters calls after a
warm-up; ratio = loop ms / fused ms (ratio_min: of the minima).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768


def _time_pair(loop, fused, iters: int) -> list[tuple[float, float]]:
    """[(median, min) seconds per call] of `loop` and `fused`, called alternately (on a shared machine both
    sides then meet the same load) over `iters` rounds after a warm-up."""
    for _ in range(3):
        loop(0)
        fused(0)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(iters):
        for side, fn in enumerate((loop, fused)):
            t0 = time.perf_counter()
            fn(i)
            times[side].append(time.perf_counter() - t0)
    return [(statistics.median(t), min(t)) for t in times]


def _routings(batch: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """n (x [batch, H], weights [batch, k] float32 summing to 1, ids [batch, k] int64 distinct per row)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(batch)])
        w = torch.rand(batch, TOP_K, generator=gen)
        out.append((torch.randn(batch, HIDDEN, generator=gen), w / w.sum(1, keepdim=True), ids))
    return out


def _gguf_layer() -> tuple[torch.nn.Module, list[tuple]]:
    """(GGUFExperts, per-expert (GGUFLinear gate|up, GGUFLinear down).forward pairs) over the same blocks."""
    sys.path.insert(0, "tests/unit")
    from test_gguf_kernels import random_blocks

    from runtime.models.gguf_linear import GGUFLinear
    from runtime.models.moe_fused import GGUFExperts

    q4k, q6k = 12, 14
    gate, up = (
        random_blocks(q4k, EXPERTS * INTER, HIDDEN, seed=s).reshape(EXPERTS, INTER, -1) for s in (1, 2)
    )
    down = random_blocks(q6k, EXPERTS * HIDDEN, INTER, seed=3).reshape(EXPERTS, HIDDEN, -1)
    fused = GGUFExperts([(q4k, gate), (q4k, up), (q6k, down)])
    layers = [
        (GGUFLinear(HIDDEN, [(q4k, gate[e]), (q4k, up[e])]), GGUFLinear(INTER, [(q6k, down[e])]))
        for e in range(EXPERTS)
    ]
    return fused, [(a.forward, b.forward) for a, b in layers]


def _w4a8_layer() -> tuple[torch.nn.Module, list[tuple]]:
    from runtime.models.moe_fused import W4A8Experts
    from runtime.models.w4a8 import W4A8Linear

    gen = torch.Generator().manual_seed(4)
    layers = [
        (
            W4A8Linear.from_float("q4_1", torch.randn(2 * INTER, HIDDEN, generator=gen) * 0.02),
            W4A8Linear.from_float("q4_1", torch.randn(HIDDEN, INTER, generator=gen) * 0.02),
        )
        for _ in range(EXPERTS)
    ]
    return W4A8Experts(layers), [(a.forward, b.forward) for a, b in layers]


def _loop_args(calls: list[tuple], case: tuple) -> tuple:
    x, w, ids = case
    return x, calls, w, ids


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--formats", nargs="+", default=["gguf", "w4a8"], choices=["gguf", "w4a8"])
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    from runtime.models.gguf_linear import kernel_isa
    from runtime.models.moe import grouped_moe_layers

    builders = {"gguf": ("gguf Q4_K_M", _gguf_layer), "w4a8": ("w4a8 Q4_1", _w4a8_layer)}
    results = []
    for fmt in args.formats:
        name, build = builders[fmt]
        fused, calls = build()
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batch:
                cases = _routings(batch, 64, seed=batch)
                timed = _time_pair(
                    lambda i, calls=calls, cases=cases: grouped_moe_layers(*_loop_args(calls, cases[i % 64])),
                    lambda i, fused=fused, cases=cases: fused(*cases[i % 64]),
                    args.iters,
                )
                for side, (med, low) in zip(("loop", "fused"), timed, strict=True):
                    row = {"format": name, "threads": threads, "batch": batch, "side": side}
                    results.append(row | {"ms": med * 1e3, "min_ms": low * 1e3})
                lo, fu = results[-2], results[-1]
                fu["ratio"], fu["ratio_min"] = lo["ms"] / fu["ms"], lo["min_ms"] / fu["min_ms"]
                print(
                    f"{name:12s} threads {threads} batch {batch:2d}: loop {lo['ms']:7.2f} ms (min "
                    f"{lo['min_ms']:6.2f}), fused {fu['ms']:7.2f} ms (min {fu['min_ms']:6.2f}): "
                    f"{fu['ratio']:4.2f}x ({fu['ratio_min']:4.2f}x of the minima)",
                    flush=True,
                )
        del fused, calls
    from bench.harness import common

    out = {
        "command": common.command_line(), "environment": common.environment(), "isa": kernel_isa(),
        "shape": {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "inter": INTER},
        "load_average": [round(v, 2) for v in os.getloadavg()], "results": results,
    }  # fmt: skip
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
