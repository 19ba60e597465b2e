"""What a speculative verify row costs: the model runner's step time for a plain decode and for an extend of
each request's last token + k draft tokens over its cached context (k = --drafts), the forward and the greedy
argmax only (no scheduler, no drafting).

bench/speculative.py says whether drafts pay end to end; this says why: a draft token is one more row of the
GEMMs, the LM head and attention, so a verify step costs the decode step plus k rows, and at batch 8 or over
thousands of keys those rows are far from free on a CPU. Cases are BSxCONTEXT as in bench.step_profile
(slots interleaved across requests as in a server's pool).

    python -m bench.verify_cost --cases 1x300,1x2300,8x300 --drafts 0,1,2,4,8 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from bench.step_profile import fill_context, parse_cases


def step_ms(runner: Any, rows: list[int], last: list[int], context: int, k: int, steps: int) -> float:
    """Median ms of `steps` forwards (after 3 unmeasured) of `len(rows)` requests over `context` keys, each
    feeding its last token + k drafts (k = 0: a decode batch); the new slots are freed after each."""
    from runtime.model_executor.forward_batch import ForwardBatch
    from runtime.model_executor.sampler import greedy_ids

    bs, n = len(rows), 1 + k
    times = []
    for _ in range(steps + 3):
        new = runner.allocator.alloc(bs * n)
        for i, row in enumerate(rows):
            runner.req_to_token_pool.write(row, context, new[i * n : (i + 1) * n])
        if k == 0:
            batch = ForwardBatch.build_decode(last, [context + 1] * bs, rows, new)
        else:
            tokens = [[t] * n for t in last]  # the last token and k drafts
            batch = ForwardBatch.build_extend(
                tokens, [context] * bs, rows, new, logits_indices=list(range(bs * n))
            )
        t0 = time.perf_counter()
        greedy_ids(runner.forward(batch))  # the server's argmax (fused C++ on CPU; torch's is 10x slower)
        times.append(time.perf_counter() - t0)
        runner.allocator.free(new)
    times = sorted(times[3:])
    return 1000 * times[len(times) // 2]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1x300,1x2300,8x300", help="BSxCONTEXT,... (default %(default)s)")
    p.add_argument("--drafts", default="0,1,2,4,8", help="draft tokens per request (0: plain decode)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="w4a8")
    p.add_argument("--kv-cache-dtype", default="float16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from runtime.model_executor.model_runner import ModelRunner
    from runtime.models.model_loader import resolve_model_path

    cases = [(bs, ctx) for bs, ctx, _ in parse_cases(args.cases)]
    drafts = [int(k) for k in args.drafts.split(",")]
    runner = ModelRunner(
        resolve_model_path("default"),
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_total_tokens=max(bs * (ctx + 1 + max(drafts)) for bs, ctx in cases) + 64,
        max_running_requests=max(bs for bs, _ in cases),
        context_length=max(ctx for _, ctx in cases) + max(drafts) + 16,
    )
    result: dict[str, Any] = {**vars(args), "load_avg": os.getloadavg()[0], "cases": []}
    for bs, ctx in cases:
        runner.allocator.clear()
        with torch.inference_mode():
            rows, last = fill_context(runner, bs, ctx, torch.Generator().manual_seed(0))
            ms = {k: round(step_ms(runner, rows, last, ctx, k, args.steps), 2) for k in drafts}
        for row in rows:
            runner.req_to_token_pool.free(row)
        result["cases"].append({"bs": bs, "context": ctx, "ms_by_draft_tokens": ms})
        print(f"bs {bs} context {ctx}: " + "  ".join(f"+{k} {v} ms" for k, v in ms.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
