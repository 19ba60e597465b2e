"""Where a decode step's time goes: per-op CPU time of the model runner at given batch sizes and contexts.

Issue 28's agent row loses at batch 4 over a long cached prefix, so each case is (batch size, context):
`bs` requests whose KV already holds `context` tokens decode `--steps` tokens, timed, then a few more under
torch.profiler, whose table (self CPU time per op, top `--top`) says what to remove. The KV slots of the
requests are interleaved through the pool (request i's token t is slot t * bs + i of one allocation),
as a server's pool is after requests arrive together, so attention reads are as scattered as in serving.
A case ending in s (4x1400s) gives every request the same context slots, as the radix cache does for
requests over one cached prefix (issue 28's agents over a tool catalogue); each decodes its own tokens.

    python -m bench.step_profile --cases 1x128,4x1400,32x128 --dtype bfloat16 --threads 2
    python -m bench.step_profile --cases 4x1400 --dtype float32 --quantization w4a8 --kv-cache-dtype float16
    python -m bench.step_profile --model FILE.gguf --cases 1x128,8x128 --dtype float32 \
        --quantization gguf_native --kv-cache-dtype float16
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from bench.harness import common


def parse_cases(spec: str) -> list[tuple[int, int, bool]]:
    """ "4x1400,4x1400s" -> [(4, 1400, False), (4, 1400, True)]: a trailing s shares the context's slots."""
    cases = []
    for part in spec.split(","):
        bs, _, ctx = part.strip().partition("x")
        shared = ctx.endswith("s")
        ctx = ctx.removesuffix("s")
        if not bs.isdigit() or not ctx.isdigit():
            raise ValueError(f"--cases: {part!r} is not BSxCONTEXT or BSxCONTEXTs (e.g. 4x1400, 4x1400s)")
        cases.append((int(bs), int(ctx), shared))
    return cases


def fill_context(
    runner: Any, bs: int, context: int, gen: torch.Generator, shared: bool = False
) -> tuple[list[int], list[int]]:
    """Rows whose first `context` KV slots hold random prompt tokens' KV (one extend forward per request).
    shared: one prompt's slots in every row, as requests over a prefix the radix cache holds."""
    from runtime.model_executor.forward_batch import ForwardBatch

    rows = [runner.req_to_token_pool.alloc() for _ in range(bs)]
    taken = runner.allocator.alloc(context * (1 if shared else bs))
    if taken is None:
        raise RuntimeError(f"the KV pool cannot hold {bs} x {context} tokens")
    if shared:
        slots = taken.view(1, context).expand(bs, context)
    else:
        slots = taken.view(context, bs).t()  # [bs, context]: request i's tokens interleaved with the others'
    last = []
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write(row, 0, slots[i].contiguous())
        if shared and i > 0:
            last.append(last[0])
            continue
        prompt = torch.randint(0, runner.vocab_size, (context,), generator=gen).tolist()
        logits = runner.forward(ForwardBatch.build_extend([prompt], [0], [row], slots[i].contiguous()))
        last.append(int(logits.argmax(-1)))
    return rows, last


def decode_steps(runner: Any, rows: list[int], last: list[int], lens: list[int], steps: int) -> list[int]:
    from runtime.model_executor.forward_batch import ForwardBatch

    for _ in range(steps):
        new = runner.allocator.alloc(len(rows))
        for i, row in enumerate(rows):
            runner.req_to_token_pool.write(row, lens[i], new[i : i + 1])
            lens[i] += 1
        last = runner.forward(ForwardBatch.build_decode(last, lens, rows, new)).argmax(-1).tolist()
    return last


def profile_case(
    runner: Any, bs: int, context: int, steps: int, top: int, seed: int, shared: bool = False
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    runner.allocator.clear()
    with torch.inference_mode():
        rows, last = fill_context(runner, bs, context, gen, shared)
        lens = [context] * bs
        last = decode_steps(runner, rows, last, lens, 2)  # warm-up
        t0 = time.perf_counter()
        last = decode_steps(runner, rows, last, lens, steps)
        step_ms = 1000 * (time.perf_counter() - t0) / steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            decode_steps(runner, rows, last, lens, max(2, steps // 4))
    for row in rows:
        runner.req_to_token_pool.free(row)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    table = [
        {
            "op": e.key,
            "self_ms": round(e.self_cpu_time_total / 1000, 2),
            "share": round(e.self_cpu_time_total / total, 3),
        }
        for e in events[:top]
    ]
    return {
        "bs": bs,
        "context": context,
        "shared_context": shared,
        "step_ms": round(step_ms, 2),
        "tok_s": round(1000 * bs / step_ms, 1),
        "ops": table,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1x128,4x1400,32x128", help="BSxCONTEXT,... (default %(default)s)")
    p.add_argument("--model", default="default", help="the model: 'default', a GGUF file or a folder")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default="none")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto: the model's dtype")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from runtime.model_executor.model_runner import ModelRunner
    from runtime.models.model_loader import resolve_model_path

    cases = parse_cases(args.cases)
    need = max(bs * (ctx + args.steps * 2 + 8) for bs, ctx, _ in cases) + 64
    runner = ModelRunner(
        resolve_model_path(args.model),
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        max_total_tokens=need,
        max_running_requests=max(bs for bs, _, _ in cases),
        context_length=max(ctx for _, ctx, _ in cases) + args.steps * 2 + 16,
    )
    result = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "attention_backend": runner.backend_name,
        "threads": args.threads,
        "load_avg": os.getloadavg()[0],
        "cases": [
            profile_case(runner, bs, ctx, args.steps, args.top, args.seed, shared)
            for bs, ctx, shared in cases
        ],
        "environment": common.environment(),
        "command": common.command_line(),
    }
    for case in result["cases"]:
        what = f"bs {case['bs']} context {case['context']}" + (" (shared)" if case["shared_context"] else "")
        print(f"{what}: {case['step_ms']} ms/step, {case['tok_s']} tok/s")
        for op in case["ops"]:
            print(f"    {op['self_ms']:9.2f} ms {100 * op['share']:5.1f}%  {op['op']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
