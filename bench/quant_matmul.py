"""Micro-benchmark: weight-only int8 / int4 CPU matmul kernels against fp32 `F.linear` on the default model's
linear shapes, so the choice of `--quantization` rests on measured per-layer costs.

    python bench/quant_matmul.py --m 1,8,32,512 --threads 1,2

Prints one line per (threads, M, layer): median milliseconds per call of fp32 `F.linear`, the int8/int4
weight-only kernels `--quantization` uses, and for comparison bf16 `F.linear` (x cast to bf16 and back) and
fbgemm's dynamic int8 linear (activations quantized per call, per tensor, 7 bits: not weight-only) and
`--quantization w8a8`'s layer (the same kernel with per-token scaling, 8 bits on VNNI CPUs) and
`--quantization w4a8`'s Q4_1 layer (int8 activations per block of 32, radixlm's C++ kernel), then per-M sums.
Timings on a shared machine are noisy: record `uptime` next to them. With `--name NAME` the figures (and the
load average before and after) are also written to bench/results/NAME.json.

The per-layer loop calls one weight over and over, so it stays in the core's cache. `--sequence` times what a
decode step reads instead: the model's 30 layers of distinct w4a8 Q4_1 weights and its Q8_0 head called in
model order (each linear's op as the model's decode loop calls it), so every weight streams from L3 or DRAM:

    python bench/quant_matmul.py --sequence --m 1,4 --threads 2
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.harness import common  # noqa: E402
from runtime.models.quantized_linear import (  # noqa: E402
    DynamicInt8Linear,
    pack_int4,
    quantize_int4,
    quantize_int8,
)
from runtime.models.w4a8 import W4A8Linear  # noqa: E402

# SmolLM2-135M (hidden 576, 9 q heads / 3 kv heads of 64, intermediate 1536, vocab 49152): (name, out, in)
SHAPES = [
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]


def _median_ms(fn, min_seconds: float) -> float:
    fn()
    samples: list[float] = []
    t_end = time.perf_counter() + min_seconds
    while time.perf_counter() < t_end or len(samples) < 5:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _kernels(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every candidate y = x @ w^T for one weight, fp32 in and out (conversions included in the cost)."""
    q8, s8 = quantize_int8(w)
    q4, sz4 = quantize_int4(w, 32)
    p4 = pack_int4(q4)
    wb = w.to(torch.bfloat16)
    # fbgemm dynamic int8 (activations quantized per call, per tensor): not weight-only, for comparison
    qw = torch.quantize_per_channel(w, s8.double(), torch.zeros_like(s8, dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    w8a8 = DynamicInt8Linear(w)  # what --quantization w8a8 runs: per-token scaling around linear_dynamic
    w4a8 = W4A8Linear.from_float("q4_1", w)  # what --quantization w4a8 runs for a linear layer
    return {
        "fp32": lambda x: F.linear(x, w),
        "int8": lambda x: torch._weight_int8pack_mm(x, q8, s8),
        "int4": lambda x: torch._weight_int4pack_mm_for_cpu(x, p4, 32, sz4),
        "bf16": lambda x: F.linear(x.to(torch.bfloat16), wb).float(),
        "w8a8dyn": lambda x: torch.ops.quantized.linear_dynamic(x, packed, True),
        "w8a8": w8a8,
        "w4a8": w4a8,
    }


NUM_LAYERS = 30  # SmolLM2-135M


def _sequence(ms: list[int], threads: list[int], seconds: float) -> list[dict]:
    """Milliseconds per pass over the model's distinct w4a8 linears (the layers, then the head)."""
    torch.manual_seed(0)
    layers = [
        W4A8Linear.from_float("q4_1", torch.randn(n, k) * 0.02)
        for _ in range(NUM_LAYERS)
        for name, n, k in SHAPES
        if name != "lm_head"
    ]
    head = W4A8Linear.from_float("q8_0", torch.randn(SHAPES[-1][1], SHAPES[-1][2]) * 0.02)
    calls = [(*lin.decode_call(), lin.in_features) for lin in layers]
    head_fn, head_args = head.decode_call()
    rows: list[dict] = []
    heads = ("layers min", "layers med", "head min", "head med")
    print(f"{'thr':>3} {'M':>4} " + " ".join(f"{h:>11}" for h in heads) + f" {'GB/s':>6}")
    weight_bytes = sum(lin.qs.nbytes + lin.d.nbytes + lin.m.nbytes for lin in layers)
    weight_bytes += head.qs.nbytes + head.d.nbytes
    for t in threads:
        torch.set_num_threads(t)
        for m in ms:
            xs = {k: torch.randn(m, k) for k in {k for _, _, k in calls}}
            layer_ms: list[float] = []
            head_ms: list[float] = []
            t_end = time.perf_counter() + seconds
            for i in itertools.count():
                t0 = time.perf_counter()
                for fn, fargs, k in calls:
                    fn(xs[k], *fargs)
                t1 = time.perf_counter()
                head_fn(xs[SHAPES[-1][2]], *head_args)
                t2 = time.perf_counter()
                if i >= 2:  # the first passes load the weights into whatever cache holds them
                    layer_ms.append((t1 - t0) * 1e3)
                    head_ms.append((t2 - t1) * 1e3)
                if i >= 7 and time.perf_counter() > t_end:
                    break
            best = min(a + b for a, b in zip(layer_ms, head_ms, strict=True))
            row = {
                "threads": t,
                "m": m,
                "layers_ms_min": min(layer_ms),
                "layers_ms_median": statistics.median(layer_ms),
                "head_ms_min": min(head_ms),
                "head_ms_median": statistics.median(head_ms),
                "weight_gb_per_s_best": weight_bytes / best / 1e6,
            }
            rows.append(row)
            times = " ".join(
                f"{row[k]:11.3f}"
                for k in ("layers_ms_min", "layers_ms_median", "head_ms_min", "head_ms_median")
            )
            print(f"{t:>3} {m:>4} {times} {row['weight_gb_per_s_best']:6.1f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="1,8,32,512", help="comma-separated token counts (rows of x)")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument(
        "--seconds",
        type=float,
        default=0.3,
        help="minimum timing per kernel and shape (with --sequence: 10x this per M, a pass being 121 calls)",
    )
    p.add_argument(
        "--kernels", default="fp32,int8,int4,bf16,w8a8dyn,w8a8,w4a8", help="comma-separated subset"
    )
    p.add_argument("--name", default=None, help="also write bench/results/NAME.json")
    p.add_argument(
        "--sequence",
        action="store_true",
        help="time one pass over the model's distinct w4a8 layers and head per M instead (weights streamed)",
    )
    args = p.parse_args(argv)
    env = common.environment() if args.name else None
    if env is not None:
        env["load_before"] = common.load_average()
    if args.sequence:
        seq_rows = _sequence(
            [int(v) for v in args.m.split(",")], [int(t) for t in args.threads.split(",")], args.seconds * 10
        )
        if env is not None:
            config = {"command": common.command_line(), **vars(args), "layers": NUM_LAYERS, "shapes": SHAPES}
            common.write_results(args.name, config, {"rows": seq_rows}, env)
        return
    rows: list[dict] = []
    torch.manual_seed(0)
    names = args.kernels.split(",")
    layers = [(name, _kernels(torch.randn(n, k) * 0.02), k) for name, n, k in SHAPES]
    print(f"{'thr':>3} {'M':>4} {'layer':>8} " + " ".join(f"{n + ' ms':>11}" for n in names))
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for m in [int(v) for v in args.m.split(",")]:
            totals = dict.fromkeys(names, 0.0)
            for name, kernels, k in layers:
                if name == "lm_head" and m > 32:
                    continue  # prefill computes logits for the last token of each request only
                x = torch.randn(m, k)
                ms = {n: _median_ms(lambda f=kernels[n], x=x: f(x), args.seconds) for n in names}
                totals = {n: totals[n] + ms[n] for n in names}
                rows.append({"threads": threads, "m": m, "layer": name, "ms": ms})
                print(f"{threads:>3} {m:>4} {name:>8} " + " ".join(f"{ms[n]:11.3f}" for n in names))
            speedups = ""
            if "fp32" in names:  # --kernels may leave it out
                speedups = "   speed-up vs fp32: " + " ".join(
                    f"{n}={totals['fp32'] / totals[n]:.2f}" for n in names if n != "fp32"
                )
            print(
                f"{threads:>3} {m:>4} {'sum':>8} " + " ".join(f"{totals[n]:11.3f}" for n in names) + speedups,
                flush=True,
            )
            rows.append({"threads": threads, "m": m, "layer": "sum", "ms": totals})
    if env is not None:
        config = {"command": common.command_line(), **vars(args), "shapes": SHAPES}
        common.write_results(args.name, config, {"rows": rows}, env)


if __name__ == "__main__":
    main()
