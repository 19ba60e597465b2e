"""The paged attention op alone: `paged_attention_kv` over 30 layers of the default model's shapes (9 query
heads over 3 KV heads of 64 dims), the time of one decode step's attention.

bench.step_profile says the op is most of a long-context step; this separates its arithmetic from its memory
traffic. Each layer has its own pool (as a server's), so a step reads every layer's K/V from DRAM once;
`--same-pool` gives all layers one pool, which stays in cache: the gap between the two is time spent
waiting on memory. Slots are interleaved across requests as in bench.step_profile (`--layout interleaved`:
what decoding a batch one token per request per step leaves); `contiguous` gives each request one run of
slots (what a per-request page would), `scattered` a random permutation of a 4x larger pool (a pool
fragmented by cache evictions and freed draft tokens). A case ending in s shares its context's slots
between the requests, as the radix cache does; `eN` makes each request extend N tokens instead of decoding
one.

    python -m bench.paged_attention_op --cases 4x1400,4x1400s,32x128,4x1400e8 --threads 2
    python -m bench.paged_attention_op --cases 4x1400 --threads 1 --same-pool
    python -m bench.paged_attention_op --cases 8x300,8x2300 --kv-dtype bfloat16 --layout contiguous

`--vs-torch-native` also times, per case, what the cpu backend runs for extends longer than its
`FUSED_MAX_EXTEND`: torch_native's per-request gather of the context out of the pool, then flash attention
over the prefix and the new tokens (`attend_prefix_then_causal`). The ratio says where that threshold lies:

    python -m bench.paged_attention_op --cases 1x1400e32,1x1400e64,1x1400e128,1x4000e64 --vs-torch-native
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from typing import Any

import torch

from radixlm_kernels.torch_native import attend_prefix_then_causal

H, HKV, D, LAYERS = 9, 3, 64, 30


def parse_case(spec: str) -> tuple[int, int, int, bool]:
    """ "4x1400e8s" -> (batch 4, context 1400, 8 new tokens each, shared context)."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:e(\d+))?(s?)", spec.strip())
    if not m:
        raise ValueError(f"--cases: {spec!r} is not BSxCONTEXT[eN][s] (e.g. 4x1400, 4x1400s, 4x1400e8)")
    return int(m[1]), int(m[2]), int(m[3] or 1), m[4] == "s"


LAYOUTS = ("interleaved", "contiguous", "scattered")


def slot_table(bs: int, ctx: int, ext: int, shared: bool, layout: str, gen: torch.Generator) -> torch.Tensor:
    """[bs, ctx + ext] KV slots (from 1) of each request's tokens, laid out as `layout` says."""
    seq = ctx + ext
    table = torch.zeros(bs, seq, dtype=torch.int64)
    for i in range(bs):
        if shared:
            table[i, :ctx] = torch.arange(ctx) + 1
            table[i, ctx:] = ctx + 1 + i * ext + torch.arange(ext)
        elif layout == "contiguous":
            table[i] = i * seq + torch.arange(seq) + 1
        else:
            table[i] = torch.arange(seq) * bs + i + 1
    if layout == "scattered":  # every slot mapped to a random one of a 4x larger pool
        used = int(table.max())
        table = (torch.randperm(4 * used, generator=gen)[:used] + 1)[table - 1]
    return table


def time_case(
    spec: str,
    reps: int,
    same_pool: bool,
    kv_dtype: torch.dtype,
    gen: torch.Generator,
    layout: str,
    vs_torch_native: bool = False,
) -> dict[str, Any]:
    bs, ctx, ext, shared = parse_case(spec)
    seq = ctx + ext
    table = slot_table(bs, ctx, ext, shared, layout, gen)
    size = int(table.max()) + 8
    pools = 1 if same_pool else LAYERS
    k = [torch.randn(size, HKV, D, generator=gen).to(kv_dtype) for _ in range(pools)]
    v = [torch.randn(size, HKV, D, generator=gen).to(kv_dtype) for _ in range(pools)]
    loc = table[:, ctx:].reshape(-1).contiguous()
    qkv = torch.randn(bs * ext, (H + 2 * HKV) * D, generator=gen)
    q, kn, vn = qkv.view(bs * ext, H + 2 * HKV, D).split([H, HKV, HKV], dim=1)
    meta = (table, torch.arange(bs), torch.full((bs,), seq), torch.full((bs,), ext), D**-0.5)
    op = torch.ops.radixlm.paged_attention_kv

    def step() -> None:
        for layer in range(LAYERS):
            op(q, kn, vn, loc, k[layer % pools], v[layer % pools], *meta)

    case = {"case": spec, **_timed(step, reps)}
    if vs_torch_native:
        qf = q.contiguous()

        def native_step() -> None:  # the pool already holds the new tokens' K/V (written by the op)
            for layer in range(LAYERS):
                for i in range(bs):
                    qi = qf[i * ext : (i + 1) * ext].transpose(0, 1).unsqueeze(0)
                    ki = k[layer % pools].index_select(0, table[i]).float().transpose(0, 1).unsqueeze(0)
                    vi = v[layer % pools].index_select(0, table[i]).float().transpose(0, 1).unsqueeze(0)
                    if ctx:
                        attend_prefix_then_causal(qi, ki, vi, ctx, D**-0.5)
                    else:
                        torch.nn.functional.scaled_dot_product_attention(
                            qi, ki, vi, is_causal=True, scale=D**-0.5, enable_gqa=True
                        )

        native = _timed(native_step, reps)
        case["torch_native_min_ms"] = native["min_ms"]
        case["torch_native_over_op"] = round(native["min_ms"] / case["min_ms"], 2)
    return case


def _timed(step: Any, reps: int) -> dict[str, float]:
    """min and median ms of `reps` calls of step(), after one warm-up call."""
    step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(1000 * (time.perf_counter() - t0))
    times.sort()
    return {"min_ms": round(times[0], 2), "median_ms": round(times[len(times) // 2], 2)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1x128,4x1400,4x1400s,32x128,4x1400e8")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--same-pool", action="store_true", help="one pool for every layer: K/V stay in cache")
    p.add_argument("--kv-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--layout", default="interleaved", choices=LAYOUTS, help="where requests' KV slots lie")
    p.add_argument(
        "--vs-torch-native", action="store_true", help="also time torch_native's extend path (gather + flash)"
    )
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    from runtime.models.native_kernels import PAGED_ATTENTION, paged_attention_isa

    PAGED_ATTENTION.load()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    kv_dtype = getattr(torch, args.kv_dtype)
    result = {
        "isa": paged_attention_isa(),
        "threads": args.threads,
        "same_pool": args.same_pool,
        "kv_dtype": args.kv_dtype,
        "layout": args.layout,
        "load_avg": os.getloadavg()[0],
        "cases": [],
    }
    for spec in args.cases.split(","):
        case = time_case(spec, args.reps, args.same_pool, kv_dtype, gen, args.layout, args.vs_torch_native)
        result["cases"].append(case)
        native = ""
        if args.vs_torch_native:
            ratio = case["torch_native_over_op"]
            native = f"; torch_native {case['torch_native_min_ms']:8.2f} ms min ({ratio}x)"
        print(
            f"{spec:12s} {case['min_ms']:8.2f} ms min, {case['median_ms']:8.2f} ms median per step{native}",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
