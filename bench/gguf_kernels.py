"""GB/s of weights read by the GGUF block kernels (runtime/models/gguf_linear.py) at a few activation rows,
per block type, against the w4a8 Q4_1 / Q8_0 kernels on the same shape.

    .venv/bin/python -m bench.gguf_kernels --rows 2048 --cols 8192 --threads 2

GB/s = weight bytes / seconds per call (median of --iters calls after a warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=2048, help="output features N")
    p.add_argument("--cols", type=int, default=8192, help="input features K")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import sys

    sys.path.insert(0, "tests/unit")
    from test_gguf_kernels import random_blocks

    from runtime.models import w4a8
    from runtime.models.gguf_linear import KERNEL_TYPES, GGUFLinear, kernel_isa

    n, k = args.rows, args.cols
    results = []
    layers = {name: GGUFLinear(k, [(t, random_blocks(t, n, k))]) for t, (name, _, _) in KERNEL_TYPES.items()}
    w = torch.randn(n, k) * 0.02
    layers["w4a8 Q4_1"] = w4a8.W4A8Linear.from_float("q4_1", w)
    layers["w4a8 Q8_0"] = w4a8.W4A8Linear.from_float("q8_0", w)
    for name, layer in layers.items():
        nbytes = sum(b.numel() * b.element_size() for b in layer.buffers() if b is not None)
        for m in args.batch:
            x = torch.randn(m, k)
            s = _time(lambda layer=layer, x=x: layer(x), args.iters)
            results.append({"kernel": name, "batch": m, "ms": s * 1e3, "GB/s": nbytes / s / 1e9})
            print(f"{name:10s} batch {m:3d}: {s * 1e3:7.3f} ms  {nbytes / s / 1e9:6.1f} GB/s", flush=True)
    print(
        json.dumps({"isa": kernel_isa(), "w4a8_isa": w4a8.kernel_isa(), "shape": [n, k], "results": results})
    )


if __name__ == "__main__":
    main()
