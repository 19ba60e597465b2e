"""Micro-benchmark: weight-only int8 / int4 CPU matmul kernels against fp32 `F.linear` on the default model's
linear shapes, so the choice of `--quantization` rests on measured per-layer costs.

    python bench/quant_matmul.py --m 1,8,32,512 --threads 1,2

Prints one line per (threads, M, layer): median milliseconds per call for fp32, int8, int4 and the speed-up.
Timings on a shared machine are noisy: record `uptime` next to them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from runtime.models.quantization import pack_int4, quantize_int4, quantize_int8  # noqa: E402

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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="1,8,32,512", help="comma-separated token counts (rows of x)")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--seconds", type=float, default=0.3, help="minimum timing per kernel and shape")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    layers = []
    for name, n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        q8, s8 = quantize_int8(w)
        q4, sz4 = quantize_int4(w, 32)
        layers.append((name, w, q8, s8, pack_int4(q4), sz4))
    head = ("thr", "M", "layer", "fp32 ms", "int8 ms", "int4 ms", "x int8", "x int4")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (3, 4, 8, 9, 9, 9, 7, 7), strict=True)))
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for m in [int(v) for v in args.m.split(",")]:
            totals = [0.0, 0.0, 0.0]
            for name, w, q8, s8, p4, sz4 in layers:
                x = torch.randn(m, w.shape[1])
                calls = [
                    lambda x=x, w=w: F.linear(x, w),
                    lambda x=x, q=q8, s=s8: torch._weight_int8pack_mm(x, q, s),
                    lambda x=x, p=p4, sz=sz4: torch._weight_int4pack_mm_for_cpu(x, p, 32, sz),
                ]
                ms = [_median_ms(fn, args.seconds) for fn in calls]
                totals = [a + b for a, b in zip(totals, ms, strict=True)]
                print(
                    f"{threads:>3} {m:>4} {name:>8} {ms[0]:9.3f} {ms[1]:9.3f} {ms[2]:9.3f} "
                    f"{ms[0] / ms[1]:7.2f} {ms[0] / ms[2]:7.2f}"
                )
            print(
                f"{threads:>3} {m:>4} {'sum':>8} {totals[0]:9.3f} {totals[1]:9.3f} {totals[2]:9.3f} "
                f"{totals[0] / totals[1]:7.2f} {totals[0] / totals[2]:7.2f}"
            )


if __name__ == "__main__":
    main()
