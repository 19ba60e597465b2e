"""Scheduler CPU time per step outside the forward pass, with thousands of queued requests and no model.

The real `Scheduler` (admission policy, prefill adder, radix cache, cache manager, batch building, sampler,
stop checks, output collection) runs over real KV pools; only the model is replaced by a runner whose
forward returns zero logits of the right shape, so every second measured is scheduling overhead. Two
workloads: `shared` (all requests share a long system prompt, then a few-shot block of 8, then a distinct
question) and `distinct` (no two requests share a token). Requests arrive all at once, as a burst from a
batch client does.

    python -m bench.scheduler_overhead                      # 2,000 requests per workload
    python -m bench.scheduler_overhead --requests 500 --name scheduler_overhead_small

Prints a table and writes bench/results/<name>.json (+ .png): per workload, CPU ms per step (mean, p50,
p99) split into extend and decode steps, steps and requests per second, and the share of steps that
admitted work. Then the queue-depth check (`--queue-depths`): CPU ms per decode step with 64 requests running
and 10 or 1,000 waiting behind them (the default speculative decoding on), which must stay within 10 %.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from bench.harness.common import bar_chart, plot_path, summarize, write_results
from runtime.managers.scheduler.scheduler import Scheduler
from runtime.mem_cache.memory_pool import ReqToTokenPool, SlotAllocator
from runtime.messages import GenerateReq
from runtime.sampling_params import SamplingParams
from runtime.server_args import ServerArgs


class NullRunner:
    """Model runner stand-in for scheduling benchmarks: real request and slot pools, no model. Forward
    returns zeros [rows, vocab] (greedy then picks token 0, never EOS with `ignore_eos`)."""

    backend_name = "none"
    load_seconds = 0.0

    def __init__(self, vocab_size: int, max_total_tokens: int, max_running: int, context_length: int):
        self.device = torch.device("cpu")
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.req_to_token_pool = ReqToTokenPool(max_running + 1, context_length + 8, self.device)
        self.allocator = SlotAllocator(max_total_tokens, self.device)
        self.kv_pool = None  # no KV storage: no host or disk tier either
        self.lora = None  # no LoRA adapter slots
        self.config = type("Config", (), {"eos_token_ids": (), "sliding_windows": ()})()  # no sliding layers

    @property
    def max_total_tokens(self) -> int:
        return self.allocator.size

    def forward(self, batch) -> torch.Tensor:
        rows = batch.logits_indices.numel() if batch.logits_indices is not None else batch.seq_lens.numel()
        return torch.zeros(rows, self.vocab_size)

    def keepalive(self) -> None:
        pass


def workload(kind: str, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(3, 40000) for _ in range(k)]  # noqa: E731
    if kind == "distinct":
        return [tok(rng.randrange(64, 192)) for _ in range(n)]
    system = tok(256)
    shots = [tok(rng.randrange(32, 96)) for _ in range(8)]
    return [system + shots[i % 8] + tok(rng.randrange(8, 48)) for i in range(n)]


def run_workload(kind: str, args: argparse.Namespace, tokenizer) -> dict:
    sargs = ServerArgs(
        model="default",
        device="cpu",
        dtype="float32",
        log_interval=0,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running,
        max_queued_requests=args.requests,
        schedule_policy=args.policy,
    )
    runner = NullRunner(args.vocab, args.max_total_tokens, args.max_running, 8192)
    s = Scheduler(sargs, "", runner=runner, tokenizer=tokenizer)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(workload(kind, args.requests, args.seed)):
        s.handle(GenerateReq(rid=f"{kind}-{i}", input_ids=ids, params=params))
    extend_ms, decode_ms = [], []
    finished = 0
    t0 = time.process_time()
    while s.has_work():
        before_ext = s.stats["extend_steps"]
        c0 = time.process_time()
        outs = s.step()
        ms = (time.process_time() - c0) * 1e3
        (extend_ms if s.stats["extend_steps"] > before_ext else decode_ms).append(ms)
        finished += sum(o.finished_reason is not None for o in outs)
    total = time.process_time() - t0
    s.check_accounting()
    assert finished == args.requests, f"{finished} of {args.requests} finished"
    steps = extend_ms + decode_ms

    return {
        "workload": kind,
        "cpu_s": round(total, 3),
        "all_ms": summarize(steps),
        "extend_ms": summarize(extend_ms),
        "decode_ms": summarize(decode_ms),
        "requests_per_cpu_s": round(args.requests / total, 1),
        "cache_hit_rate": round(s.stats["cached_tokens"] / max(1, s.stats["prompt_tokens"]), 4),
    }


def run_queue_depth(depth: int, args: argparse.Namespace, tokenizer, steps: int = 60) -> dict:
    """CPU ms per step with `args.max_running` requests decoding and `depth` more waiting (none finish)."""
    sargs = ServerArgs(
        model="default", device="cpu", dtype="float32", log_interval=0,
        max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running,
        max_queued_requests=depth + args.max_running, schedule_policy=args.policy,
    )  # fmt: skip
    s = Scheduler(sargs, "", runner=NullRunner(args.vocab, args.max_total_tokens, args.max_running, 8192),
                  tokenizer=tokenizer)  # fmt: skip
    params = SamplingParams(max_new_tokens=4 * steps, temperature=0.7, ignore_eos=True)
    for i, ids in enumerate(workload("distinct", depth + args.max_running, args.seed)):
        s.handle(GenerateReq(rid=f"q{depth}-{i}", input_ids=ids, params=params))
    while len(s.running) < args.max_running:  # admission: prefill the first max_running
        s.step()
    ms = []
    for _ in range(steps):
        c0 = time.process_time()
        s.step()
        ms.append((time.process_time() - c0) * 1e3)
    assert len(s.waiting) == depth, "a waiting request was admitted: none may finish while measuring"
    return {"waiting": depth, "running": len(s.running), "step_ms": summarize(ms)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--vocab", type=int, default=49152, help="logits width (SmolLM2's vocabulary)")
    ap.add_argument("--policy", default="lpm")
    ap.add_argument("--workloads", default="shared,distinct")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--queue-depths", default="10,1000", help="waiting requests behind the running ones")
    ap.add_argument("--name", default="scheduler_overhead")
    ap.add_argument("--results-dir", default=None, help="where the JSON and PNG go (default bench/results)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from runtime.models.model_loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path("default"))
    rows = [run_workload(kind, args, tokenizer) for kind in args.workloads.split(",")]
    print(f"\nscheduler CPU per step, {args.requests} queued requests, policy {args.policy}, no model")
    print(f"{'workload':10s}{'steps':>8s}{'mean ms':>10s}{'p50 ms':>10s}{'p99 ms':>10s}"
          f"{'extend ms':>11s}{'decode ms':>11s}{'req/cpu s':>11s}{'hit rate':>10s}")  # fmt: skip
    for r in rows:
        a, e, d = r["all_ms"], r["extend_ms"], r["decode_ms"]
        print(f"{r['workload']:10s}{a['n']:8d}{a['mean']:10.2f}{a['p50']:10.2f}{a['p99']:10.2f}"
              f"{e['mean']:11.2f}{d['mean']:11.2f}{r['requests_per_cpu_s']:11.1f}"
              f"{r['cache_hit_rate']:10.3f}")  # fmt: skip
    depths = [run_queue_depth(int(d), args, tokenizer) for d in args.queue_depths.split(",") if d]
    for d in depths:
        st = d["step_ms"]
        print(f"{d['running']} running, {d['waiting']:5d} waiting: {st['mean']:.2f} ms per step (p50 "
              f"{st['p50']:.2f}, p99 {st['p99']:.2f})")  # fmt: skip
    if len(depths) > 1:
        ratio = depths[-1]["step_ms"]["p50"] / depths[0]["step_ms"]["p50"]
        print(f"deepest / shallowest queue, median step: {ratio:.3f} (target <= 1.10)")
    write_results(
        args.name, vars(args), {"workloads": rows, "queue_depth": depths}, results_dir=args.results_dir
    )
    bar_chart(
        plot_path(args.name, args.results_dir),
        [r["workload"] for r in rows],
        {step: [r[f"{step}_ms"]["mean"] for r in rows] for step in ("extend", "decode")},
        "scheduler CPU ms per step (no model)",
        f"{args.requests} queued requests, policy {args.policy}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
