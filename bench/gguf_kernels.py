"""GB/s of weights read by the GGUF block kernels (runtime/models/gguf_linear.py) at a few activation rows,
per block type in the file's layout and in the interleaved one (what the AVX512-VNNI build serves Q4_K, Q5_K,
Q6_K and Q8_0 in), against the w4a8 Q4_1 / Q8_0 kernels on the same shape, all in one process.

    .venv/bin/python -m bench.gguf_kernels --rows 2048 --cols 8192 --batch 1 2 4 --threads 1 --copies 8

GB/s = weight bytes / seconds per call (median of --iters calls after a warm-up). With --copies N each kernel
cycles through N layers of different weights, so that N x the layer's bytes beyond the last-level cache
(32 MB here) makes the figures DRAM's, as in decode; "memory" is a float32 sum over 1 GB on the same threads
(the read bandwidth the kernels are bounded by). --out writes the JSON to a file too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

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
    p.add_argument("--copies", type=int, default=1, help="layers of other weights each kernel cycles through")
    p.add_argument("--types", nargs="+", default=["Q4_K", "Q5_K", "Q6_K", "Q8_0"], help="GGML types, or all")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import sys

    sys.path.insert(0, "tests/unit")
    from test_gguf_kernels import random_blocks

    from runtime.models import w4a8
    from runtime.models.gguf_linear import INTERLEAVED_TYPES, KERNEL_TYPES, GGUFLinear, kernel_isa

    n, k, copies = args.rows, args.cols, args.copies
    types = [t for t, v in KERNEL_TYPES.items() if "all" in args.types or v[0] in args.types]
    big = torch.ones(2**28)  # 1 GB
    memory = big.nbytes / _time(big.sum, 10) / 1e9
    del big
    print(f"memory (float32 sum of 1 GB): {memory:6.1f} GB/s", flush=True)
    kernels: dict[str, list[torch.nn.Module]] = {}
    for t in types:
        name = KERNEL_TYPES[t][0]
        blocks = [random_blocks(t, n, k, seed=c) for c in range(copies)]
        kernels[name] = [GGUFLinear(k, [(t, b)], interleaved=()) for b in blocks]
        if t in INTERLEAVED_TYPES and kernel_isa() == "avx512_vnni":
            kernels[name + " il"] = [GGUFLinear(k, [(t, b)], interleaved=INTERLEAVED_TYPES) for b in blocks]
    ws = [torch.randn(n, k) * 0.02 for _ in range(copies)]
    kernels["w4a8 Q4_1"] = [w4a8.W4A8Linear.from_float("q4_1", w) for w in ws]
    kernels["w4a8 Q8_0"] = [w4a8.W4A8Linear.from_float("q8_0", w) for w in ws]
    results = []
    for m in args.batch:
        x = torch.randn(m, k)
        for name, layers in kernels.items():
            nbytes = sum(b.numel() * b.element_size() for b in layers[0].buffers() if b is not None)
            it = iter(range(10**9))

            def call(layers=layers, it=it, x=x):
                return layers[next(it) % len(layers)](x)

            s = _time(call, args.iters)
            results.append({"kernel": name, "batch": m, "ms": s * 1e3, "GB/s": nbytes / s / 1e9})
            print(f"{name:10s} batch {m:3d}: {s * 1e3:7.3f} ms  {nbytes / s / 1e9:6.1f} GB/s", flush=True)
    from bench.harness import common

    out = {
        "command": common.command_line(), "environment": common.environment(),
        "isa": kernel_isa(), "w4a8_isa": w4a8.kernel_isa(), "shape": [n, k], "threads": args.threads,
        "copies": copies, "memory_GB_s": round(memory, 1), "load_average": round(os.getloadavg()[0], 2),
        "results": results,
    }  # fmt: skip
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
